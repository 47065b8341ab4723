"""Peak memory per rank by the start of training: one device vs PP2, TP2 and zero 3 of a meta-built module
whose weights stream from a safetensors file (``trainer.init_module(empty_init=True)`` + ``weights=``): the
project's GPT and a user's wrapper of a Hugging Face ``LlamaForCausalLM`` built from a config.

    python benchmarks/meta_memory.py --quick              # GPT 32 × 192, Llama 8 × 256; ~4 minutes on 2 cores
    python benchmarks/meta_memory.py                      # GPT 32 × 384 (57 M parameters), Llama 8 × 512 (35 M)
    python benchmarks/meta_memory.py --models llama --variants one,tp2
    python benchmarks/meta_memory.py --accelerator cuda --models gpt --n-layer 32 --n-embd 2048
    python benchmarks/meta_memory.py --models llama_hf --variants one,one_meta,pp2,tp2   # ~12 minutes on 2 cores

CPU: every rank is its own interpreter (Lightning's popen launcher), and its peak resident memory (``VmHWM``:
tensors, allocator slack, code pages) from just before the Trainer is built (Linux ``clear_refs``) to
``on_train_start``, above what it held then, is reported net of the same for a tiny model (interpreter, torch,
Lightning, process group). Beside it, from a third run of each variant: the CPU allocator's peak tensor bytes
over the same span (:class:`~lightning_par.peak_memory.TensorPeak`, deterministic; a run of its own because
the profiler's buffers count in the resident set). CUDA: ``max_memory_allocated``. Each rank's ratios are to
the bytes of the parameters it holds (its share, the replicated ends included: the issue's bound is ≤ 1.1) and
to one device's net peak (2-way: ≤ 0.6).

Measured (2-core CPU, torch 2.13, default sizes; net peak / held, tensors / held on the worse rank):
GPT pp2 1.02 / 1.00, tp2 1.03 / 1.00, zero3 1.05 / 1.00; Llama pp2 1.01 / 1.00, tp2 1.01 / 1.00, zero3
1.01 / 1.00; one device 2.0 (the model plus the loaded file). Before (the same benchmark on the previous
reader and probe): GPT 1.04 / 3.00, 1.07 / 3.06, 1.07 / 3.00; Llama 1.06 / 3.00, 1.18 / 3.18, 1.07 / 3.00
(``safe_open`` mapped the whole file into one storage for each read, which the allocator counts at the file's
size and whose touched pages stayed resident while the box's view lived; under TP2 the region probe's copies,
a cycle, kept 12 MiB of Llama into training). What the resident set holds beyond the
tensors is code and allocator slack (the first large matrix products page in kernels the tiny run does not
use) and the Python side of sharding 32 blocks, a few MiB whatever the width: at ``--quick`` sizes the GPT's
net peak / held is 1.06-1.10 under pp2 / tp2 and 1.19 under zero3 (5 MiB beside a 27 MiB share), its
tensors / held still 1.00. Tensor parallelism's setup check ([Note: the region probe]) holds about 2 × one
region transiently, before the share is materialized: the peak only where a region is large beside a share
(few blocks).

``llama_hf`` is the Llama as a user writes it, ``LlamaConfig(num_hidden_layers=8, hidden_size=512)`` and
transformers' defaults otherwise (vocabulary 32000, MLP 11008: 673 MiB, the untied ends 125 MiB of it). Measured
(2-core CPU, setup check on; net peak MiB, / held, / one device): one device eager + the loaded file 1346 (2.00);
one device meta + ``weights=`` (``one_meta``, DDP) 1194 (1.77, tensors 2.00); pp2 338 / 400 (1.00; 0.25 / 0.30
of the eager one, 0.50 / 0.59 of the model's own bytes); tp2 400 / 400 (1.00; 0.30, 0.59), tensors / held on tp2
rank 0 1.05-1.11 between runs. With the attention checked too (a meta build's step run on the meta device, its
inputs given seeded values): pp2 unchanged, tp2 405 / 405 (1.02; 0.30 of the eager one, 0.60 of the model's own
bytes), tensors / held on rank 0 1.16: one to three whole MLP weights of the check's copy (21.5 MiB each) are
still allocated when rank 0's share is, rank 1 never (cause not found).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

VARIANTS = ("one", "one_meta", "pp2", "tp2", "zero3")
# block-dominated: 32 blocks of 12·d² parameters each beside a small vocabulary
FULL = dict(n_layer=32, n_embd=384, vocab=256, seq=32, batch=4)    # 57 M parameters, 227 MB fp32
QUICK = dict(n_layer=32, n_embd=192, vocab=128, seq=16, batch=4)   # 14 M parameters, 57 MB fp32
# the Hugging Face Llama of the issue: 8 × 512, MLP 2048, vocabulary 1024 (35 M parameters, 132 MiB fp32)
LLAMA = dict(n_layer=8, n_embd=512, vocab=1024, seq=32, batch=4)
LLAMA_QUICK = dict(n_layer=8, n_embd=256, vocab=512, seq=16, batch=4)  # 9 M parameters, 34 MiB fp32
# the Llama as a user builds it: LlamaConfig(num_hidden_layers=8, hidden_size=512), every other field at transformers'
# default (vocabulary 32000, MLP 11008, 32 heads, untied head): 177 M parameters, 676 MiB fp32, the replicated ends
# (embedding, head) 125 MiB of it; the tokens from a vocabulary of 1024 (the data's Markov table is vocabulary²)
LLAMA_HF = dict(n_layer=8, n_embd=512, vocab=1024, seq=32, batch=4)
LLAMA_HF_QUICK = dict(n_layer=4, n_embd=256, vocab=1024, seq=16, batch=4)
MODELS = {"gpt": (FULL, QUICK), "llama": (LLAMA, LLAMA_QUICK),
          "llama_hf": (LLAMA_HF, LLAMA_HF_QUICK)}  # model -> (sizes, --quick sizes)
TINY = dict(n_layer=2, n_embd=16, vocab=32, seq=16, batch=4)


def build(cfg):
    """The benchmarked module: the project's GPT, or a user's wrapper of a Hugging Face Llama from a config."""
    return llama(cfg) if cfg.get("model", "gpt").startswith("llama") else gpt(cfg)


def llama(cfg):
    import lightning.pytorch as pl
    import torch.nn.functional as F
    import transformers

    class LitLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            # use_cache=True: the pipeline's setup trace of use_cache=False is another issue's (value-dependent masks)
            if cfg["model"] == "llama_hf":  # only the two sizes given, as a user writes it
                config = transformers.LlamaConfig(num_hidden_layers=cfg["n_layer"], hidden_size=cfg["n_embd"])
            else:
                config = transformers.LlamaConfig(
                    vocab_size=cfg["vocab"], hidden_size=cfg["n_embd"], intermediate_size=4 * cfg["n_embd"],
                    num_hidden_layers=cfg["n_layer"], num_attention_heads=8 if cfg["n_embd"] >= 64 else 2,
                    max_position_embeddings=cfg["seq"], tie_word_embeddings=False, use_cache=True)
            self.model = transformers.LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            idx, targets = batch
            return F.cross_entropy(self.model(input_ids=idx).logits.flatten(0, 1), targets.flatten())

        def configure_optimizers(self):
            import torch

            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return LitLlama()


def gpt(cfg):
    from lightning_par.models import GPT

    return GPT(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["n_layer"], n_head=8 if cfg["n_embd"] >= 64
               else 2, n_embd=cfg["n_embd"], warmup_steps=1, lr_decay_steps=10)


def strategy(variant: str, weights: str, prefix: str = ""):
    kw = dict(weights=weights, weights_prefix=prefix)
    from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy

    return {"one": lambda: "auto",
            "one_meta": lambda: DataParallelStrategy(**kw),  # one device, the same meta build and reader
            "pp2": lambda: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, **kw),
            "tp2": lambda: TensorParallelStrategy(tensor_parallel_size=2, **kw),
            "zero3": lambda: DataParallelStrategy(zero_stage=3, **kw)}[variant]()


def inner(args) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_par.data import SyntheticCorpus
    from lightning_par.peak_memory import TensorPeak, held_bytes, peak_resident, reset_peak, resident

    cfg = json.loads(args.cfg)
    torch.set_num_threads(args.threads)
    cuda = cfg["accelerator"] == "cuda"

    class Peak(Callback):
        def on_train_start(self, trainer, module):
            held = held_bytes(module)
            peak = torch.cuda.max_memory_allocated() if cuda else peak_resident()
            rec = {"rank": trainer.global_rank, "peak": peak, "base": base, "held": held,
                   "read": getattr(trainer.strategy, "weights_bytes_read", 0)}
            if tensors is not None:
                tensors.stop()
                rec.update(tensor_peak=tensors.peak, tensor_held=tensors.held)
            with open(os.path.join(args.run_dir, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump(rec, f)

    data = SyntheticCorpus(vocab_size=cfg["vocab"], seq_len=cfg["seq"], train_sequences=8, val_sequences=2)
    devices = 1 if args.inner.startswith("one") else 2
    reset_peak()  # every rank (popen re-runs this script) from here: the Trainer, the model, setup
    base = torch.cuda.memory_allocated() if cuda else resident()  # the data (a vocabulary² Markov table) is before
    # the CPU allocator's bytes (deterministic), in a run of its own: the profiler's buffers would count in the RSS
    tensors = TensorPeak() if cfg.get("tensors") else None
    if tensors is not None:
        tensors.start()
    trainer = Trainer(accelerator=cfg["accelerator"], devices=devices,
                      strategy=strategy(args.inner, cfg["weights"], _prefix(cfg)),
                      max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Peak()])
    if args.inner == "one":  # one device: the model built as usual, then the same file loaded
        from safetensors.torch import load_file

        module = build(cfg)
        module.load_state_dict({_prefix(cfg) + k: v for k, v in load_file(cfg["weights"]).items()}, strict=False)
    else:
        with trainer.init_module(empty_init=True):
            module = build(cfg)
    trainer.fit(module, DataLoader(data.train_set, batch_size=cfg["batch"]))


def _prefix(cfg: dict) -> str:
    return "model." if cfg.get("model", "gpt").startswith("llama") else ""  # the wrapper holds the Hugging Face model as self.model


def write_weights(cfg: dict, directory: str) -> str:
    """The module's weights as a user's file holds them: the GPT's tied head once, the Llama under Hugging Face's
    names (``model.layers.0...``, ``lm_head.weight``)."""
    import torch
    from safetensors.torch import save_file

    path = os.path.join(directory, f"{cfg.get('model', 'gpt')}{cfg['n_layer']}x{cfg['n_embd']}v{cfg['vocab']}.safetensors")
    if os.path.exists(path):
        return path
    torch.manual_seed(0)
    prefix, drop = _prefix(cfg), ("lm_head.weight",) if not _prefix(cfg) else ()
    state = {k[len(prefix):]: v.contiguous() for k, v in build(cfg).state_dict().items() if k not in drop}
    save_file(state, path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller models (GPT 32 × 192, Llama 8 × 256)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json")
    p.add_argument("--dir", help="where the weights files are written (and reused from); default a new temporary one")
    for k in FULL:
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=None)
    p.add_argument("--inner", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        inner(args)
        return 0
    # glibc raises its mmap threshold after large frees, after which freed buffers stay resident as heap slack
    # that depends on each process's history; a fixed threshold returns them (the tensors' bytes are unchanged)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    variants = args.variants.split(",")
    directory = args.dir or tempfile.mkdtemp(prefix="meta-memory-")
    results, failures = {}, []
    for model in args.models.split(","):
        cfg = {**MODELS[model][args.quick], "model": model}
        cfg.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
        rows = {}
        # the tiny run: the same code at the smallest sizes (llama_hf's defaults have no tiny form: 32 heads)
        runs = [("model", cfg), ("tiny", {**TINY, "seq": cfg["seq"], "model": "llama" if model == "llama_hf" else model})]
        if args.accelerator == "cpu":
            runs.append(("tensors", {**cfg, "tensors": True}))
        for size, sizes in runs:
            sizes = {**sizes, "accelerator": args.accelerator}
            sizes["weights"] = write_weights(sizes, directory)  # the same file again for the counted run
            for v in variants:
                recs, err = _launch.launch(__file__, v, sizes, args.threads, args.timeout,
                                           ranks=1 if v.startswith("one") else 2, prefix="meta-memory")
                if err:
                    failures.append(f"{model} {v} ({size}): {err}")
                    print(f"{model} {v} ({size}): FAILED {err}", flush=True)
                    continue
                rows.setdefault(v, {})[size] = recs
                print(f"{model} {v} ({size}): peak per rank {[round(r['peak'] / 2**20) for r in recs]} MiB", flush=True)
        results[model] = summarize(model, cfg, variants, rows)
    for f in failures:
        print("FAILED", f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "failures": failures}, f, indent=1)
    return 1 if failures else 0


def _net(rec: dict, tiny: dict) -> int:
    """A run's peak above what its rank held when the peak was reset, less the same of the tiny model's run."""
    return (rec["peak"] - rec["base"]) - (tiny["peak"] - tiny["base"])


def summarize(model: str, cfg: dict, variants: list[str], rows: dict) -> dict:
    """The table of one model: per variant and rank the net peak, what it holds, and their ratios."""
    vocab = "32000 (tokens < {})".format(cfg["vocab"]) if model == "llama_hf" else cfg["vocab"]
    print(f"\n{model} {cfg['n_layer']} × {cfg['n_embd']}, vocab {vocab}; peak memory by the start of training, "
          f"net of the tiny model's; held = the parameters a rank holds (its share + the replicated ends)")
    print(f"{'variant':8} {'rank':>4} {'net peak MiB':>13} {'held MiB':>9} {'peak/held':>10} {'peak/one':>9} "
          f"{'read MiB':>9} {'tensors MiB':>12} {'tensors/held':>13}")
    one = None  # one device's setup: the meta build with weights= where measured (the model once), else the eager
    for ref in ("one", "one_meta"):  # build plus the loaded file (the model twice)
        if "model" in rows.get(ref, {}) and "tiny" in rows[ref]:
            one = _net(rows[ref]["model"][0], rows[ref]["tiny"][0])
    print(f"peak/one: to the net peak of {'one_meta' if 'one_meta' in rows else 'one'}")
    summary = {"config": cfg, "one_device_net_peak": one, "rows": {}}
    for v in variants:
        if "model" not in rows.get(v, {}) or "tiny" not in rows[v]:
            continue
        for rec, base in zip(rows[v]["model"], rows[v]["tiny"]):
            net = _net(rec, base)
            counted = rows[v].get("tensors")  # the allocator's peak from setup on: no tiny run to subtract
            tensors = counted[rec["rank"]]["tensor_peak"] if counted else float("nan")
            summary["rows"][f"{v}/rank{rec['rank']}"] = {"net_peak": net, "held": rec["held"], "read": rec["read"],
                                                         "tensor_peak": tensors}
            print(f"{v:8} {rec['rank']:>4} {net / 2**20:13.1f} {rec['held'] / 2**20:9.1f} {net / rec['held']:10.2f} "
                  f"{(net / one) if one else float('nan'):9.2f} {rec['read'] / 2**20:9.1f} {tensors / 2**20:12.1f} "
                  f"{tensors / rec['held']:13.2f}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
