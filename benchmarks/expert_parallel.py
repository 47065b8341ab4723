"""Expert parallelism's memory and traffic per rank, measured on real gloo ranks (the building block, no Lightning).

    python benchmarks/expert_parallel.py            # 4 ranks: ep 1 (data parallel), ep 2, ep 4, interleaved

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


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_par.recipes.ports import free_port

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
    for ep in (2, 4):
        pgo = [r["pgo"] for r in results[ep]]
        formula = dense_pgo + experts_pgo / ep
        print(f"ep {ep}: p+g+o per rank {min(pgo) / 1e6:.3f}-{max(pgo) / 1e6:.3f} MB, formula dense + experts/ep "
              f"{formula / 1e6:.3f} MB ({(max(pgo) / formula - 1) * 100:+.1f}%)")
        rows = 2 * tokens * HIDDEN * TOP_K * (ep - 1) / ep * 4 * 2  # 2 layers x ... x 2 directions (fwd) ...
        rows_formula = rows * 2  # ... x (forward + backward)
        for r, res in enumerate(results[ep]):
            t = res["traffic"]
            measured = sum(v for k, v in t.items() if k.endswith("rows"))
            print(f"  rank {r}: all-to-all sent {sum(t.values()) / 1e3:.1f} kB: rows {measured / 1e3:.1f} kB "
                  f"(formula {rows_formula / 1e3:.1f} kB, {(measured / rows_formula - 1) * 100:+.1f}%), weights "
                  f"{sum(v for k, v in t.items() if k.endswith('weights')) / 1e3:.2f} kB, counts "
                  f"{sum(v for k, v in t.items() if k.endswith('counts')) / 1e3:.2f} kB; step "
                  f"{res['seconds'] * 1e3:.0f} ms (ep 1: {results[1][r]['seconds'] * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
