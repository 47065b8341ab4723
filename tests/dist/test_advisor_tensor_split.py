"""What a tensor-parallel rank saves of each block, measured on rank 0 of a TP2 fit, against what the advisor
predicts from its one-device probe ([Note: what tensor parallelism leaves whole] in lightning_par/advisor/profile.py):
the blocks' whole tensors once, the rest halved; with sequence parallelism only the column-parallel layers'
gathered inputs (and what does not come from the block's input) whole. The reference GPT (with and without
dropout, whose residual masks stay whole), Hugging Face Llama (RMSNorm, rotary tables handed in, grouped-query
heads, a gated MLP) and GPT-2 (Conv1D)."""
import json

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, seeded
from models import CausalLM, hf_model
from lightning_par.advisor import profile_lightning_module
from lightning_par.advisor.memory import tp_activation_factor, tp_block_bytes
from lightning_par.data import SyntheticCorpus
from lightning_par.models import GPT
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.saved import SavedTensorMeter
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy

BATCH, SEQ = 4, 16


class BlockSaves(pl.Callback):
    """Rank 0, step 0: the bytes autograd saves inside each block of the stack (DTensors by their local shard)."""

    def __init__(self, path: str):
        self.path, self.meter, self.ctx, self.handles = path, None, None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx or trainer.global_rank:
            return
        self.meter = SavedTensorMeter(pl_module.parameters())
        for i, block in enumerate(find_blocks(pl_module)[1]):
            self.handles.append(block.register_forward_pre_hook(lambda *_, i=i: setattr(self.meter, "tag", i)))
            self.handles.append(block.register_forward_hook(lambda *_: setattr(self.meter, "tag", None)))
        self.ctx = self.meter.track()
        self.ctx.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self.ctx is None:
            return
        self.ctx.__exit__(None, None, None)
        for h in self.handles:
            h.remove()
        saved = {str(k): v for k, v in self.meter.by_tag.items() if k is not None}
        with open(self.path, "w") as f:
            json.dump(saved, f)
        self.ctx = None


CASES = {
    "gpt": lambda: GPT(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32),
    "gpt-dropout": lambda: GPT(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, dropout=0.1),
    "llama": lambda: CausalLM(hf_model("llama", vocab_size=64), call={"use_cache": False}),
    "gpt2": lambda: CausalLM(hf_model("gpt2"), call={"use_cache": False}),
}


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tensor_parallel_rank_saves_what_the_probe_predicts(tmp_path, case, sp):
    data = SyntheticCorpus(vocab_size=64, seq_len=SEQ, train_sequences=2 * BATCH, val_sequences=1)
    probe = seeded(CASES[case])
    # the probe on the fit's batch: a tensor that does not grow with the batch (Llama's rotary cos and sin,
    # broadcast over it) is counted per sample of the probe's batch
    tokens = next(iter(DataLoader(data.train_set, batch_size=BATCH)))
    profile = profile_lightning_module(probe, tokens)
    path = str(tmp_path / "saved.json")
    fit_and_record(seeded(CASES[case]), DataLoader(data.train_set, batch_size=BATCH), str(tmp_path),
                   strategy=TensorParallelStrategy(tensor_parallel_size=2, sequence_parallel=sp, start_method="fork",
                                                   timeout=120),
                   devices=2, max_steps=1, callbacks=[BlockSaves(path)])
    with open(path) as f:
        saved = {int(k): v for k, v in json.load(f).items()}
    assert sorted(saved) == list(range(profile.n_blocks)), saved
    for i, got in saved.items():
        whole = (profile.block_whole_sp_bytes if sp else profile.block_whole_bytes)[i]
        everything = profile.block_activation_bytes[i]
        assert 0 < whole < everything, (case, i, whole, everything)
        predicted = tp_block_bytes(profile, i, t=2, sequence_parallel=sp) * BATCH
        # the same tensors counted on both sides: exact up to the probe's per-sample rounding (< 1 B a sample)
        assert abs(got - predicted) <= BATCH, (case, i, got, predicted, whole, everything)
        korthikanti = everything * tp_activation_factor(2, sp) * BATCH
        print(f"{case} block {i}: rank 0 saved {got} B, predicted {predicted:.0f}, Korthikanti's share "
              f"{korthikanti:.0f} ({korthikanti / got:.3f})")
