"""ZeRO-1 with expert parallelism: the optimizer state of the dense parameters sharded over dp, that of this rank's
experts over the ranks holding the same experts. Knows no Lightning.

[Note: ZeRO-1 with expert parallelism]
ZeRO-1 (torch's ``ZeroRedundancyOptimizer``) gives each parameter to one rank of the dp group, which steps it and
broadcasts the result to the others. A rank's expert parameters have the same names and shapes on every rank but
other experts' values on the ranks of its expert-parallel group, so broadcasting them over dp would overwrite
other ranks' experts with ours. Here the dense parameters are partitioned over dp as before, and the expert
parameters over the *slots* of the expert-replica group (the ``dp x cp / ep`` ranks holding the same experts,
[Note: which ranks hold which experts] in :mod:`lightning_par.experts.apply`): every rank steps the expert
parameters of its own slot (its index in its replica group) and broadcasts them within that group. The
partition is by position in the optimizer's groups (the same on every rank), so each replica group's member j
steps the same positions, each one its own experts. Where ep = dp x cp (one rank per replica group) every rank
steps all of its experts: their state is already divided by ep. Per rank: dense state / dp + expert state / dp x cp
(torchtitan's "efsdp" for ZeRO-1). The gradients are unchanged ([Note: the experts' gradients]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_par.experts.layout import replica_ranks


@dataclass(frozen=True)
class ExpertShards:
    """What :func:`lightning_par.dp.zero.shard_optimizer` needs to treat the expert parameters apart."""

    experts: frozenset  # ids of this rank's expert parameters
    slots: list  # dp rank r's slot (index in its expert-replica group)
    slot_group: Any  # this rank's expert-replica group (None: one rank)
    slot_ranks: list  # its global ranks, slot order


def expert_shards(applied, module: nn.Module, topology, rank: int) -> Optional[ExpertShards]:
    """``applied`` (step 6's :class:`~lightning_par.experts.apply.ExpertParallel`, or None): the partition of
    [Note: ZeRO-1 with expert parallelism] for ``module``'s parameters on global ``rank``; None where no expert is
    divided over ep (nothing to treat apart)."""
    if applied is None or applied.axis != "ep":
        return None
    names = applied._names()
    ids = frozenset(id(p) for n, p in module.named_parameters() if n in names)
    ep = applied.ep

    def slot(r):
        return replica_ranks(topology, r, ep).index(r)
    return ExpertShards(ids, [slot(r) for r in topology.group_ranks("dp", rank)], applied.replica_group,
                        replica_ranks(topology, rank, ep))
