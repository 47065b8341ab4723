"""DataParallelStrategy(zero_stage=3) vs Lightning's ModelParallelStrategy with a hand-written FSDP2, 2 CPU ranks.

    python benchmarks/zero.py --quick                  # small GPT, 3 rounds
    python benchmarks/zero.py                          # n_embd 256, 4 layers, seq 128, 3 rounds
    python benchmarks/zero.py --variants lightning_fsdp,zero3,zero2,zero0 --rounds 4 --json out.json

Both sides train ``lightning_par.models.GPT`` from the same seed on the same synthetic Markov corpus, with
the same FSDP2 units: ``lightning_fsdp`` is what a Lightning user writes today, ``ModelParallelStrategy(
data_parallel_size=2, tensor_parallel_size=1)`` and a ``configure_model`` that calls ``fully_shard`` on every
block and then on the module; ``zero3`` is the unchanged module under ``DataParallelStrategy(zero_stage=3)``.
``zero2`` and ``zero0`` (DDP) are there for reference. Every run is a fresh interpreter started by Lightning's
popen launcher (the default of both strategies); runs are interleaved round by round, the order reversed
every other round (AB BA ...), so slow drift of a shared machine falls on every variant alike.

What is measured (inside the ranks, by a callback):
- step time: ``perf_counter`` between consecutive ends of training batches after ``--warmup`` steps; a
  2-rank step takes as long as its slower rank; per variant the median over all timed steps of all
  rounds, the per-round medians (their spread), ratio = median / median of ``lightning_fsdp``, and the
  ratio per round (each round's runs are adjacent in time). CPU time: ``process_time`` per step of each
  rank's process (all its threads, gloo's included), median over ranks, steps and rounds: less sensitive
  than wall time to other load on a shared machine. ``min``: the fastest timed step of all rounds (load
  only ever adds time, so the minimum estimates the step's own cost).
- bytes: on one extra step every collective a rank dispatches is counted by
  :func:`lightning_par.comm.count_comm` (all-gathers by their input shard, reduce-scatters by their input);
  wire = what one rank sends (all-gather (N-1) x shard, reduce-scatter (N-1)/N x input). FSDP's formula for
  a step: all-gather the parameters in forward, again in backward for every unit that resharded after
  forward (all but the root, FSDP2's default), reduce-scatter the gradients: (N-1)/N x (P + (P - P_root) + P)
  bytes per rank, P the parameter bytes, P_root those of the root unit (embeddings, final norm, head).
Each process uses ``--threads`` torch threads (default 1: one core per rank on a 2-core machine).
"""
from __future__ import annotations

import json
import statistics
import sys

if __package__:
    from . import _launch
else:                    # run as a file: its folder is on sys.path
    import _launch

VARIANTS = ("lightning_fsdp", "zero3", "zero2", "zero0")
DEFAULT_VARIANTS = "lightning_fsdp,zero3"
FULL = dict(n_embd=256, n_layer=4, n_head=8, vocab=512, seq=128, batch=8, warmup=3, steps=8)
QUICK = dict(n_embd=128, n_layer=2, n_head=4, vocab=256, seq=64, batch=8, warmup=2, steps=6)


# -- inside one run (every rank) -------------------------------------------------------------------

def make_module(variant, cfg):
    import torch

    from lightning_par.models import GPT

    class HandShardedGPT(GPT):
        """What Lightning's ModelParallelStrategy asks of its user: the parallelization, written by hand."""

        def configure_model(self):
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    torch.manual_seed(0)
    cls = HandShardedGPT if variant == "lightning_fsdp" else GPT
    return cls(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
               n_embd=cfg["n_embd"], warmup_steps=2, lr_decay_steps=100)


def make_strategy(variant):
    if variant == "lightning_fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    from lightning_par import DataParallelStrategy

    return DataParallelStrategy(zero_stage=int(variant[-1]))


def root_bytes(module) -> int:
    """Bytes of the parameters no block holds (the root FSDP unit), each tensor once (a DTensor's global size)."""
    from lightning_par.pipeline.discovery import find_blocks

    in_blocks = {id(p) for p in find_blocks(module)[1].parameters()}
    return sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in in_blocks)


def run_inner(args):
    from lightning_par.comm import CommCounter, count_comm
    from lightning_par.dp.fsdp import local_training_bytes

    cfg = json.loads(args.cfg)

    def record(trainer, pl_module, counter):
        param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())  # global shapes
        return {"calls": dict(counter.calls), "wire": dict(counter.wire), "wire_bytes": counter.wire_bytes,
                "param_bytes": param_bytes, "root_bytes": root_bytes(pl_module),
                "local": local_training_bytes(pl_module, trainer.optimizers)}

    clock = _launch.clock(args, cfg, new_counter=CommCounter, counting=count_comm, record=record)
    _launch.fit(args, cfg, devices=2, strategy=make_strategy(args.inner),
                make_module=lambda: make_module(args.inner, cfg), callback=clock)


# -- the driver ------------------------------------------------------------------------------------

step_times = _launch.step_times


def summarize(variant, runs):
    first = runs[0][0]
    n, p, p_root = first["world"], first["param_bytes"], first["root_bytes"]
    if variant == "zero0":        # DDP: ring all-reduce of the gradients
        formula = 2 * (n - 1) / n * p
    elif variant == "zero2":      # gathered once per step, never resharded before backward
        formula = (n - 1) / n * 2 * p
    else:
        formula = (n - 1) / n * (3 * p - p_root)
    return {"variant": variant, "median_s": statistics.median(t for recs in runs for t in step_times(recs)),
            "median_cpu_s_per_rank": statistics.median(c for recs in runs for r in recs for c in r["cpu_s"]),
            "min_s": min(t for recs in runs for t in step_times(recs)),
            "round_medians_s": [statistics.median(step_times(recs)) for recs in runs],
            "calls": first["calls"], "wire_bytes_per_rank": [r["wire_bytes"] for r in runs[0]],
            "formula_bytes": formula, "param_bytes": p, "root_bytes": p_root,
            "local_bytes_per_rank": [r["local"] for r in runs[0]], "final_loss": first["final_loss"]}


def main(argv=None):
    started = _launch.start(__doc__, argv, __file__, full=FULL, quick=QUICK, variants=VARIANTS,
                            default_variants=DEFAULT_VARIANTS, rounds=(3, 3), quick_help="small GPT",
                            run_inner=run_inner, ranks=lambda v: 2, prefix="zerobench")
    if started is None:
        return 0
    args, cfg, variants, runs, failures, t0 = started

    rows = {v: summarize(v, rs) for v, rs in runs.items() if rs}
    base = rows.get("lightning_fsdp")
    print()
    print(f"{'variant':15s} {'median ms':>10s} {'vs Lightning':>12s} {'round medians ms (spread)':>30s} "
          f"{'cpu ms/rank':>11s} {'cpu vs L':>8s} {'min ms':>7s} {'min vs L':>8s} "
          f"{'wire MiB/rank':>14s} {'formula MiB':>11s} {'wire/formula':>12s} {'p+g+opt MiB/rank':>17s}  collectives")
    for v, r in rows.items():
        r["ratio_vs_lightning_fsdp"] = r["median_s"] / base["median_s"] if base else None
        rm = r["round_medians_s"]
        spread = f"{'/'.join(f'{1e3 * m:.0f}' for m in rm)} ({100 * (max(rm) - min(rm)) / statistics.median(rm):.0f}%)"
        wire = r["wire_bytes_per_rank"]
        r["wire_over_formula"] = [w / r["formula_bytes"] for w in wire]
        local = "/".join(f"{sum(b.values()) / 2**20:.2f}" for b in r["local_bytes_per_rank"])
        ratio = "" if r["ratio_vs_lightning_fsdp"] is None else f"{r['ratio_vs_lightning_fsdp']:.3f}"
        r["cpu_ratio_vs_lightning_fsdp"] = r["median_cpu_s_per_rank"] / base["median_cpu_s_per_rank"] if base else None
        cpu_ratio = "" if base is None else f"{r['cpu_ratio_vs_lightning_fsdp']:.3f}"
        print(f"{v:15s} {1e3 * r['median_s']:10.1f} {ratio:>12s} {spread:>30s} "
              f"{1e3 * r['median_cpu_s_per_rank']:11.1f} {cpu_ratio:>8s} {1e3 * r['min_s']:7.1f} "
              f"{'' if base is None else format(r['min_s'] / base['min_s'], '.3f'):>8s} "
              f"{'/'.join(f'{w / 2**20:.2f}' for w in wire):>14s} {r['formula_bytes'] / 2**20:11.2f} "
              f"{'/'.join(f'{x:.3f}' for x in r['wire_over_formula']):>12s} {local:>17s}  "
              + ", ".join(f"{k} x{c}" for k, c in sorted(r["calls"].items())))
    for v, r in rows.items():   # each round's two runs are adjacent in time: less drift between them
        if base and v != "lightning_fsdp" and len(r["round_medians_s"]) == len(base["round_medians_s"]):
            r["round_ratios_vs_lightning_fsdp"] = [a / b for a, b in zip(r["round_medians_s"], base["round_medians_s"])]
            print(f"{v}: per-round ratio vs lightning_fsdp "
                  + " / ".join(f"{x:.2f}" for x in r["round_ratios_vs_lightning_fsdp"]))
    return _launch.finish(args, cfg, rows, failures, t0, compared="the ratio")


if __name__ == "__main__":
    sys.exit(main())
