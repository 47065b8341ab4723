"""One-GPU check: every strategy at size 1 on CUDA, in bf16-mixed and 16-mixed, against plain Lightning.

    python benchmarks/gpu_check.py                          # one CUDA GPU; about a minute, under five
    python benchmarks/gpu_check.py --json gpu_check.json    # also write the rows (default: ./gpu_check.json)
    python benchmarks/gpu_check.py --accelerator cpu --tiny # dry run of the script itself on CPU
    python benchmarks/gpu_check.py --only "data_parallel,data_parallel compile"   # some rows only

On a machine without CUDA it prints a line starting "no CUDA" and exits 0. With one GPU it fits the reference
GPT (8 blocks, d=768, 12 heads, 57 M parameters; sequences of 512 tokens of the synthetic Markov corpus, batch
16, 30 steps) once per precision and system, all in this process:

- ``plain``: Lightning's default strategy, twice (the second run shows the GPU's run-to-run noise: atomics in
  embedding and attention backward are not deterministic);
- ``data_parallel``: ``DataParallelStrategy()`` (DDP over one process);
- ``pipeline_parallel``: ``PipelineParallelStrategy(pipeline_parallel_size=1)`` (its default ``microbatches``:
  2, run one after another, so the loss equals plain Lightning's up to the order of the sums);
- ``tensor_parallel``: ``TensorParallelStrategy(tensor_parallel_size=1)`` (DTensors on a one-device mesh).

Then, in bf16-mixed, ZeRO-3 without and with CPU offload (``offload``):

- ``zero3``: ``DataParallelStrategy(zero_stage=3)`` (FSDP2 over one process: its shards are the whole model);
- ``zero3 offload=cpu``: the same with ``offload="cpu"`` (FSDP2's ``CPUOffloadPolicy``: parameters, gradients and
  optimizer state in pinned host memory, the optimizer step on the host); its peak device memory is the
  number to read beside ``zero3``'s: only the gathered parameters of the running block and the activations stay.

And, in bf16-mixed, each strategy with ``compile=True`` (each block compiled by inductor, :mod:`lightning_par.compile`):
``data_parallel compile``, ``pipeline_parallel compile``, ``tensor_parallel compile``; their ``vs eager`` column is
tokens/s over the same strategy's eager row, and ``first step s`` holds the compile time (the eager rows' first
step beside it).

Each row: the largest loss difference from the first plain run over the steps (and at step 0, before any
update), the median step time, tokens/s and MFU from ``ParallelMetrics`` (6 x parameters x tokens/s over the
device's 16-bit peak), and ``torch.cuda.max_memory_allocated`` over the fit. Runs start while less than
``--budget-s`` seconds (default 240) have passed; the rest are listed as skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, ROOT)

PRECISIONS = ("bf16-mixed", "16-mixed")
SYSTEMS = ("plain", "plain (again)", "data_parallel", "pipeline_parallel", "tensor_parallel")
OFFLOAD_SYSTEMS = ("zero3", "zero3 offload=cpu")  # bf16-mixed only
COMPILED_SYSTEMS = ("data_parallel compile", "pipeline_parallel compile", "tensor_parallel compile")  # bf16-mixed
FULL = dict(n_layer=8, n_embd=768, n_head=12, block_size=512, vocab_size=64, batch_size=16, steps=30)
TINY = dict(n_layer=2, n_embd=32, n_head=4, block_size=32, vocab_size=32, batch_size=8, steps=6)
# Lightning's FLOP table knows the H200 only as "h200 sxm1" / "h200 nvl1" (as its dense-with-sparsity
# figures); a plain "NVIDIA H200" has the H100 SXM's compute: 989 TFLOP/s dense in bf16 and fp16.
DENSE_16BIT_PEAK = {"h200": 989e12, "h100": 989e12}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu_check.json", help="where to write the rows")
    parser.add_argument("--accelerator", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run of this script (no CUDA numbers)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and 6 steps (for the CPU dry run)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no run after this many seconds")
    parser.add_argument("--only", default=None, help="comma-separated systems to run (default: all)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's 16-bit peak (TFLOP/s) for MFU; default: Lightning's table")
    return parser.parse_args(argv)


def peak_flops(device, precision: str, override_tflops: float | None) -> float | None:
    import torch
    from lightning.fabric.utilities.throughput import get_available_flops

    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    known = get_available_flops(device, dtype)
    if known:
        return float(known)
    name = torch.cuda.get_device_name(device).lower()
    return next((v for k, v in DENSE_16BIT_PEAK.items() if k in name), None)


def make_strategy(system: str):
    """The default ``start_method="popen"`` starts no process for a world of one: every fit runs here, so the
    callbacks' numbers stay in this process (fork or spawn would run rank 0 in a child)."""
    from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy

    if system.startswith("plain"):
        return "auto"
    if system.endswith(" compile"):  # the same strategy, each block compiled (inductor)
        return {"data_parallel": lambda: DataParallelStrategy(compile=True),
                "pipeline_parallel": lambda: PipelineParallelStrategy(pipeline_parallel_size=1, compile=True),
                "tensor_parallel": lambda: TensorParallelStrategy(tensor_parallel_size=1, compile=True),
                }[system[:-len(" compile")]]()
    return {"data_parallel": lambda: DataParallelStrategy(),
            "pipeline_parallel": lambda: PipelineParallelStrategy(pipeline_parallel_size=1),
            "tensor_parallel": lambda: TensorParallelStrategy(tensor_parallel_size=1),
            "zero3": lambda: DataParallelStrategy(zero_stage=3),
            "zero3 offload=cpu": lambda: DataParallelStrategy(zero_stage=3, offload="cpu")}[system]()


def run_one(system: str, precision: str, sizes: dict, args) -> dict:
    import lightning.pytorch as pl
    import torch

    from lightning_par.callbacks import ParallelMetrics
    from lightning_par.precision import precision_kwargs
    from lightning_par.recipes.common import gpt_workload

    class Losses(pl.Callback):
        def __init__(self):
            self.values: list[float] = []
            self.first_step_s = None

        def on_train_start(self, trainer, pl_module):
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.values.append(float(loss.detach().float()))
            if self.first_step_s is None:  # the first step compiles (compile=True)
                self.first_step_s = time.perf_counter() - self.started

    model = {k: sizes[k] for k in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size")}
    data, make_module = gpt_workload(model, sizes["batch_size"], sizes["batch_size"] * sizes["steps"],
                                     warmup_steps=1)
    device = torch.device("cuda", 0) if args.accelerator == "cuda" else torch.device("cpu")
    losses = Losses()
    metrics = ParallelMetrics(measure_step=1, summary=False,
                              peak_flops_per_device=peak_flops(device, precision, args.peak_tflops))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, strategy=make_strategy(system),
                         max_steps=sizes["steps"], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[losses, metrics],
                         **precision_kwargs(precision, args.accelerator))
    trainer.fit(make_module(), datamodule=data)
    row = {"precision": precision, "system": system, "losses": losses.values, "seconds": time.perf_counter() - start,
           "first_step_s": losses.first_step_s}
    perf = metrics.rows[0] if metrics.rows else {}
    row.update({k: perf[k] for k in ("step_s", "tokens_per_s", "mfu") if k in perf})
    if device.type == "cuda":
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return row


def compare(rows: list[dict]) -> None:
    """Loss differences of every row from the first plain run of its precision (in place)."""
    for row in rows:
        ref = next((r for r in rows if r["precision"] == row["precision"] and r["system"] == "plain"), None)
        if ref is None:  # --only without the plain run: compared with the first row of the precision
            ref = next(r for r in rows if r["precision"] == row["precision"])
        pairs = list(zip(row["losses"], ref["losses"]))
        row["loss_diff_max"] = max(abs(a - b) for a, b in pairs)
        row["loss_diff_step0"] = abs(pairs[0][0] - pairs[0][1])
        row["final_loss"] = row["losses"][-1]
        if row["system"].endswith(" compile"):  # tokens/s over the same strategy's eager row
            eager = next((r for r in rows if r["precision"] == row["precision"]
                          and r["system"] == row["system"][:-len(" compile")]), None)
            if eager is not None and eager.get("tokens_per_s") and row.get("tokens_per_s"):
                row["vs_eager"] = row["tokens_per_s"] / eager["tokens_per_s"]


def table(rows: list[dict]) -> str:
    cols = [("precision", "precision", "{}"), ("system", "system", "{}"), ("final_loss", "final loss", "{:.4f}"),
            ("loss_diff_step0", "|d loss| step 0", "{:.2e}"), ("loss_diff_max", "|d loss| max", "{:.2e}"),
            ("step_s", "step s", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:.0f}"), ("mfu", "MFU", "{:.1%}"),
            ("vs_eager", "vs eager", "{:.2f}x"), ("first_step_s", "first step s", "{:.2f}"),
            ("peak_allocated_bytes", "peak MiB", "mib")]
    widths = [max(len(title), 17 if key == "system" else 10) for key, title, _ in cols]
    lines = ["  ".join(f"{title:>{w}}" for (_, title, _), w in zip(cols, widths))]
    for r in rows:
        cells = []
        for (key, _, fmt), w in zip(cols, widths):
            v = r.get(key)
            text = "-" if v is None else f"{v / 2**20:.0f}" if fmt == "mib" else fmt.format(v)
            cells.append(f"{text:>{w}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.accelerator == "cuda" and not torch.cuda.is_available():
        print("no CUDA: benchmarks/gpu_check.py needs a CUDA GPU; nothing was run.")
        return 0
    sizes = TINY if args.tiny else FULL
    began = time.perf_counter()
    rows, skipped = [], []
    # offload needs device memory to save: refused on the CPU dry run, so that runs zero3 alone
    offload = OFFLOAD_SYSTEMS if args.accelerator == "cuda" else OFFLOAD_SYSTEMS[:1]
    runs = [(p, s) for p in PRECISIONS for s in SYSTEMS] + [("bf16-mixed", s) for s in offload]
    runs += [("bf16-mixed", s) for s in COMPILED_SYSTEMS]
    if args.only:
        chosen = [name.strip() for name in args.only.split(",")]
        unknown = sorted(set(chosen) - {s for _, s in runs})
        if unknown:
            raise SystemExit(f"--only: no system {unknown[0]!r}; choose from {', '.join(dict.fromkeys(s for _, s in runs))}")
        runs = [(p, s) for p, s in runs if s in chosen]
    for precision, system in runs:
        if time.perf_counter() - began > args.budget_s:
            skipped.append(f"{precision} {system}")
            continue
        rows.append(run_one(system, precision, sizes, args))
    compare(rows)
    device = torch.cuda.get_device_name(0) if args.accelerator == "cuda" else "CPU (dry run)"
    print(f"\ngpu_check on {device}; torch {torch.__version__}; GPT {sizes}")
    print(table(rows))
    if skipped:
        print(f"skipped (over --budget-s {args.budget_s:g}): {', '.join(skipped)}")
    with open(args.json, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "sizes": sizes, "rows": rows, "skipped": skipped,
                   "seconds": time.perf_counter() - began}, f, indent=1)
    print(f"wrote {args.json} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
