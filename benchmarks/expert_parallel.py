"""Expert parallelism's memory and traffic per rank (the building block on real gloo ranks), and its step time
through Lightning's Trainer beside data parallel and ZeRO-3 of the same model.

    python benchmarks/expert_parallel.py                 # 4 ranks: ep 1, 2, 4; then 2 ranks: DP, ZeRO-3, ep 2
    python benchmarks/expert_parallel.py --record        # the tables also into docs/performance.md

A tiny Mixtral from its config (8 experts, top-2, hidden 64, 2 layers; 4 sequences of 32 tokens per rank) trains
one AdamW step under each layout (the same seed, the same batches). Printed per layout:
- p+g+o: bytes of this rank's parameters, gradients and AdamW state (exp_avg, exp_avg_sq, step) after the step,
  against the formula (dense part) + (expert part) / ep, both parts measured under ep 1.
- all-to-all bytes one rank sends to the others in one step (its own rows excluded), by what they carry:
  ``rows`` (hidden states out and back in forward, their gradients back and out in backward), ``weights`` (routing
  weights out, their gradients back), ``counts`` (E int64 per layer). Formula for the rows:
  tokens x hidden x top-k x (ep-1)/ep x 4 bytes x 2 directions x (forward + backward), exact only for a
  uniform router (a rank's pairs spread evenly over the ranks): the measured figure is the router's real split.
- step seconds (median of 3 steps after one warm-up), beside ep 1: on a shared CPU a comparison, not a figure.
- step time through ``Trainer.fit`` on 2 ranks (the same tiny Mixtral, AdamW, the same batches):
  ``HybridParallelStrategy()`` (data parallel), ``zero_stage=3`` and ``expert_parallel_size=2``, run in interleaved
  rounds (DP, ZeRO-3, EP2, DP, ...); each cell is the median of a run's steps after ``WARMUP``, per round.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WORLD, TOKENS_PER_SEQ, SEQS = 4, 32, 4
HIDDEN, INNER, EXPERTS, TOP_K = 64, 64, 8, 2


def model():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INNER, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                        num_experts_per_tok=TOP_K, max_position_embeddings=64, tie_word_embeddings=False)
    return MixtralForCausalLM(cfg)


def nbytes(t) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def run(rank, port, ep, out):
    from lightning_par.experts import apply_expert_parallel
    from lightning_par.experts.dispatch import count_traffic

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timeout)
    torch.manual_seed(0)
    m = model()
    names = [f"model.layers.{i}.mlp.experts.{t}" for i in range(2) for t in ("gate_up_proj", "down_proj")]
    expert_bytes_whole = sum(nbytes(m.get_parameter(n)) for n in names)
    applied = None
    if ep > 1:
        groups = [dist.new_group(list(range(i, i + ep)), timeout=timeout) for i in range(0, WORLD, ep)]
        replicas = [dist.new_group(list(range(j, WORLD, ep)), timeout=timeout) if WORLD // ep > 1 else None
                    for j in range(ep)]
        applied = apply_expert_parallel(m, groups[rank // ep], replicas[rank % ep], ep=ep, rank=rank % ep,
                                        replicas=WORLD, timeout=timeout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    times, traffic = [], None
    for step in range(4):
        idx = torch.randint(0, 128, (SEQS, TOKENS_PER_SEQ), generator=g)
        dist.barrier()
        start = time.perf_counter()
        with count_traffic() as t:
            loss = m(input_ids=idx, labels=idx).loss
            opt.zero_grad()
            loss.backward()
        dense = [p for n, p in m.named_parameters() if applied is None or n not in {x for x, _ in applied.parameters}]
        for p in dense:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= WORLD
        if applied is not None:
            applied.finish_gradients()
        opt.step()
        times.append(time.perf_counter() - start)
        traffic = traffic or dict(t.bytes)
    params = sum(nbytes(p) for p in m.parameters())
    grads = sum(nbytes(p.grad) for p in m.parameters() if p.grad is not None)
    state = sum(nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    result = {"pgo": params + grads + state, "params": params, "expert_whole": expert_bytes_whole,
              "traffic": traffic, "seconds": statistics.median(times[1:])}
    torch.save(result, os.path.join(out, f"ep{ep}_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


STEPS, WARMUP, TIMED_RANKS = 10, 3, 2
STRATEGIES = {"DP": {}, "ZeRO-3": {"zero_stage": 3}, "EP2": {"expert_parallel_size": 2}}


def timed_fit(variant: str, out: str) -> None:
    """``Trainer.fit`` of the tiny Mixtral under ``STRATEGIES[variant]`` on ``TIMED_RANKS`` forked ranks; rank 0
    saves its per-step seconds to ``out/<variant>.pt``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_par import HybridParallelStrategy

    class MoELM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(pl.Callback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_train_batch_start(self, trainer, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *args):
            self.times.append(time.perf_counter() - self.start)
            if trainer.global_rank == 0 and len(self.times) == STEPS:
                torch.save(self.times, os.path.join(out, f"{variant}.pt"))

    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, 128, (STEPS * SEQS * TIMED_RANKS, TOKENS_PER_SEQ),
                                       generator=torch.Generator().manual_seed(1)))
    strategy = HybridParallelStrategy(start_method="fork", timeout=300, **STRATEGIES[variant])
    trainer = pl.Trainer(accelerator="cpu", devices=TIMED_RANKS, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Clock()])
    trainer.fit(MoELM(), DataLoader(data, batch_size=SEQS))


def main() -> None:
    import argparse
    import tempfile

    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the step-time comparison")
    p.add_argument("--record", action="store_true", help="also write the tables into docs/performance.md")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_par.recipes.ports import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for ep in (1, 2, 4):
            mp.start_processes(run, args=(free_port(), ep, out), nprocs=WORLD, start_method="fork")
            results[ep] = [torch.load(os.path.join(out, f"ep{ep}_rank{r}.pt")) for r in range(WORLD)]
    base = results[1][0]
    # p+g+o of a parameter under AdamW: 4 copies of its bytes (param, grad, exp_avg, exp_avg_sq) + the step scalars
    experts_pgo = 4 * base["expert_whole"]
    dense_pgo = base["pgo"] - experts_pgo
    tokens = SEQS * TOKENS_PER_SEQ
    print(f"tiny Mixtral: {EXPERTS} experts top-{TOP_K}, hidden {HIDDEN}, 2 layers; {tokens} tokens per rank, "
          f"{WORLD} ranks")
    print(f"ep 1: p+g+o {base['pgo'] / 1e6:.3f} MB per rank = dense {dense_pgo / 1e6:.3f} + experts "
          f"{experts_pgo / 1e6:.3f}")
    memory_rows = [["1", f"{base['pgo'] / 1e6:.3f}", f"{base['pgo'] / 1e6:.3f}", "+0.0%"]]
    traffic_rows = []
    for ep in (2, 4):
        pgo = [r["pgo"] for r in results[ep]]
        formula = dense_pgo + experts_pgo / ep
        over = f"{(max(pgo) / formula - 1) * 100:+.1f}%"
        print(f"ep {ep}: p+g+o per rank {min(pgo) / 1e6:.3f}-{max(pgo) / 1e6:.3f} MB, formula dense + experts/ep "
              f"{formula / 1e6:.3f} MB ({over})")
        memory_rows.append([str(ep), f"{min(pgo) / 1e6:.3f}-{max(pgo) / 1e6:.3f}", f"{formula / 1e6:.3f}", over])
        rows = 2 * tokens * HIDDEN * TOP_K * (ep - 1) / ep * 4 * 2  # 2 layers x ... x 2 directions (fwd) ...
        rows_formula = rows * 2  # ... x (forward + backward)
        for r, res in enumerate(results[ep]):
            t = res["traffic"]
            measured = sum(v for k, v in t.items() if k.endswith("rows"))
            weights = sum(v for k, v in t.items() if k.endswith('weights'))
            counts = sum(v for k, v in t.items() if k.endswith('counts'))
            print(f"  rank {r}: all-to-all sent {sum(t.values()) / 1e3:.1f} kB: rows {measured / 1e3:.1f} kB "
                  f"(formula {rows_formula / 1e3:.1f} kB, {(measured / rows_formula - 1) * 100:+.1f}%), weights "
                  f"{weights / 1e3:.2f} kB, counts {counts / 1e3:.2f} kB; step "
                  f"{res['seconds'] * 1e3:.0f} ms (ep 1: {results[1][r]['seconds'] * 1e3:.0f} ms)")
            traffic_rows.append([str(ep), str(r), f"{measured / 1e3:.1f}", f"{rows_formula / 1e3:.1f}",
                                 f"{(measured / rows_formula - 1) * 100:+.1f}%", f"{weights / 1e3:.2f}",
                                 f"{counts / 1e3:.2f}"])

    # step time through the Trainer: DP, ZeRO-3 and EP2 of the same model, interleaved rounds
    times: dict[str, list[float]] = {v: [] for v in STRATEGIES}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            for variant in STRATEGIES:
                timed_fit(variant, out)
                times[variant].append(statistics.median(torch.load(os.path.join(out, f"{variant}.pt"))[WARMUP:]))
    print(f"Trainer.fit on {TIMED_RANKS} ranks, {SEQS} x {TOKENS_PER_SEQ} tokens per rank, median step of "
          f"{STEPS - WARMUP} after {WARMUP}, per round:")
    time_rows = []
    for variant, ts in times.items():
        cells = " ".join(f"{t * 1e3:.0f}" for t in ts)
        print(f"  {variant:7s} {cells} ms (spread {(max(ts) - min(ts)) * 1e3:.0f} ms)")
        time_rows.append([variant, *(f"{t * 1e3:.0f}" for t in ts)])
    if args.record:  # [Note: a generated performance page] in lightning_par.performance
        from lightning_par.performance import record

        shape = (f"tiny Mixtral, {EXPERTS} experts top-{TOP_K}, hidden {HIDDEN}, 2 layers, fp32 AdamW; {tokens} "
                 f"tokens per rank")
        record("benchmark expert_parallel", title="Expert parallelism: memory, all-to-all bytes, step time",
               command="python benchmarks/expert_parallel.py " + " ".join(sys.argv[1:]),
               tables=[(f"p+g+o per rank, {WORLD} ranks ({shape}): measured against dense + experts / ep (MB)",
                        ["ep", "measured", "formula", "over"], memory_rows),
                       (f"all-to-all hidden-state rows each rank sends per step (kB) against tokens x hidden x "
                        f"top-k x (ep-1)/ep x 4 B x 2 directions x (forward + backward), 2 MoE layers",
                        ["ep", "rank", "rows", "formula", "diff", "weights", "counts"], traffic_rows),
                       (f"step time through Trainer.fit, {TIMED_RANKS} ranks, median of {STEPS - WARMUP} steps "
                        f"(ms), interleaved rounds", ["strategy", *(f"round {i + 1}" for i in range(args.rounds))],
                        time_rows)],
               notes=["The rows' formula assumes a uniform router; the measured split is the router's own.",
                      "Times on a CPU shared with other jobs: compare within the table only."])


if __name__ == "__main__":
    main()
