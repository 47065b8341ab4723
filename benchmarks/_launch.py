"""What ``data_parallel.py`` and ``zero.py`` share: the command line, one fresh interpreter per run (``--inner``),
the timing callback inside the ranks, the interleaved rounds and the per-step times of a multi-rank run.

Each script keeps what it measures: its variants, its strategies, what a rank records beside the times
(``record``), and its summary and table. Imported as ``_launch`` (the scripts are run as files, so their
folder is on ``sys.path``) or as ``benchmarks._launch``.
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


def start(doc: str, argv, script: str, *, full: dict, quick: dict, variants, default_variants: str,
          rounds: tuple[int, int], quick_help: str, run_inner, ranks, prefix: str):
    """A benchmark's ``main`` up to its summary: parse the command line; as ``--inner`` run ``run_inner(args)`` and
    return None; else run every chosen variant of ``script`` (``ranks(variant)`` ranks) for ``--rounds`` rounds
    (default ``rounds``: (without ``--quick``, with it)) and return (args, cfg, variants, runs per variant, failures, start time).

    The options: ``--quick``, ``--rounds``, ``--variants``, ``--threads``, ``--timeout``, ``--json``, one
    ``--<size>`` per key of ``full`` over the sizes of ``quick``/``full``, and the hidden ``--inner/--run-dir/--cfg``
    of one run."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--variants", default=default_variants, help=f"comma-separated, from {', '.join(variants)}")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--json", help="write the results here")
    for k in full:
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=None)
    p.add_argument("--inner", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        run_inner(args)
        return None

    cfg = dict(quick if args.quick else full)
    cfg.update({k: getattr(args, k) for k in full if getattr(args, k) is not None})
    if args.rounds is None:
        args.rounds = rounds[args.quick]
    chosen = args.variants.split(",")
    unknown = [v for v in chosen if v not in variants]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(variants)}")
    print(f"config {cfg}, {args.rounds} rounds, {args.threads} thread(s) per process, {os.cpu_count()} CPUs",
          flush=True)
    runs, failures, t0 = run_rounds(script, chosen, cfg, args, args.rounds, ranks=ranks, prefix=prefix)
    return args, cfg, chosen, runs, failures, t0


def total_steps(cfg: dict) -> int:
    return cfg["warmup"] + cfg["steps"] + 1          # + 1 counting step


def clock(args, cfg: dict, *, new_counter, counting, record, on_start=None):
    """A Lightning callback that times every training step (``perf_counter`` and ``process_time``), counts
    the collectives of the last step with ``counting(counter)`` (a context manager) and writes this rank's
    ``rank<r>.json`` to ``--run-dir``: the timed steps after ``warmup``, then ``record(trainer, module,
    counter)``, then the final loss."""
    from lightning.pytorch import Callback

    total = total_steps(cfg)
    timed = slice(cfg["warmup"], cfg["warmup"] + cfg["steps"])

    class Clock(Callback):
        def on_train_start(self, trainer, pl_module):
            if on_start is not None:
                on_start(trainer)
            self.ends, self.cpu = [time.perf_counter()], [time.process_time()]
            self.counter, self.mode = new_counter(), None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == total - 1:
                self.mode = counting(self.counter)
                self.mode.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                self.mode = None
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())

        def on_train_end(self, trainer, pl_module):
            steps = [b - a for a, b in zip(self.ends, self.ends[1:])]
            cpu = [b - a for a, b in zip(self.cpu, self.cpu[1:])]
            rec = {"rank": trainer.global_rank, "world": trainer.world_size, "step_s": steps[timed],
                   "cpu_s": cpu[timed], **record(trainer, pl_module, self.counter),
                   "final_loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}
            with open(os.path.join(args.run_dir, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump(rec, f)

    return Clock()


def fit(args, cfg: dict, *, devices: int, strategy, make_module, callback) -> None:
    """One run inside the ranks: ``make_module()`` trained for ``total_steps(cfg)`` steps on the synthetic
    Markov corpus (built before the module, so the module's seed alone sets its initial weights)."""
    import torch
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lightning_par.data import SyntheticCorpus

    torch.set_num_threads(args.threads)
    total = total_steps(cfg)
    data = SyntheticCorpus(vocab_size=cfg["vocab"], seq_len=cfg["seq"], train_sequences=cfg["batch"] * 2 * total,
                           val_sequences=2)
    module = make_module()
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=total,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[callback])
    trainer.fit(module, DataLoader(data.train_set, batch_size=cfg["batch"]))


def launch(script: str, variant: str, cfg: dict, threads: int, timeout: float, *, ranks: int, prefix: str):
    """Run ``script --inner variant`` in a fresh interpreter; (the ranks' records, None) or (None, why not)."""
    run_dir = tempfile.mkdtemp(prefix=f"{prefix}-{variant}-")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(script), "--inner", variant, "--run-dir", run_dir,
           "--cfg", json.dumps(cfg), "--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s"
    paths = [os.path.join(run_dir, f"rank{r}.json") for r in range(ranks)]
    if proc.returncode != 0 or not all(os.path.exists(p) for p in paths):
        return None, f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}"
    recs = []
    for p in paths:
        with open(p) as f:
            recs.append(json.load(f))
    return recs, None


def step_times(recs: list[dict]) -> list[float]:
    """A multi-rank step takes as long as its slowest rank."""
    return [max(r["step_s"][i] for r in recs) for i in range(len(recs[0]["step_s"]))]


def run_rounds(script: str, variants: list[str], cfg: dict, args, rounds: int, *, ranks, prefix: str):
    """Every variant once per round, the order reversed every other round (AB BA ...), so slow drift of a shared
    machine falls on all alike; ``ranks(variant)`` is how many ranks a run writes. Returns (runs per variant,
    failures, start time)."""
    runs = {v: [] for v in variants}
    failures = []
    t0 = time.perf_counter()
    for rnd in range(rounds):
        for v in (variants if rnd % 2 == 0 else variants[::-1]):
            recs, err = launch(script, v, cfg, args.threads, args.timeout, ranks=ranks(v), prefix=prefix)
            if err:
                failures.append(f"{v} round {rnd + 1}: {err}")
                print(f"[{time.perf_counter() - t0:6.0f}s] {v}: FAILED {err}", flush=True)
                continue
            runs[v].append(recs)
            print(f"[{time.perf_counter() - t0:6.0f}s] round {rnd + 1} {v}: median step "
                  f"{1e3 * statistics.median(step_times(recs)):.1f} ms", flush=True)
    return runs, failures, t0


def finish(args, cfg: dict, rows: dict, failures: list[str], t0: float, *, compared: str, extra=None) -> int:
    """The end of a benchmark's ``main``: the failures, the wall time, the ``--json`` file; the exit status."""
    for f in failures:
        print("FAILED", f)
    print(f"total wall {time.perf_counter() - t0:.0f}s. Timing on a shared machine is noisy: compare {compared} "
          f"measured side by side; byte counts are deterministic.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rounds": args.rounds, "threads": args.threads, "rows": rows,
                       "failures": failures, **(extra or {})}, f, indent=1)
    return 1 if failures else 0
