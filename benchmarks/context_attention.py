"""Context-parallel attention on gloo: all-gather of K/V against a ring, bytes and time per layer (forward + backward).

    python benchmarks/context_attention.py --quick        # sequence 1024; ~1 min on 2 shared cores
    python benchmarks/context_attention.py                # sequence 4096
    python benchmarks/context_attention.py --cp 2,4 --seq 2048 --heads 8 --kv-heads 2 --head-dim 64
    python benchmarks/context_attention.py --quick --record   # the table also into docs/performance.md

One attention layer's op (``lightning_par.context.context_attention``, causal, float32, batch 1) on ``cp`` forked gloo
ranks, each holding ``seq / cp`` tokens. Bytes: what ``lightning_par.comm.count_comm`` counts one rank sending in one
forward + backward (the two methods' formulas: [Note: all-gather or ring]); time: the median over ``--steps`` of
the slowest rank's forward + backward (the first call, counted for bytes, is the warm-up), the methods
interleaved step by step. The numbers behind the default ``method="ring"`` ([Note: all-gather or ring] in
lightning_par/context/attention.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def _rank(rank, cp, port, args, out_dir):
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    from lightning_par.comm import CommCounter, count_comm
    from lightning_par.context import METHODS, context_attention

    dist.init_process_group("gloo", rank=rank, world_size=cp, init_method=f"tcp://127.0.0.1:{port}")
    local = args.seq // cp
    inputs, wire, times = {}, {}, {m: [] for m in METHODS}
    for method in METHODS:
        q = torch.randn(1, args.heads, local, args.head_dim, requires_grad=True)
        k, v = (torch.randn(1, args.kv_heads, local, args.head_dim, requires_grad=True) for _ in range(2))
        kw = dict(is_causal=True, enable_gqa=args.heads != args.kv_heads, group=dist.group.WORLD, method=method)
        inputs[method] = (q, k, v, kw)
        counter = CommCounter()
        with count_comm(counter):
            context_attention(q, k, v, **kw).sum().backward()
        wire[method] = counter.wire_bytes
    for _ in range(args.steps):  # the methods interleaved: the machine is shared, its load drifts
        for method in METHODS:
            q, k, v, kw = inputs[method]
            dist.barrier()
            start = time.perf_counter()
            context_attention(q, k, v, **kw).sum().backward()
            t = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[method].append(float(t))
    rows = {m: (wire[m], statistics.median(times[m])) for m in METHODS}
    if rank == 0:
        torch.save(rows, os.path.join(out_dir, f"cp{cp}.pt"))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cp", default="2,4")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--record", action="store_true", help="also write the table into docs/performance.md")
    args = p.parse_args()
    args.seq = args.seq or (1024 if args.quick else 4096)
    import torch.multiprocessing as mp

    from lightning_par.recipes.ports import free_port

    print(f"sequence {args.seq}, {args.heads} heads ({args.kv_heads} k/v) of {args.head_dim}, float32, causal")
    print(f"{'cp':>3} {'method':>10} {'wire MB/rank':>13} {'ms fwd+bwd':>11}")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for cp in (int(c) for c in args.cp.split(",")):
            mp.start_processes(_rank, args=(cp, free_port(), args, out), nprocs=cp, start_method="fork")
            for method, (wire, sec) in torch.load(os.path.join(out, f"cp{cp}.pt")).items():
                print(f"{cp:>3} {method:>10} {wire / 1e6:>13.2f} {sec * 1e3:>11.1f}")
                rows.append([cp, method, f"{wire / 1e6:.2f}", f"{sec * 1e3:.1f}"])
    if args.record:  # [Note: a generated performance page] in lightning_par.performance
        import sys

        from lightning_par.performance import record

        shape = (f"sequence {args.seq}, {args.heads} heads ({args.kv_heads} k/v) of {args.head_dim}, float32, causal, "
                 f"median of {args.steps} steps, {args.threads} thread(s) a rank")
        record("benchmark context_attention", title="Context-parallel attention: all-gather against ring",
               command="python benchmarks/context_attention.py " + " ".join(sys.argv[1:]),
               tables=[(shape, ["cp", "method", "wire MB / rank", "ms forward + backward"], rows)])


if __name__ == "__main__":
    main()
