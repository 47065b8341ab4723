"""The expert-parallel layout: its keyword's checks and its process groups ([Note: which ranks hold which experts]
in :mod:`lightning_par.experts.apply`). Knows no Lightning."""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist


def check_expert_options(expert_parallel_size: Any, experts: Any) -> None:
    """The values alone (at construction)."""
    ep = expert_parallel_size
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"`expert_parallel_size={ep!r}` must be a positive integer: the ranks that divide the routed "
                         f"experts of every MoE layer (1: every rank holds all of them).")
    if experts is not None and (not isinstance(experts, str) or not experts):
        raise ValueError(f"`experts={experts!r}` must be a glob over module names (e.g. 'model.layers.*.mlp.experts') "
                         f"or None (found).")


def check_expert_sizes(expert_parallel_size: int, *, data_parallel_size: int, context_parallel_size: int,
                       pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1,
                       pipelined: bool = False) -> None:
    """What the resolved sizes allow (once the world is known, before any process group): ep divides dp x cp."""
    ep = expert_parallel_size
    if ep == 1:
        return
    dpcp = data_parallel_size * context_parallel_size
    if dpcp % ep:
        cp = f" x context_parallel_size={context_parallel_size}" if context_parallel_size > 1 else ""
        raise ValueError(f"`expert_parallel_size={ep}` must divide data_parallel_size={data_parallel_size}{cp} "
                         f"({dpcp}): the expert-parallel ranks are borrowed from the data-parallel ones (the world "
                         f"stays dp x pp x cp x tp). Choose a divisor of {dpcp}, or more devices.")
    check_expert_composition(ep, pipeline_parallel_size=max(pipeline_parallel_size, 2 if pipelined else 1),
                             tensor_parallel_size=tensor_parallel_size)


def check_expert_composition(expert_parallel_size: int, *, pipeline_parallel_size: Any = 1,
                             tensor_parallel_size: Any = 1, zero_stage: int = 0) -> None:
    """The other options expert parallelism does not compose with yet (at construction where they are known)."""
    ep = expert_parallel_size
    if ep == 1:
        return
    if zero_stage >= 2:  # FSDP2 over the ranks holding the same experts (torchtitan's efsdp) is not built
        raise ValueError(f"`expert_parallel_size={ep}` with zero_stage={zero_stage}: sharding the parameters over "
                         f"the ranks holding the same experts (and over dp for the rest) is not built. Use "
                         f"zero_stage=1 (optimizer state sharded, experts' over their holders) or 0, or "
                         f"expert_parallel_size=1.")


def check_router_loss(module, context_parallel_size: int) -> None:
    """Refuse a Hugging Face MoE model computing its router's auxiliary loss (``config.output_router_logits`` with
    a non-zero ``router_aux_loss_coef``) under context parallelism: each rank would compute it on its piece of the
    sequence, not on one device's tokens (pure, before any collective). A loss a module computes by itself is not
    seen here (docs/limitations.md)."""
    if context_parallel_size == 1:
        return
    for name, m in module.named_modules():
        cfg = getattr(m, "config", None)
        coef = getattr(cfg, "router_aux_loss_coef", None)
        if getattr(cfg, "output_router_logits", False) is True and coef:
            raise ValueError(f"`context_parallel_size={context_parallel_size}` with {type(module).__name__}'s router "
                             f"auxiliary loss (`{name or type(m).__name__}.config.output_router_logits=True`, "
                             f"router_aux_loss_coef={coef}): each rank would compute it on its piece of the "
                             f"sequence, not on one device's tokens (measured 3.4e-4 off in 8 SGD steps). Set "
                             f"config.output_router_logits=False (or router_aux_loss_coef=0), or use "
                             f"context_parallel_size=1.")


def replica_ranks(topology, rank: int, ep: int) -> list[int]:
    """The global ranks holding the same experts as ``rank`` (its expert-replica group, ascending; one rank where
    ep = dp x cp), as :func:`expert_groups` forms them."""
    cp = topology.context_parallel_size

    def key(r):
        c = topology.coordinates(r)
        return c["pp"], c["tp"], (c["dp"] * cp + c.get("cp", 0)) % ep
    return [r for r in range(topology.world_size) if key(r) == key(rank)]


def expert_groups(topology, rank: int, ep: int, timeout=None) -> tuple[Any, Any, int]:
    """(this rank's expert-parallel group, its expert-replica group or None, its index in the former); every rank
    must call this, in the same order ([Note: which ranks hold which experts])."""
    cp = topology.context_parallel_size
    blocks: dict[tuple, list[int]] = {}
    replicas: dict[tuple, list[int]] = {}
    for r in range(topology.world_size):
        c = topology.coordinates(r)
        i = c["dp"] * cp + c.get("cp", 0)
        blocks.setdefault((c["pp"], c["tp"], i // ep), []).append(r)
        replicas.setdefault((c["pp"], c["tp"], i % ep), []).append(r)
    mine: Optional[Any] = None
    rep: Optional[Any] = None
    for ranks in blocks.values():
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine, index = g, ranks.index(rank)
    for ranks in replicas.values():
        if len(ranks) == 1:
            continue
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            rep = g
    return mine, rep, index

