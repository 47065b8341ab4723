"""Compiled blocks against eager, per layout, side by side in one run: steady step time (warm-up and compile left
out), compile time and dynamo's counts (graphs, frames, graph breaks, recompiles: during warm-up and after it),
parameters + gradients + optimizer state per rank.

    OMP_NUM_THREADS=1 python benchmarks/compile.py                      # DP2, TP2, PP2 1F1B; eager and compile=True
    OMP_NUM_THREADS=1 python benchmarks/compile.py --layouts dp2 --rounds 3 --compile aot_eager
    OMP_NUM_THREADS=1 python benchmarks/compile.py --layouts dp2,ddp2 --rounds 3   # beside Lightning's DDPStrategy
    OMP_NUM_THREADS=1 python benchmarks/compile.py --layouts dp2,ddp2,tp2,pp2 --rounds 3 --record  # into the docs

Each run is a Lightning fit of the reference GPT (``--layers`` blocks of width ``--width``, sequences of ``--seq``
tokens, global batch ``--batch``, ``--steps`` AdamW steps, fp32) on 2 CPU processes (fork, gloo); the rounds
alternate the order (eager first, then compiled first) so a shared machine's drift falls on both. ``ddp2`` is
Lightning's own DDPStrategy, eager against the blocks the user wrapped in ``torch.compile`` by hand (inductor):
the same computation as ``dp2`` with ``compile=True``. The first ``--warmup`` steps are left out of the step time
(the first holds dynamo's tracing and inductor's compile, the next ones the backward's compile and the allocator's
warm-up); the step time is the median of the rest, the slowest rank's, with their min-max. ``compile s`` is what
dynamo reports spent compiling (forward frames and backward graphs); ``recompiles`` counts frames compiled again
because a guard failed, during warm-up / after it (a steady run compiles nothing after warm-up: 0). ``ratio`` is
compiled over eager of the medians over rounds, and its spread the lowest and highest ratio within one round (the
two runs of a round are neighbours in time); ``best`` the ratio of the lowest round medians (a shared machine's
load only adds time, so the best round is the least disturbed); with ``dp2`` and ``ddp2`` both run, our
``compile=True`` is also set beside Lightning's DDPStrategy with hand-compiled blocks, round by round. ``--record``
writes the table into docs/performance.md ([Note: a generated performance page] in lightning_par.performance).
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

LAYOUTS = {"dp2": ("DataParallelStrategy", {}), "ddp2": ("ddp", {}),
           "tp2": ("TensorParallelStrategy", {"tensor_parallel_size": 2}),
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
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the step time")
    p.add_argument("--json", default=None)
    p.add_argument("--record", action="store_true", help="also write the table into docs/performance.md")
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
            self.out, self.ends, self.warm = out, [], None

        def on_train_start(self, trainer, pl_module):
            reset_compile_counters()
            self.ends.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())
            if len(self.ends) == args.warmup + 1:
                self.warm = compile_counters()

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
            total, measured = compile_counters(), steps[args.warmup:]
            with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump({"first_s": steps[0], "warmup_s": sum(steps[:args.warmup]),
                           "step_s": statistics.median(measured), "min_s": min(measured), "max_s": max(measured),
                           "state_bytes": state, **total,
                           "recompiles_after_warmup": total["recompiles"] - self.warm["recompiles"],
                           "frames_after_warmup": total["frames"] - self.warm["frames"]}, f)

    torch._dynamo.reset()
    cls, kw = LAYOUTS[layout]
    if cls == "ddp":  # Lightning's own DDPStrategy; compiled: the blocks wrapped by hand, as its users do
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(start_method="fork")
    else:
        strategy = getattr(lightning_par, cls)(compile=compile, start_method="fork", **kw)
    data = SyntheticCorpus(vocab_size=256, seq_len=args.seq, train_sequences=args.batch * args.steps)
    with tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        module = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width,
                     warmup_steps=1, lr_decay_steps=100)
        if cls == "ddp" and compile is not False:
            options = {} if compile is True else {"backend": compile}
            for i, block in enumerate(module.blocks):
                module.blocks[i] = torch.compile(block, **options)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Clock(out)])
        trainer.fit(module, DataLoader(data.train_set, batch_size=args.batch // 2))
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < args.warmup + 3:
        raise SystemExit(f"--steps {args.steps}: give at least --warmup + 3 = {args.warmup + 3} steps")
    compiled = True if args.compile == "inductor" else args.compile
    results: dict = {}
    for rnd in range(args.rounds):
        for layout in args.layouts.split(","):
            order = [False, compiled] if rnd % 2 == 0 else [compiled, False]
            for c in order:
                ranks = run(layout, c, args)
                results.setdefault((layout, c is not False), []).append(ranks)
                low, high = min(r["min_s"] for r in ranks) * 1e3, max(r["max_s"] for r in ranks) * 1e3
                print(f"round {rnd + 1} {layout} compile={c!r}: step {max(r['step_s'] for r in ranks) * 1e3:.1f} ms "
                      f"(min-max {low:.0f}-{high:.0f}), first {max(r['first_s'] for r in ranks):.2f} s", flush=True)
    print(f"\nGPT {args.layers} blocks, width {args.width}, seq {args.seq}, batch {args.batch}, {args.steps} steps "
          f"({args.warmup} of warm-up left out), fp32, 2 CPU processes; compile={compiled!r}; the slowest rank's "
          f"median step each round (ratio: of the medians over rounds)")
    header = ["layout", "eager ms (rounds)", "compiled ms (rounds)", "ratio (round min-max)", "best", "warm-up s e/c",
              "compile s", "graphs", "breaks", "recompiles (after warm-up)", "p+g+o MiB a rank e/c"]
    print(" | ".join(header))
    rows, table = [], []
    fmt = lambda xs: "/".join(f"{x:.0f}" for x in xs)  # noqa: E731
    step = lambda runs: [max(r["step_s"] for r in ranks) for ranks in runs]  # noqa: E731
    for layout in args.layouts.split(","):
        e, c = results[(layout, False)], results[(layout, True)]
        warm = lambda runs: statistics.median(max(r["warmup_s"] for r in ranks) for ranks in runs)  # noqa: E731
        es, cs = step(e), step(c)
        ratio = statistics.median(cs) / statistics.median(es)
        per_round = [b / a for a, b in zip(es, cs)]
        mib = lambda runs: max(r["state_bytes"] for r in runs[0]) / 2**20  # noqa: E731
        last = c[-1]
        row = {"layout": layout, "eager_ms": [x * 1e3 for x in es], "compiled_ms": [x * 1e3 for x in cs],
               "ratio": ratio, "ratio_min": min(per_round), "ratio_max": max(per_round), "best": min(cs) / min(es),
               "warmup_eager_s": warm(e), "warmup_compiled_s": warm(c),
               "compile_s": max(r["compile_s"] for r in last), "graphs": max(r["graphs"] for r in last),
               "frames": max(r["frames"] for r in last), "graph_breaks": max(r["graph_breaks"] for r in last),
               "recompiles": max(r["recompiles"] for ranks in c for r in ranks),
               "recompiles_after_warmup": max(r["recompiles_after_warmup"] for ranks in c for r in ranks),
               "state_mib_eager": mib(e), "state_mib_compiled": mib(c)}
        rows.append(row)
        table.append([layout, fmt(row["eager_ms"]), fmt(row["compiled_ms"]),
                      f"{ratio:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})", f"{row['best']:.3f}",
                      f"{row['warmup_eager_s']:.2f}/{row['warmup_compiled_s']:.2f}", f"{row['compile_s']:.2f}",
                      row["graphs"], row["graph_breaks"], f"{row['recompiles']} ({row['recompiles_after_warmup']})",
                      f"{row['state_mib_eager']:.2f}/{row['state_mib_compiled']:.2f}"])
        print(" | ".join(str(v) for v in table[-1]))
    tables = [(f"GPT {args.layers} blocks, width {args.width}, seq {args.seq}, batch {args.batch}, {args.steps} steps "
               f"({args.warmup} of warm-up left out), fp32, 2 CPU processes, compile={compiled!r}; ddp2: Lightning's "
               f"DDPStrategy, its blocks compiled by hand", header, table)]
    if (("dp2", True) in results) and (("ddp2", True) in results):  # the same computation: ours against Lightning's
        ours, theirs = step(results[("dp2", True)]), step(results[("ddp2", True)])
        per_round = [a / b for a, b in zip(ours, theirs)]
        ratio = statistics.median(ours) / statistics.median(theirs)
        beside = [["dp2 compile=True / ddp2 hand-compiled", fmt(x * 1e3 for x in ours), fmt(x * 1e3 for x in theirs),
                   f"{ratio:.3f} ({min(per_round):.3f}-{max(per_round):.3f})", f"{min(ours) / min(theirs):.3f}"]]
        print(f"\nours compiled {fmt(x * 1e3 for x in ours)} ms, Lightning DDP hand-compiled "
              f"{fmt(x * 1e3 for x in theirs)} ms: {beside[0][3]}, best {beside[0][4]}")
        tables.append(("Our compiled DP beside Lightning's DDP with hand-compiled blocks (the same computation)",
                       ["", "ours ms (rounds)", "Lightning ms (rounds)", "ratio (round min-max)", "best"], beside))
    if args.record:  # [Note: a generated performance page] in lightning_par.performance
        from lightning_par.performance import record

        record("benchmark compile", title="Compiled blocks against eager, per layout",
               command="OMP_NUM_THREADS=1 python benchmarks/compile.py " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
               tables=tables)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
