"""Activation checkpointing: the peak memory of a training step and its time, with ``activation_checkpointing``
off / full / every 2nd block / selective, per layout (one device, DP2, PP2, TP2), each run in a process of its own.

    python benchmarks/activation_memory.py --quick            # GPT 4 x 64, 512 tokens, batch 4; ~4 min on 2 cores
    python benchmarks/activation_memory.py                    # GPT 8 x 128, 1024 tokens, batch 4
    python benchmarks/activation_memory.py --layouts single,pp2 --modes off,full
    python benchmarks/activation_memory.py --accelerator cuda --layouts single   # max_memory_allocated
    python benchmarks/activation_memory.py --quick --layouts single,cp2,cp4 --modes off,full   # context parallel
    python benchmarks/activation_memory.py --model llama --layouts single,cp2 --modes off   # HF Llama, 8k vocabulary

The sequence is long beside the width, so activations dominate the step (Korthikanti et al.: about
s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit, against 16·12·h² bytes of parameters, gradients and AdamW state).
Each (layout, mode) fits the reference GPT for ``--steps`` steps in a fresh interpreter; step 0 is a warm-up (it
allocates the optimizer state) and the measured steps are 1 and on. Per rank, the step's peak is measured from the
start of the first measured step to the end of the last, net of what the rank held at that start (the weights,
their gradients, the optimizer state): what forward and backward add, the activations first of all. The row shows
the worse rank, the median step time, and beside them the ratios to the same layout's run without checkpointing,
measured side by side in the same invocation (the machine is shared and noisy: read the ratios).

[Note: resident memory of a training step]
CPU: the peak resident set (``VmHWM``, restarted by Linux's ``clear_refs``: lightning_par.peak_memory.PeakMemory).
glibc's malloc keeps freed memory resident for reuse once its mmap threshold has adapted to large blocks, so the
step of a warmed-up process would reuse the last step's pages and show no peak at all; every run therefore starts
with ``MALLOC_MMAP_THRESHOLD_=65536`` (a fixed threshold: every block of 64 KiB or more is mapped when allocated
and returned to the system when freed), and the resident set follows the tensors alive. CUDA:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, net of ``memory_allocated`` at the start.

Target (issue #22): full <= 0.35 x the activation memory of off at <= 1.45 x its step time; selective between.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, ROOT)

LAYOUTS = ("single", "dp2", "pp2", "tp2")
CONTEXT = ("cp2", "cp4")  # context parallelism (not in the default list): compare with single's rows
MODES = ("off", "full", "2", "selective")
QUICK = dict(n_layer=4, n_embd=64, n_head=4, block_size=512, vocab_size=64, batch_size=4)
FULL = dict(n_layer=8, n_embd=128, n_head=4, block_size=1024, vocab_size=64, batch_size=4)
# a Hugging Face Llama as a user trains it (its own shifted-label loss, ``labels=``), with a real vocabulary: at 512
# tokens its logits are the largest activation of the step ([Note: sharded to the loss] in lightning_par/context/loss.py)
LLAMA = dict(n_layer=4, n_embd=128, n_head=4, block_size=512, vocab_size=8192, batch_size=4)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small size (a few minutes on 2 CPU cores)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {LAYOUTS + CONTEXT}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    parser.add_argument("--model", default="gpt", choices=("gpt", "llama"),
                        help="the reference GPT, or a Hugging Face Llama (LLAMA's sizes; --quick does not apply)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (the first is a warm-up)")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--record", action="store_true", help="also write the table into docs/performance.md")
    parser.add_argument("--one", nargs=3, metavar=("LAYOUT", "MODE", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def setting(mode: str):
    return None if mode == "off" else int(mode) if mode.isdigit() else mode


def strategy_for(layout: str, mode: str, accelerator: str):
    from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                               TensorParallelStrategy)

    ac = setting(mode)
    start = "fork" if accelerator == "cpu" else "spawn"
    if layout in CONTEXT:  # every rank holds 1/cp of each sequence inside the blocks
        cp = int(layout[2:])
        return HybridParallelStrategy(context_parallel_size=cp, activation_checkpointing=ac, start_method=start), cp
    if layout == "single":  # popen at one device: no process is started, the fit runs in this one
        return DataParallelStrategy(activation_checkpointing=ac), 1
    if layout == "dp2":
        return DataParallelStrategy(activation_checkpointing=ac, start_method=start), 2
    if layout == "pp2":  # 2 micro-batches of 2: 1F1B holds at most 2 in flight on the first stage
        return PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, activation_checkpointing=ac,
                                        start_method=start), 2
    return TensorParallelStrategy(tensor_parallel_size=2, activation_checkpointing=ac, start_method=start), 2


def run_one(layout: str, mode: str, out: str, sizes: dict, steps: int, accelerator: str) -> None:
    """In a fresh interpreter: fit, and write each rank's step peak and step times to ``out``.rank<r>."""
    import lightning.pytorch as pl
    import torch

    from lightning_par.peak_memory import PeakMemory
    from lightning_par.recipes.common import gpt_workload

    class Measure(pl.Callback):
        def __init__(self):
            self.meter, self.times, self.t0 = None, [], 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                self.meter = PeakMemory(trainer.strategy.root_device)
                self.meter.start()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= 1:
                self.times.append(time.perf_counter() - self.t0)
            if batch_idx == steps - 1:
                with open(f"{out}.rank{trainer.global_rank}", "w") as f:
                    json.dump({"peak_bytes": self.meter.net(), "step_s": statistics.median(self.times)}, f)

    torch.set_num_threads(1)
    model = {k: sizes[k] for k in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size")}
    data, make_module = gpt_workload(model, sizes["batch_size"], sizes["batch_size"] * 2 * steps, warmup_steps=1)
    if sizes is LLAMA:
        make_module = hf_llama(model)
    strategy, devices = strategy_for(layout, mode, accelerator)
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Measure()])
    trainer.fit(make_module(), datamodule=data)


def hf_llama(model: dict):
    """A user's module around ``LlamaForCausalLM`` built from a config (SDPA attention), trained on its own loss."""
    import lightning.pytorch as pl
    import torch
    import transformers

    class LitLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            config = transformers.LlamaConfig(
                vocab_size=model["vocab_size"], hidden_size=model["n_embd"], intermediate_size=4 * model["n_embd"],
                num_hidden_layers=model["n_layer"], num_attention_heads=model["n_head"],
                max_position_embeddings=model["block_size"], use_cache=False)
            self.model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")

        def training_step(self, batch, batch_idx):
            idx, _ = batch
            loss = self.model(input_ids=idx, labels=idx).loss  # Hugging Face shifts the labels itself
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def make_module():
        torch.manual_seed(0)
        return LitLlama()
    return make_module


def measure(layout: str, mode: str, sizes: dict, steps: int, accelerator: str, quick: bool,
            model: str = "gpt") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row")
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",  # [Note: resident memory ...]
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, os.path.abspath(__file__), "--one", layout, mode, out, "--steps", str(steps),
               "--accelerator", accelerator, "--model", model] + (["--quick"] if quick else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        ranks = sorted(f for f in os.listdir(tmp) if f.startswith("row.rank"))
        if done.returncode != 0 or not ranks:
            raise RuntimeError(f"{layout} {mode} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        rows = [json.load(open(os.path.join(tmp, f))) for f in ranks]
    return {"layout": layout, "mode": mode, "peak_bytes": max(r["peak_bytes"] for r in rows),
            "step_s": max(r["step_s"] for r in rows), "ranks": rows}


def table(rows: list[dict]) -> str:
    lines = [f"{'layout':>7} {'mode':>10} {'step peak MiB':>14} {'x off':>7} {'step s':>8} {'x off':>7}"]
    for r in rows:
        off = next((o for o in rows if o["layout"] == r["layout"] and o["mode"] == "off"), None)
        mem = f"{r['peak_bytes'] / off['peak_bytes']:.2f}" if off else "-"
        tim = f"{r['step_s'] / off['step_s']:.2f}" if off else "-"
        lines.append(f"{r['layout']:>7} {r['mode']:>10} {r['peak_bytes'] / 2**20:>14.1f} {mem:>7} "
                     f"{r['step_s']:>8.3f} {tim:>7}")
    return "\n".join(lines)


def record_rows(rows: list[dict]) -> list[list]:
    """The rows of :func:`table` as cells (ratios to the same layout's off, side by side)."""
    out = []
    for r in rows:
        off = next((o for o in rows if o["layout"] == r["layout"] and o["mode"] == "off"), None)
        out.append([r["layout"], r["mode"], f"{r['peak_bytes'] / 2**20:.1f}",
                    f"{r['peak_bytes'] / off['peak_bytes']:.2f}" if off else "-", f"{r['step_s']:.3f}",
                    f"{r['step_s'] / off['step_s']:.2f}" if off else "-"])
    return out


def layout_rows(rows: list[dict]) -> list[list]:
    """Each row's peak against the one-device row of the same mode (``-`` where there is none)."""
    out = []
    for r in rows:
        one = next((o for o in rows if o["layout"] == "single" and o["mode"] == r["mode"]), None)
        out.append([r["layout"], r["mode"], f"{r['peak_bytes'] / 2**20:.1f}",
                    f"{r['peak_bytes'] / one['peak_bytes']:.2f}" if one else "-", f"{r['step_s']:.3f}"])
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = LLAMA if args.model == "llama" else QUICK if args.quick else FULL
    if args.one:
        run_one(*args.one, sizes=sizes, steps=args.steps, accelerator=args.accelerator)
        return 0
    if args.accelerator == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA: --accelerator cuda needs a CUDA GPU; nothing was run.")
            return 0
    began = time.perf_counter()
    rows = []
    for layout in args.layouts.split(","):
        for mode in args.modes.split(","):  # side by side: the modes of a layout one after another
            rows.append(measure(layout, mode, sizes, args.steps, args.accelerator, args.quick, args.model))
            print(f"  {layout} {mode}: {rows[-1]['peak_bytes'] / 2**20:.1f} MiB, {rows[-1]['step_s']:.3f} s",
                  flush=True)
    name = "HF Llama" if args.model == "llama" else "GPT"
    print(f"\nactivation_memory on {args.accelerator}; {name} {sizes}; {args.steps} steps (step 0 a warm-up)")
    print(table(rows))
    if args.record:  # [Note: a generated performance page] in lightning_par.performance
        from lightning_par.performance import record

        command = "python benchmarks/activation_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
        caption = f"{name} {sizes}, {args.steps} steps (step 0 a warm-up), on {args.accelerator}"
        if args.model == "llama":  # the layouts side by side: each rank's peak against one device's
            record("benchmark context_memory", title="Context parallel: a rank's step peak, the loss on the pieces",
                   command=command, tables=[(caption, ["layout", "mode", "step peak MiB", "× single", "step s"],
                                             layout_rows(rows))])
        else:
            record("benchmark activation_memory", title="Activation checkpointing: step memory and time per mode",
                   command=command, tables=[(caption, ["layout", "mode", "step peak MiB", "× off", "step s", "× off"],
                                             record_rows(rows))])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "rows": rows, "seconds": time.perf_counter() - began}, f, indent=1)
    print(f"({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
