"""Pipeline parallelism benchmark: bubble, activation memory, state memory, step time, time balancing.

    python benchmarks/pipeline.py bubble              # measured bubble vs (p-1)/(m+p-1): ours (gpipe, 1f1b)
                                                      #   and torch.distributed.pipelining, p=2, m in 2 4 8
    python benchmarks/pipeline.py memory              # activation bytes held per rank, gpipe vs 1f1b (p=2, m=8);
                                                      #   parameter + gradient + optimizer bytes per rank vs one device
    python benchmarks/pipeline.py speed               # step time vs torch.distributed.pipelining driven by hand
    python benchmarks/pipeline.py balance             # balance="time" vs "uniform" on a model with a heavy head
    python benchmarks/pipeline.py all --quick         # everything, small and short (a smoke run)

Every run starts its own ranks (gloo, fork, one thread each) on this machine's CPUs. Times on a shared
machine are noisy: compare ratios measured side by side in one invocation; byte counts are exact.
Defaults (d_model 128, 8 blocks, 4 heads, vocab 256, seq 64, batch 16) give every block the same work;
the heavy-head model of `balance` has a vocabulary of 8192 (its lm head costs about 4 blocks).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
import logging

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_par.models import GPT  # noqa: E402
from lightning_par.pipeline.schedules import bubble_fraction  # noqa: E402
from lightning_par.recipes.ports import free_port  # noqa: E402
from lightning_par.saved import SavedTensorMeter  # noqa: E402
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy  # noqa: E402


# -- workload ---------------------------------------------------------------------------------------
def model_config(args, vocab=None) -> dict:
    return dict(vocab_size=vocab or args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                n_embd=args.d_model, tie_weights=False, warmup_steps=1, lr_decay_steps=1000)


def dataset(args, vocab=None, steps=None) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = args.batch * (steps or args.steps + args.warmup)
    tokens = torch.randint(0, vocab or args.vocab, (n, args.seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def bytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# -- our strategy: a Lightning fit with a probe callback ---------------------------------------------
class Probe(pl.Callback):
    """Per rank: step times, schedule stats, peak activation bytes, state bytes -> <out>/rank<r>.json."""

    def __init__(self, out_dir: str, warmup: int, meter: bool):
        self.out_dir, self.warmup, self.meter = out_dir, warmup, meter
        self.steps, self.stats, self.t0 = [], [], 0.0

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        if self.meter and isinstance(strategy, PipelineParallelStrategy):
            strategy.runtime.meter = SavedTensorMeter(pl_module.parameters())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(time.perf_counter() - self.t0)
        self.stats.append(dict(getattr(trainer.strategy, "last_step_stats", {})))

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        params = [p for p in pl_module.parameters()]
        if isinstance(strategy, PipelineParallelStrategy):
            names = {id(p): n for n, p in pl_module.named_parameters()}
            owned = [p for p in params if strategy._owns(p, names[id(p)])]
            peak = strategy.runtime.meter.peak if strategy.runtime.meter else None
            blocks = [[lo, hi] for _, lo, hi in strategy.runtime.chunks]
        else:
            owned, peak, blocks = params, None, None
        opt_state = [t for opt in trainer.optimizers for st in opt.state.values() for t in st.values()
                     if isinstance(t, torch.Tensor)]
        rec = {
            "rank": trainer.global_rank,
            "step_s": self.steps[self.warmup:],
            "stats": self.stats[self.warmup:],
            "activation_peak_bytes": peak,
            "blocks": blocks,
            "owned_param_bytes": bytes_of(owned),
            "resident_param_bytes": bytes_of(params),
            "grad_bytes": bytes_of([p.grad for p in owned if p.grad is not None]),
            "optimizer_bytes": bytes_of(opt_state),
        }
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(rec, f)


def run_ours(args, out_dir, *, devices=2, vocab=None, meter=False, **strategy_kw) -> list[dict]:
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    module = GPT(**model_config(args, vocab))
    strategy = "auto" if devices == 1 else PipelineParallelStrategy(start_method="fork", timeout=300, **strategy_kw)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.warmup + args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[Probe(out_dir, args.warmup, meter)])
    trainer.fit(module, DataLoader(dataset(args, vocab), batch_size=args.batch))
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(devices)]


# -- torch.distributed.pipelining driven by hand, the same model -------------------------------------
class TorchStage(nn.Module):
    """Stage ``s`` of a GPT cut by hand: embeddings on the first, the head on the last."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.tok_emb, self.pos_emb = (gpt.tok_emb, gpt.pos_emb) if first else (None, None)
        self.blocks = nn.ModuleList(list(gpt.blocks)[lo:hi])
        self.ln_f, self.lm_head = (gpt.ln_f, gpt.lm_head) if last else (None, None)

    def forward(self, x):
        if self.tok_emb is not None:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.size(1)))
        for block in self.blocks:
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


def _torch_worker(rank, args, schedule, port, out_dir):
    import torch.distributed as dist
    from datetime import timedelta
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    gpt = GPT(**model_config(args))
    half = args.layers // 2
    module = TorchStage(gpt, rank * half, (rank + 1) * half, rank == 0, rank == 1)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    busy = [0.0]
    for name in ("forward_one_chunk", "backward_one_chunk"):
        fn = getattr(stage, name)

        def timed(*a, _fn=fn, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                busy[0] += time.perf_counter() - t0
        setattr(stage, name, timed)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=args.micro,
                loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    data = dataset(args)
    steps, stats = [], []
    for step in range(args.warmup + args.steps):
        x, y = data.tensors[0][step * args.batch:(step + 1) * args.batch], data.tensors[1][step * args.batch:(step + 1) * args.batch]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        busy[0] = 0.0
        ts = time.perf_counter()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        t_sched = time.perf_counter() - ts
        opt.step()
        steps.append(time.perf_counter() - t0)
        stats.append({"schedule_s": t_sched, "busy_s": busy[0]})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step_s": steps[args.warmup:], "stats": stats[args.warmup:]}, f)
    dist.barrier()
    dist.destroy_process_group()


def run_torch(args, out_dir, schedule) -> list[dict]:
    import torch.multiprocessing as mp

    os.makedirs(out_dir, exist_ok=True)
    mp.start_processes(_torch_worker, args=(args, schedule, free_port(), out_dir), nprocs=2, start_method="fork",
                       join=True)
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]


# -- summaries --------------------------------------------------------------------------------------
def measured_bubble(records) -> float:
    """Mean over stages of the idle share of the schedule: 1 - compute / schedule time (median step)."""
    per_stage = []
    for rec in records:
        fr = [1 - s["busy_s"] / s["schedule_s"] for s in rec["stats"] if s.get("schedule_s")]
        per_stage.append(statistics.median(fr))
    return statistics.mean(per_stage)


def step_time(records) -> float:
    return statistics.median(max(r["step_s"][i] for r in records) for i in range(len(records[0]["step_s"])))


def bench_bubble(args, tmp):
    print("\n## Bubble, p=2: measured idle share of the schedule (1 - compute/schedule time, mean over stages)")
    print(f"model d={args.d_model} L={args.layers} batch={args.batch}; formula (p-1)/(m+p-1); interleaved v=2: "
          f"(p-1)/(v·m+p-1) of its own step")
    cols = ["gpipe", "1f1b", "zero_bubble", "interleaved_1f1b", "torch_gpipe", "torch_1f1b"]
    print(f"{'m':>3} {'formula':>8} " + " ".join(f"{c:>16}" for c in cols))
    out = {}
    for m in args.micros:
        a = argparse.Namespace(**{**vars(args), "micro": m})
        row = {}
        for s in ("gpipe", "1f1b", "zero_bubble", "interleaved_1f1b"):
            extra = dict(stages_per_rank=2) if s == "interleaved_1f1b" else {}
            row[s] = measured_bubble(run_ours(a, f"{tmp}/bubble_{s}_{m}", pipeline_parallel_size=2, microbatches=m,
                                              schedule=s, balance="uniform", **extra))
        for s in ("gpipe", "1f1b"):
            row[f"torch_{s}"] = measured_bubble(run_torch(a, f"{tmp}/tbubble_{s}_{m}", s))
        out[m] = row
        print(f"{m:>3} {bubble_fraction(stages=2, microbatches=m):>8.3f} " + " ".join(f"{row[c]:>16.3f}" for c in cols))
    return out


def bench_memory(args, tmp):
    m = max(args.micros)
    print(f"\n## Memory, p=2, m={m}: activation bytes held at peak per rank (saved for backward)")
    act = {s: run_ours(args, f"{tmp}/mem_{s}", pipeline_parallel_size=2, microbatches=m, schedule=s, meter=True)
           for s in ("gpipe", "1f1b")}
    for r in range(2):
        g, o = act["gpipe"][r]["activation_peak_bytes"], act["1f1b"][r]["activation_peak_bytes"]
        print(f"rank {r}: gpipe {g:>12,}  1f1b {o:>12,}  ratio {o / g:.3f}  (bound p/m = {2 / m:.3f})")
    single = run_ours(args, f"{tmp}/mem_single", devices=1)[0]
    print("\n## Parameter + gradient + optimizer bytes per rank (owned by the stage) vs one device")
    one = single["owned_param_bytes"] + single["grad_bytes"] + single["optimizer_bytes"]
    torch.manual_seed(0)
    gpt = GPT(**model_config(args))
    blocks = bytes_of(gpt.blocks.parameters())
    print(f"one device: {one:>12,} B (block stack {blocks:,} B of parameters; ideal per stage = 1/p of it + its ends)")
    for r, rec in enumerate(act["1f1b"]):
        tot = rec["owned_param_bytes"] + rec["grad_bytes"] + rec["optimizer_bytes"]
        print(f"rank {r}: {tot:>12,} B = {tot / one:.3f} of one device; resident parameters (incl. stale "
              f"copies of other stages' embeddings/head) {rec['resident_param_bytes']:,} B")
    return act


def bench_speed(args, tmp):
    print(f"\n## Step time vs torch.distributed.pipelining by hand (p=2, m={args.micro}); median of {args.steps} "
          f"steps per run, {args.rounds} rounds alternating the order (ABBA): the ratio is the median of the rounds'")
    res = {}
    for s in ("gpipe", "1f1b"):
        ratios, ours_t, torch_t = [], [], []
        for rnd in range(args.rounds):
            runs = {}
            order = ("ours", "torch") if rnd % 2 == 0 else ("torch", "ours")
            for who in order:
                if who == "ours":
                    runs[who] = step_time(run_ours(args, f"{tmp}/speed_{s}_{rnd}", pipeline_parallel_size=2,
                                                   microbatches=args.micro, schedule=s, balance="uniform"))
                else:
                    runs[who] = step_time(run_torch(args, f"{tmp}/tspeed_{s}_{rnd}", s))
            ours_t.append(runs["ours"])
            torch_t.append(runs["torch"])
            ratios.append(runs["ours"] / runs["torch"])
        res[s] = {"ours_s": ours_t, "torch_s": torch_t, "ratios": ratios}
        print(f"{s:>6}: ours {', '.join(f'{t * 1e3:.0f}' for t in ours_t)} ms  torch "
              f"{', '.join(f'{t * 1e3:.0f}' for t in torch_t)} ms  ratios {', '.join(f'{r:.2f}' for r in ratios)}"
              f"  median {statistics.median(ratios):.3f}")
    return res


def bench_balance(args, tmp):
    vocab = args.heavy_vocab
    print(f"\n## balance='time' vs 'uniform', p=2, m={args.micro}, heavy head (vocab {vocab}); {args.rounds} rounds ABBA")
    res = {"uniform": [], "time": []}
    for rnd in range(args.rounds):
        for balance in (("uniform", "time") if rnd % 2 == 0 else ("time", "uniform")):
            recs = run_ours(args, f"{tmp}/bal_{balance}_{rnd}", vocab=vocab, pipeline_parallel_size=2,
                            microbatches=args.micro, balance=balance)
            busy = [statistics.median(s["busy_s"] for s in r["stats"]) for r in recs]
            res[balance].append({"busy_s": busy, "step_s": step_time(recs)})
            split = [hi - lo for r in recs for lo, hi in r["blocks"]]
            print(f"round {rnd} {balance:>8}: blocks per stage {split}, stage compute {', '.join(f'{b * 1e3:.1f}' for b in busy)} ms  "
                  f"slowest/mean {max(busy) / statistics.mean(busy):.3f}  step {res[balance][-1]['step_s'] * 1e3:.1f} ms")
    ratios = [t["step_s"] / u["step_s"] for t, u in zip(res["time"], res["uniform"])]
    print(f"step time time/uniform per round: {', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}")
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["bubble", "memory", "speed", "balance", "all"])
    p.add_argument("--quick", action="store_true", help="small model, few steps: checks the script runs")
    p.add_argument("--d-model", dest="d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--heavy-vocab", dest="heavy_vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--micros", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3, help="speed/balance: alternating rounds")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.quick:
        args.d_model, args.layers, args.seq, args.batch, args.steps, args.warmup = 32, 4, 16, 8, 2, 1
        args.heavy_vocab, args.micros, args.rounds = 2048, [2, 4], 2
    tmp = tempfile.mkdtemp(prefix="pipeline_bench_")
    results = {}
    for what in (["bubble", "memory", "speed", "balance"] if args.what == "all" else [args.what]):
        results[what] = globals()[f"bench_{what}"](args, tmp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
