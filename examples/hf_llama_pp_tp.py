"""A Hugging Face Llama built on the meta device, its weights streamed from a local safetensors snapshot,
trained pipeline x tensor parallel on 4 CPU processes, then converted back to a file `from_pretrained` loads.

    python examples/hf_llama_pp_tp.py                      # 4 CPU processes (gloo), about a minute
    python examples/hf_llama_pp_tp.py --out llama-run --max-steps 4

Steps: (1) save a randomly initialised tiny Llama with `save_pretrained` (a stand-in for a downloaded snapshot);
(2) build the LightningModule inside `trainer.init_module(empty_init=True)`: its parameters take no memory;
(3) `HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, weights=...)`: each rank reads
only its stage's tensor shards from the file; (4) save one consolidated checkpoint; (5) convert it with
`lightning-par-checkpoint convert last.ckpt hf/model.safetensors --strip-prefix model.`; (6) load it with
`LlamaForCausalLM.from_pretrained` and check the loaded weights equal the trained ones.

Lightning's default launcher re-runs this script once per rank (ranks 1-3), so everything before `fit` runs on
every rank; the snapshot is written before the Trainer starts the other ranks.
"""
import argparse
import os
import subprocess
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy

VOCAB, SEQ = 64, 16


class LitLlama(pl.LightningModule):
    """A user's module: a Hugging Face causal LM built from a config, a plain cross-entropy step."""

    def __init__(self, snapshot: str, lr: float = 1e-3):
        super().__init__()
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(snapshot))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def write_snapshot(folder: str) -> None:
    """A tiny randomly initialised Llama saved as Hugging Face saves any model (config.json, model.safetensors)."""
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="llama-pp-tp", help="folder for the snapshot, checkpoint and export")
    parser.add_argument("--max-steps", type=int, default=3)
    args = parser.parse_args()
    snapshot, ckpt, export = (os.path.join(args.out, p) for p in ("snapshot", "last.ckpt", "hf"))
    if os.environ.get("LOCAL_RANK", "0") == "0":  # ranks 1-3 re-run this script after rank 0 wrote it
        write_snapshot(snapshot)

    strategy = HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2,
                                      weights=os.path.join(snapshot, "model.safetensors"), weights_prefix="model.")
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.max_steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with trainer.init_module(empty_init=True):  # parameters on the meta device: no memory until setup
        model = LitLlama(snapshot)
    tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(0))
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=8))
    trainer.save_checkpoint(ckpt)  # every rank takes part; rank 0 writes one file under the module's names
    if trainer.global_rank != 0:
        return

    # a folder `from_pretrained` reads: config.json, and the weights under the Hugging Face names (the
    # checkpoint's `model.model.layers...` become `model.layers...`): lightning-par-checkpoint convert
    transformers.LlamaConfig.from_pretrained(snapshot).save_pretrained(export)
    subprocess.run([sys.executable, "-m", "lightning_par.checkpoint.cli", "convert", ckpt,
                    os.path.join(export, "model.safetensors"), "--strip-prefix", "model."], check=True)
    loaded = transformers.LlamaForCausalLM.from_pretrained(export).state_dict()
    trained = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    initial = transformers.LlamaForCausalLM.from_pretrained(snapshot).state_dict()
    for name, value in loaded.items():
        torch.testing.assert_close(value, trained["model." + name], atol=0, rtol=0)
    changed = sum(not torch.equal(v, initial[n]) for n, v in loaded.items())
    print(f"{export}: {len(loaded)} tensors load with from_pretrained and equal the trained weights "
          f"({changed} changed by training)")


if __name__ == "__main__":
    main()
