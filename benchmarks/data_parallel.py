"""DataParallelStrategy vs Lightning's DDPStrategy on the reference GPT, 2 CPU ranks (gloo, fork start).

    python benchmarks/data_parallel.py --quick                 # small GPT, 2 rounds (~2 min on 2 idle cores)
    python benchmarks/data_parallel.py                         # n_embd 256, 4 layers, seq 128, 3 rounds
    python benchmarks/data_parallel.py --variants single,lightning_ddp,ours,ours_powersgd,ours_zero1 --rounds 4 \
        --json out.json

Every run is a fresh interpreter (``--inner``) training ``lightning_par.models.GPT`` from the same seed on
the same synthetic Markov corpus; runs are interleaved round by round, the order reversed every other
round (ABC CBA ...), so slow drift of a shared machine falls on all variants alike.

What is measured (inside the ranks, by a callback):
- step time: ``perf_counter`` between consecutive ends of training batches after ``--warmup`` steps; a
  2-rank step takes as long as its slower rank; the median over all timed steps of all rounds.
- ratio: median step of each variant / median step of Lightning's ``DDPStrategy`` (target <= 1.00).
- scaling efficiency: (2-rank samples/s) / (2 x 1-rank samples/s) at the same per-device batch
  = t(1 rank) / t(2 ranks); the 1-rank run is Lightning on one CPU device (target >= 0.80).
- CPU time: ``process_time`` per step of each rank's process (all its threads, gloo's included); "cpu
  eff" = CPU per step of the 1-rank run / CPU per step of a rank. Less sensitive to other load on the
  machine than wall time, it shows the CPU work data parallelism adds (not the time spent waiting).
- ``*_pinned`` variants pin rank r to core r (``os.sched_setaffinity``), a benchmark setting.
- bytes: on one extra step every ``c10d`` all-reduce a rank dispatches (DDP's reducer and the Python
  comm hooks alike) is counted by a ``TorchDispatchMode``: payload = bytes handed to all-reduce;
  wire = ring all-reduce model 2(N-1)/N x payload. Compared against 2(N-1)/N x gradient bytes (x 1/2
  for a 16-bit hook). "bcast" = bytes a rank broadcasts as the source (ZeRO-1 sends its updated
  parameter shard to the other ranks after each step).
Each process uses ``--threads`` torch threads (default 1: one core per rank on a 2-core machine).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading

if __package__:
    from . import _launch
else:                    # run as a file: its folder is on sys.path
    import _launch

VARIANTS = {
    # name: (devices, strategy spec); the spec is built in the rank process by make_strategy
    "single": (1, None),
    "lightning_ddp": (2, {"lightning": True}),
    "ours": (2, {}),
    "ours_best": (2, {"gradient_as_bucket_view": True, "static_graph": True, "bucket_cap_mb": 100.0}),
    "ours_bf16": (2, {"gradient_as_bucket_view": True, "static_graph": True, "bucket_cap_mb": 100.0,
                      "comm_hook": "bf16"}),
    "ours_fp16": (2, {"comm_hook": "fp16"}),
    "ours_powersgd": (2, {"comm_hook": "powersgd", "powersgd_rank": 4, "powersgd_start_iter": 2}),
    "ours_zero1": (2, {"zero_stage": 1}),
    "ours_best_pinned": (2, {"gradient_as_bucket_view": True, "static_graph": True, "bucket_cap_mb": 100.0,
                             "pin": True}),
    "ours_bf16_pinned": (2, {"gradient_as_bucket_view": True, "static_graph": True, "bucket_cap_mb": 100.0,
                             "comm_hook": "bf16", "pin": True}),
    "single_pinned": (1, {"pin": True}),
}
DEFAULT_VARIANTS = "single,lightning_ddp,ours,ours_best_pinned,ours_bf16_pinned"
FULL = dict(n_embd=256, n_layer=4, n_head=8, vocab=512, seq=128, batch=8, warmup=3, steps=8)
QUICK = dict(n_embd=128, n_layer=2, n_head=4, vocab=256, seq=64, batch=8, warmup=2, steps=5)


# -- inside one run --------------------------------------------------------------------------------

def make_strategy(spec):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_par import DataParallelStrategy

    spec = {k: v for k, v in (spec or {}).items() if k != "pin"}   # pinning is the benchmark's, not a strategy's
    if not spec:
        return "auto"
    if spec.get("lightning"):
        return DDPStrategy(start_method="fork")
    return DataParallelStrategy(start_method="fork", **spec)


@contextlib.contextmanager
def count_allreduce_bytes(counter: dict):
    """Add the payload of every all-reduce this rank issues to ``counter`` while active.

    A dispatch mode sees every ``c10d`` all-reduce dispatched on this thread: DDP's C++ reducer and
    Python hooks called from the backward pass. Modes are thread-local, so collectives that comm-hook
    callbacks issue on gloo's threads (PowerSGD's P and Q all-reduces) are counted by wrapping
    ``torch.distributed.all_reduce`` for calls from other threads."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    def nbytes(x):
        if hasattr(x, "element_size"):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(nbytes(y) for y in x)
        return 0

    def add(tensor):
        with lock:
            counter["calls"] += 1
            counter["payload"] += nbytes(tensor)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0] if func.namespace == "c10d" else None
            if name in ("allreduce_", "allreduce_coalesced_"):
                add(args[0])
            elif name == "broadcast_" and args[2] == rank:   # ZeRO-1 sends its updated shard to the others
                with lock:
                    counter["broadcast_payload"] += nbytes(args[0])
            return out

    lock, this_thread, original = threading.Lock(), threading.get_ident(), dist.all_reduce
    rank = dist.get_rank() if dist.is_initialized() else 0   # the 1-rank run has no process group

    def all_reduce(tensor, *args, **kwargs):
        if threading.get_ident() != this_thread:
            add(tensor)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        with Count():
            yield
    finally:
        dist.all_reduce = original


def run_inner(args):
    import torch

    from lightning_par.dp.zero import optimizer_state_bytes
    from lightning_par.models import GPT

    cfg = json.loads(args.cfg)
    devices, spec = VARIANTS[args.inner]

    def pin(trainer):
        if (spec or {}).get("pin") and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {trainer.local_rank % os.cpu_count()})   # rank r on core r

    def record(trainer, pl_module, counter):
        return {"allreduce_calls": counter["calls"], "allreduce_payload": counter["payload"],
                "broadcast_payload": counter["broadcast_payload"],
                "grad_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad),
                "threads": torch.get_num_threads(),
                "optim_state_bytes": sum(optimizer_state_bytes(o) for o in trainer.optimizers)}

    def make_module():
        torch.manual_seed(0)
        return GPT(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                   n_embd=cfg["n_embd"], warmup_steps=2, lr_decay_steps=100)

    clock = _launch.clock(args, cfg, new_counter=lambda: {"calls": 0, "payload": 0, "broadcast_payload": 0},
                          counting=count_allreduce_bytes, record=record, on_start=pin)
    _launch.fit(args, cfg, devices=devices, strategy=make_strategy(spec), make_module=make_module, callback=clock)


# -- the driver ------------------------------------------------------------------------------------

def summarize(variant, runs):
    step_times = _launch.step_times
    steps = [t for recs in runs for t in step_times(recs)]
    first = runs[0]
    world = first[0]["world"]
    payload = first[0]["allreduce_payload"]
    grad_bytes = first[0]["grad_bytes"]
    cpu = [r["cpu_s"][i] for recs in runs for r in recs for i in range(len(r["cpu_s"]))]
    return {"variant": variant, "ranks": world, "median_s": statistics.median(steps), "n_steps": len(steps),
            "median_cpu_s_per_rank": statistics.median(cpu),
            "round_medians_s": [statistics.median(step_times(recs)) for recs in runs],
            "allreduce_calls": first[0]["allreduce_calls"], "payload_bytes": payload,
            "broadcast_bytes_per_rank": [r["broadcast_payload"] for r in first],
            "wire_bytes": 2 * (world - 1) / world * payload if world > 1 else 0.0,
            "formula_bytes": 2 * (world - 1) / world * grad_bytes if world > 1 else 0.0,
            "grad_bytes": grad_bytes, "final_loss": first[0]["final_loss"],
            "optim_state_bytes_per_rank": [r["optim_state_bytes"] for r in first]}


def main(argv=None):
    started = _launch.start(__doc__, argv, __file__, full=FULL, quick=QUICK, variants=VARIANTS,
                            default_variants=DEFAULT_VARIANTS, rounds=(3, 2), quick_help="small GPT, 2 rounds",
                            run_inner=run_inner, ranks=lambda v: VARIANTS[v][0], prefix="dpbench")
    if started is None:
        return 0
    args, cfg, variants, runs, failures, t0 = started

    rows = {v: summarize(v, rs) for v, rs in runs.items() if rs}
    base = rows.get("lightning_ddp")
    # the 1-rank reference: the faster of the plain and the pinned run (the conservative choice)
    singles = [rows[k] for k in ("single", "single_pinned") if k in rows]
    single = min(singles, key=lambda r: r["median_s"]) if singles else None
    print()
    print(f"{'variant':17s} {'ranks':>5s} {'median ms':>10s} {'vs DDP':>7s} {'scaling eff':>11s} {'cpu ms/rank':>11s} "
          f"{'cpu eff':>7s} {'samples/s':>10s} "
          f"{'allreduces':>10s} {'wire MiB':>9s} {'formula MiB':>11s} {'wire/formula':>12s} {'bcast MiB/rank':>14s} "
          f"{'optim MiB/rank':>14s}  "
          f"round medians ms")
    for v, r in rows.items():
        samples = cfg["batch"] * r["ranks"] / r["median_s"]
        r["samples_per_s"] = samples
        r["ratio_vs_lightning_ddp"] = r["median_s"] / base["median_s"] if base and r["ranks"] == 2 else None
        r["scaling_efficiency"] = single["median_s"] / r["median_s"] if single and r["ranks"] == 2 else None
        r["wire_over_formula"] = r["wire_bytes"] / r["formula_bytes"] if r["formula_bytes"] else None
        r["cpu_efficiency"] = (single["median_cpu_s_per_rank"] / r["median_cpu_s_per_rank"]
                               if single and r["ranks"] == 2 else None)
        # per round, against the 1-rank run of the same round (adjacent in time: less drift between them)
        r["round_scaling_efficiency"] = ([a / b for a, b in zip(single["round_medians_s"], r["round_medians_s"])]
                                         if single and r["ranks"] == 2 else [])
        fmt = lambda x, f: "" if x is None else format(x, f)  # noqa: E731
        print(f"{v:17s} {r['ranks']:5d} {1e3 * r['median_s']:10.1f} {fmt(r['ratio_vs_lightning_ddp'], '7.3f'):>7s} "
              f"{fmt(r['scaling_efficiency'], '11.3f'):>11s} {1e3 * r['median_cpu_s_per_rank']:11.1f} "
              f"{fmt(r['cpu_efficiency'], '7.3f'):>7s} {samples:10.2f} {r['allreduce_calls']:10d} "
              f"{r['wire_bytes'] / 2**20:9.2f} {r['formula_bytes'] / 2**20:11.2f} "
              f"{fmt(r['wire_over_formula'], '12.3f'):>12s} "
              f"{'/'.join(f'{b / 2**20:.1f}' for b in r['broadcast_bytes_per_rank']):>14s} "
              f"{'/'.join(f'{b / 2**20:.1f}' for b in r['optim_state_bytes_per_rank']):>14s}  "
              + "/".join(f"{1e3 * m:.0f}" for m in r["round_medians_s"]))
    for v, r in rows.items():
        if r["round_scaling_efficiency"]:
            print(f"{v}: scaling efficiency per round " + " / ".join(f"{e:.2f}" for e in r["round_scaling_efficiency"]))
    return _launch.finish(args, cfg, rows, failures, t0, compared="the ratios",
                          extra={"variants": {v: VARIANTS[v] for v in variants}})


if __name__ == "__main__":
    sys.exit(main())
