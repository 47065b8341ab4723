"""Compiled blocks against eager, per layout, side by side in one run: step time, the first step (the compile),
dynamo's graphs and frames (a recompile is a graph beyond one per block class), parameters + gradients + optimizer
state per rank.

    OMP_NUM_THREADS=1 python benchmarks/compile.py                      # DP2, TP2, PP2 1F1B; eager and compile=True
    OMP_NUM_THREADS=1 python benchmarks/compile.py --layouts dp2 --rounds 3 --compile aot_eager

Each run is a Lightning fit of the reference GPT (``--layers`` blocks of width ``--width``, sequences of ``--seq``
tokens, global batch ``--batch``, ``--steps`` AdamW steps, fp32) on 2 CPU processes (fork, gloo); the rounds
alternate the order (eager first, then compiled first) so a shared machine's drift falls on both. The step time is
the median over the steps after the first two; the first step holds dynamo's tracing and inductor's compile.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

LAYOUTS = {"dp2": ("DataParallelStrategy", {}), "tp2": ("TensorParallelStrategy", {"tensor_parallel_size": 2}),
           "pp2": ("PipelineParallelStrategy", {"pipeline_parallel_size": 2, "microbatches": 4})}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="dp2,tp2,pp2")
    p.add_argument("--compile", default="inductor", help="the compiled runs' backend (compile=<this>)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def run(layout: str, compile, args) -> list[dict]:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    import lightning_par
    from lightning_par._compat import compile_counters, reset_compile_counters
    from lightning_par.data import SyntheticCorpus
    from lightning_par.models import GPT

    class Clock(pl.Callback):
        def __init__(self, out):
            self.out, self.ends = out, []

        def on_train_start(self, trainer, pl_module):
            reset_compile_counters()
            self.ends.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            from torch.distributed.tensor import DTensor

            local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
            steps = [b - a for a, b in zip(self.ends, self.ends[1:])]
            params = [p for p in pl_module.parameters() if not p.is_meta]
            state = sum(local(p).numel() * local(p).element_size() for p in params)
            state += sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None)
            for opt in trainer.optimizers:
                for s in opt.state.values():
                    state += sum(local(v).numel() * local(v).element_size() for v in s.values()
                                 if isinstance(v, torch.Tensor))
            with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump({"first_s": steps[0], "step_s": statistics.median(steps[2:]), "state_bytes": state,
                           **compile_counters()}, f)

    torch._dynamo.reset()
    cls, kw = LAYOUTS[layout]
    strategy = getattr(lightning_par, cls)(compile=compile, start_method="fork", **kw)
    data = SyntheticCorpus(vocab_size=256, seq_len=args.seq, train_sequences=args.batch * args.steps)
    with tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        module = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width,
                     warmup_steps=1, lr_decay_steps=100)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Clock(out)])
        trainer.fit(module, DataLoader(data.train_set, batch_size=args.batch // 2))
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def main(argv=None) -> int:
    args = parse_args(argv)
    compiled = True if args.compile == "inductor" else args.compile
    results: dict = {}
    for rnd in range(args.rounds):
        for layout in args.layouts.split(","):
            order = [False, compiled] if rnd % 2 == 0 else [compiled, False]
            for c in order:
                ranks = run(layout, c, args)
                results.setdefault((layout, c is not False), []).append(ranks)
                print(f"round {rnd + 1} {layout} compile={c!r}: step {max(r['step_s'] for r in ranks) * 1e3:.1f} ms, "
                      f"first {max(r['first_s'] for r in ranks):.2f} s", flush=True)
    print(f"\nGPT {args.layers} blocks, width {args.width}, seq {args.seq}, batch {args.batch}, {args.steps} steps, "
          f"fp32, 2 CPU processes; compile={compiled!r}; the slowest rank's median step, each round")
    print(f"{'layout':8s} {'eager ms':>18s} {'compiled ms':>18s} {'ratio':>6s} {'first eager s':>14s} "
          f"{'first comp s':>13s} {'graphs':>7s} {'frames':>7s} {'p+g+o MiB e/c':>15s}")
    rows = []
    for layout in args.layouts.split(","):
        e, c = results[(layout, False)], results[(layout, True)]
        step = lambda runs: [max(r["step_s"] for r in ranks) for ranks in runs]  # noqa: E731
        first = lambda runs: statistics.median(max(r["first_s"] for r in ranks) for ranks in runs)  # noqa: E731
        es, cs = step(e), step(c)
        ratio = statistics.median(cs) / statistics.median(es)
        mib = lambda runs: max(r["state_bytes"] for r in runs[0]) / 2**20  # noqa: E731
        row = {"layout": layout, "eager_ms": [x * 1e3 for x in es], "compiled_ms": [x * 1e3 for x in cs],
               "ratio": ratio, "first_eager_s": first(e), "first_compiled_s": first(c),
               "graphs": max(r["graphs"] for r in c[-1]), "frames": max(r["frames"] for r in c[-1]),
               "state_mib_eager": mib(e), "state_mib_compiled": mib(c)}
        rows.append(row)
        fmt = lambda xs: "/".join(f"{x:.0f}" for x in xs)  # noqa: E731
        print(f"{layout:8s} {fmt(row['eager_ms']):>18s} {fmt(row['compiled_ms']):>18s} {ratio:6.3f} "
              f"{row['first_eager_s']:14.2f} {row['first_compiled_s']:13.2f} {row['graphs']:7d} {row['frames']:7d} "
              f"{row['state_mib_eager']:7.2f}/{row['state_mib_compiled']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
