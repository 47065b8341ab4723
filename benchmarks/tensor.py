"""Tensor-parallel benchmark: communication per step against Megatron's formula, all-reduces per layer, bytes
of sharded state per rank, and step time against Lightning's ``ModelParallelStrategy`` with the equivalent
hand-written plan (q/k/v and fc column-wise, out/proj row-wise, ``n_head //= tp``), as a ratio.

    python benchmarks/tensor.py                      # tp=2, d=256, 4 layers, seq 128, batch 8; 2 rounds
    python benchmarks/tensor.py --quick              # tiny sizes: checks that everything runs (~1 min)
    python benchmarks/tensor.py --json out.json      # also write the results

Each system runs in its own interpreter under Lightning's popen launcher (the script re-runs itself per
rank with ``--system``), in rounds whose order alternates (AB, BA) so drift of a shared machine falls on
both. Step time is the median over the timed steps of rank 0; communication is counted on one extra step
with a dispatch mode that sees every collective DTensor issues. Timings on a loaded machine are noisy: the
ratio measured side by side is what counts, and the counts and bytes are exact.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, ROOT)

SYSTEMS = ("lightning_par", "lightning_model_parallel")


# -- measuring inside a run --------------------------------------------------------------------------

def comm_mode(record: list):
    """Record (op, bytes, in-backward) of every collective dispatched while active."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Comm(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor decompose into plain ops and collectives first
            out = func(*args, **(kwargs or {}))
            if func.namespace in ("_c10d_functional", "c10d", "c10d_functional"):
                name = func.__name__.split(".")[0]
                if any(k in name for k in ("all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather")):
                    first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
                    nbytes = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
                    record.append((name, nbytes, torch._C._current_autograd_node() is not None))
            return out

    return Comm()


def make_callback(args, out_path):
    import lightning.pytorch as pl

    class Clock(pl.Callback):
        def __init__(self):
            self.times, self.comm, self.mode, self.t0 = [], [], None, 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup + args.steps:
                self.mode = comm_mode(self.comm)
                self.mode.__enter__()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            dt = time.perf_counter() - self.t0
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                self.mode = None
            elif batch_idx >= args.warmup:
                self.times.append(dt)

        def on_train_end(self, trainer, pl_module):
            from torch.distributed.tensor import DTensor

            sharded = full = 0
            opt = trainer.optimizers[0]
            for p in pl_module.parameters():
                if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
                    for t in [p, p.grad] + [v for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()]:
                        if t is not None:
                            sharded += t.to_local().numel() * t.element_size()
                            full += t.numel() * t.element_size()
            if trainer.global_rank == 0:
                with open(out_path, "w") as f:
                    json.dump({"times": self.times, "comm": self.comm, "sharded_bytes": sharded,
                               "sharded_full_bytes": full}, f)

    return Clock()


def run_system(args) -> None:
    """One system, one rank (Lightning's popen launcher starts the others by re-running this command)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_par.models import GPT

    torch.set_num_threads(1)
    hp = dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.d,
              warmup_steps=1)
    if args.system == "lightning_par":
        from lightning_par import TensorParallelStrategy

        strategy, module_cls = TensorParallelStrategy(tensor_parallel_size=args.tp), GPT
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        class HandPlanGPT(GPT):
            def configure_model(self):  # what a Lightning user writes for the same split
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                mesh = self.device_mesh["tensor_parallel"]
                plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                        "attn.v_proj": ColwiseParallel(), "attn.out_proj": RowwiseParallel(),
                        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
                for block in self.blocks:
                    parallelize_module(block, mesh, plan)
                    block.attn.n_head //= mesh.size()

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=args.tp,
                                         save_distributed_checkpoint=False)
        module_cls = HandPlanGPT
    total = args.warmup + args.steps + 1
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (total * args.batch, args.seq + 1), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    torch.manual_seed(0)
    module = module_cls(**hp)
    trainer = pl.Trainer(accelerator="cpu", devices=args.tp, strategy=strategy, max_steps=total, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                         callbacks=[make_callback(args, args.out)])
    trainer.fit(module, loader)


# -- the driver ----------------------------------------------------------------------------------------

def summarize(name: str, rec: dict, args) -> dict:
    comm = rec["comm"]
    n_ar = sum(1 for op, _, _ in comm if "reduce" in op and "scatter" not in op)
    fwd = sum(1 for op, _, bwd in comm if not bwd)
    act = args.batch * args.seq * args.d * 4  # one fp32 activation b*s*h
    megatron = 4 * args.layers * act
    return {"system": name, "step_s_median": statistics.median(rec["times"]), "steps_timed": len(rec["times"]),
            "collectives_per_step": len(comm), "all_reduces_per_layer": n_ar / args.layers,
            "forward_per_layer": fwd / args.layers, "backward_per_layer": (len(comm) - fwd) / args.layers,
            "bytes_per_step": sum(b for _, b, _ in comm), "megatron_formula_bytes": megatron,
            "sharded_state_bytes_per_rank": rec["sharded_bytes"],
            "sharded_state_fraction": rec["sharded_bytes"] / max(rec["sharded_full_bytes"], 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.quick:
        args.d, args.heads, args.layers, args.seq, args.batch, args.vocab = 32, 4, 2, 16, 4, 64
        args.warmup, args.steps, args.rounds = 1, 2, 1
    if args.system:
        return run_system(args)

    import tempfile

    runs = {name: [] for name in SYSTEMS}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    sizes = ("tp", "d", "heads", "layers", "seq", "batch", "vocab", "warmup", "steps")
    base = [x for k in sizes for x in (f"--{k}", str(getattr(args, k)))]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            for name in order:
                out = os.path.join(tmp, f"{name}{r}.json")
                cmd = [sys.executable, os.path.abspath(__file__), *base, "--system", name, "--out", out]
                subprocess.run(cmd, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    runs[name].append(json.load(f))
    results = []
    for name, recs in runs.items():
        merged = {**recs[-1], "times": [t for rec in recs for t in rec["times"]]}
        results.append(summarize(name, merged, args))
    ratio = results[0]["step_s_median"] / results[1]["step_s_median"]
    for res in results:
        print(json.dumps(res))
    print(f"step time ratio lightning_par / ModelParallelStrategy(hand plan) = {ratio:.3f} "
          f"(tp={args.tp}, d={args.d}, layers={args.layers}, seq={args.seq}, batch={args.batch})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results, "step_time_ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
