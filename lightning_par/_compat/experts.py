"""Private torch APIs for expert parallelism: ZeRO-1's partition and parameter broadcast with expert parameters
([Note: ZeRO-1 with expert parallelism] in :mod:`lightning_par.experts.zero`)."""
from __future__ import annotations

from typing import Any, Optional


def expert_zero_optimizer(params, *, experts: set[int], slots: list[int], slot_group: Any, slot_ranks: list[int],
                          **kwargs):
    """torch's ``ZeroRedundancyOptimizer`` (the project's subclass, ``shard_aware_zero_optimizer``) whose partition
    and broadcast treat the parameters whose ids are in ``experts`` apart: they are divided over ``len(slot_ranks)``
    slots, every rank of the dp ``process_group`` steps those of its slot (``slots[r]``: dp rank r's), and they are
    broadcast within ``slot_group`` (the ranks holding the same experts; global ranks ``slot_ranks``, slot order)
    instead of over dp. Overrides the private ``_partition_parameters``, ``_param_to_rank`` and ``_sync_params``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_par._compat import shard_aware_zero_optimizer

    base = shard_aware_zero_optimizer()

    def data(p):
        return p.to_local() if isinstance(p, DTensor) else p.data

    class ExpertZeroRedundancyOptimizer(base):
        def __init__(self, params, **kw):
            self._lp_experts, self._lp_slots = experts, slots
            self._lp_slot_group, self._lp_slot_ranks = slot_group, slot_ranks
            self._lp_slot_params: Optional[list[list]] = None
            super().__init__(params, **kw)

        def _partition_parameters(self, params_per_rank=None):
            if params_per_rank is not None or self._partition_parameters_cache:
                return super()._partition_parameters(params_per_rank)
            world, n_slots = self.world_size, len(self._lp_slot_ranks)
            self._partition_parameters_cache = [[] for _ in range(world)]
            self._lp_slot_params = [[] for _ in range(n_slots)]
            sizes, slot_sizes = [0] * world, [0] * n_slots
            for group in self.param_groups:
                per_rank: list[list] = [[] for _ in range(world)]
                ordered = sorted(group["params"], key=lambda t: t.numel(), reverse=True)  # stable: same on all ranks
                for p in ordered:
                    if id(p) in self._lp_experts:
                        j = min(range(n_slots), key=lambda k: slot_sizes[k])
                        slot_sizes[j] += p.numel()
                        self._lp_slot_params[j].append(p)
                        for r in range(world):
                            if self._lp_slots[r] == j:
                                per_rank[r].append(p)
                    else:
                        r = min(range(world), key=lambda k: sizes[k])
                        sizes[r] += p.numel()
                        per_rank[r].append(p)
                self._partition_param_group(group, per_rank)
            return self._partition_parameters_cache

        @property
        def _param_to_rank(self):  # an expert parameter of this rank's slot is this rank's (load_state_dict)
            if not self._param_to_rank_cache:
                parts = self._partition_parameters()
                for r, groups in enumerate(parts):
                    for g in groups:
                        for p in g["params"]:
                            self._param_to_rank_cache[p] = r
                for g in parts[self.rank]:
                    for p in g["params"]:
                        self._param_to_rank_cache[p] = self.rank
            return self._param_to_rank_cache

        def _sync_params(self):
            parts = self._partition_parameters()
            handles = []
            for r in range(self.world_size):
                src = dist.distributed_c10d.get_global_rank(self.process_group, r)
                handles += [dist.broadcast(data(p), src=src, group=self.process_group, async_op=True)
                            for g in parts[r] for p in g["params"] if id(p) not in self._lp_experts]
            if self._lp_slot_group is not None:
                for j, src in enumerate(self._lp_slot_ranks):
                    handles += [dist.broadcast(data(p), src=src, group=self._lp_slot_group, async_op=True)
                                for p in self._lp_slot_params[j]]
            for h in handles:
                h.wait()

    return ExpertZeroRedundancyOptimizer(params, **kwargs)
