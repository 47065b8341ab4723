"""Gradients of a pipeline that span ranks: parameters outside the blocks that several stages use, the
average over data-parallel replicas, the global gradient norm and the 16-mixed overflow flag.

[Note: shared parameters] Which stage uses a parameter outside the blocks is not known before a step
runs (an embedding tied to the head, a position table every block reads). After the first step every
rank reports which of them got a gradient (one ``all_gather_object``); a parameter used by several stages
of a pipeline gets a group of exactly those ranks and its gradient is summed there every step; the lowest
such stage owns it for the global norm and the consolidated checkpoint. Copies that a stage never uses
stay untouched (stale) on that rank. Until then (and for parameters no stage trains) the owner is the one
decided at setup, the lowest stage that holds it ([Note: the ends a stage needs] in ends.py), or stage 0.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_par._compat import scaler_optimizer_state, wrapped_optimizer
from lightning_par.tensor.mixed import average_flat_
from lightning_par.topology import Topology


class SharedParameters:
    """The gradient bookkeeping of one rank's stage: ``params`` are the module's trainable parameters (in
    its order), ``block_ids`` the ids of those in this stage's blocks."""

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter], block_ids: set[int], *,
                 topology: Topology, rank: int, timeout: timedelta, dp_group=None, cp_group=None,
                 default_owner: Optional[dict[str, int]] = None, experts: Any = None):
        self.module, self.params, self.block_ids = module, params, block_ids
        self.default_owner = dict(default_owner or {})  # non-block parameter name -> stage, decided at setup
        self.topology, self.rank, self.timeout, self.dp_group = topology, rank, timeout, dp_group
        self.cp_group = cp_group  # context parallelism: every gradient is averaged over it too
        # expert parallelism (lightning_par.experts.ExpertParallel): this stage's experts' gradients are summed over
        # the ranks holding the same experts instead ([Note: expert parallelism inside pipeline stages])
        self.experts = experts
        held = experts._names() if experts is not None else set()
        self._expert_ids = {id(p) for n, p in module.named_parameters() if n in held}
        self.owner_stage: Optional[dict[str, int]] = None  # non-block parameter name -> owning stage
        self.groups: dict[str, Any] = {}  # non-block parameter name -> group of the stages that use it
        self._order: Optional[list] = None  # (index into params, group), in name order: the same on every rank
        # averages a flat gradient over the replicas in place, instead of the dp group's all-reduce (torchft's live
        # replica groups: lightning_par.strategies._fault_tolerance; a DDP communication hook: dp/comm_hooks.py);
        # None: the dp group's all-reduce (lightning_par.tensor.mixed.average_flat_)
        self.replica_average: Optional[Callable[..., None]] = None

    @property
    def stage(self) -> int:
        return self.topology.coordinates(self.rank)["pp"]

    def names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.module.named_parameters()}

    @property
    def discovered(self) -> bool:
        return self.owner_stage is not None

    def add_step_gradients(self, grads: list[Optional[torch.Tensor]], optimizers: Iterable) -> None:
        """A step's gradients of ``params`` (taken aside by the runner) reduced over the ranks that hold
        copies and added to the parameters' (see [Note: schedule inside training_step] in runner.py)."""
        if not self.discovered:
            self.discover(grads)
            self.drop_unused_optimizer_state(grads, optimizers)
        self.reduce(grads)
        for p, g in zip(self.params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g

    def discover(self, grads: list[Optional[torch.Tensor]]) -> None:
        """After the first step: which stages use each parameter outside the blocks (see [Note: shared
        parameters]); ``grads`` are the step's gradients of ``params``. Every rank calls it."""
        names = self.names()
        used = sorted(names[id(p)] for p, g in zip(self.params, grads) if g is not None and id(p) not in self.block_ids)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.rank, used))
        users: dict[tuple[tuple[int, int, int], str], list[int]] = {}  # ((dp, cp, tp): a pipeline, name) -> stages
        for rank, rank_used in everyone:
            c = self.topology.coordinates(rank)
            for n in rank_used:
                users.setdefault(((c["dp"], c.get("cp", 0), c["tp"]), n), []).append(c["pp"])
        me = self.topology.coordinates(self.rank)
        line = (me["dp"], me.get("cp", 0), me["tp"])
        self.owner_stage = {n: min(st) for (pipe, n), st in users.items() if pipe == line}
        shared_sets = sorted({(pipe, tuple(sorted(st))) for (pipe, n), st in users.items() if len(st) > 1})
        groups = {}
        for pipe, stages in shared_sets:  # every rank creates every group, in one order
            ranks = [self.topology.rank_of(pp=s, dp=pipe[0], cp=pipe[1], tp=pipe[2]) for s in stages]
            groups[(pipe, stages)] = dist.new_group(ranks, timeout=self.timeout)
        for (pipe, n), st in users.items():
            if pipe == line and len(st) > 1 and me["pp"] in st:
                self.groups[n] = groups[(pipe, tuple(sorted(st)))]

    def drop_unused_optimizer_state(self, grads: list[Optional[torch.Tensor]], optimizers: Iterable) -> None:
        """Optimizer state loaded for a parameter copy this stage never uses (a sharded checkpoint gives every
        stage the state of every parameter it holds) is freed: the copy never gets a gradient."""
        unused = {id(p) for p, g in zip(self.params, grads) if g is None and id(p) not in self.block_ids}
        for optimizer in optimizers:
            state = wrapped_optimizer(optimizer).state
            for p in [p for p in state if id(p) in unused]:
                del state[p]

    def reduce(self, grads: list[Optional[torch.Tensor]]) -> None:
        """Sum the shared parameters' gradients over the stages that use them, then average every gradient
        over the data-parallel replicas (in place in ``grads``)."""
        if self._order is None:
            names = self.names()
            order = sorted(enumerate(self.params), key=lambda ip: names[id(ip[1])])
            self._order = [(i, self.groups[names[id(p)]]) for i, p in order if names[id(p)] in self.groups]
        for p_idx, group in self._order:
            if grads[p_idx] is None:
                grads[p_idx] = torch.zeros_like(self.params[p_idx])
            dist.all_reduce(_local(grads[p_idx]), group=group)  # a DTensor's shard: the same on every stage
        if self._expert_ids:  # every rank of a replica group reduces the same positions (zeros: no token came)
            mine = [i for i, p in enumerate(self.params) if id(p) in self._expert_ids]
            for i in mine:
                if grads[i] is None:
                    grads[i] = torch.zeros_like(self.params[i])
            self.experts.reduce_gradients([grads[i] for i in mine])
        present = [_local(g) for p, g in zip(self.params, grads)  # replicas hold the same shards
                   if g is not None and id(p) not in self._expert_ids]
        if self.dp_group is not None or self.replica_average is not None:
            average_flat_(present, self.dp_group, self.topology.data_parallel_size, average=self.replica_average)
        if self.cp_group is not None:  # [Note: gradients under context parallelism] in context/sharding.py
            average_flat_(present, self.cp_group, self.topology.context_parallel_size)

    def owns(self, p: torch.nn.Parameter, name: str) -> bool:
        """Whether this stage counts ``p`` (for the global gradient norm and the consolidated state)."""
        if id(p) in self.block_ids:
            return True
        return (self.owner_stage or {}).get(name, self.default_owner.get(name, 0)) == self.stage

    def clip_grad_norm_(self, params: Iterable[torch.nn.Parameter], max_norm: Union[int, float], *, group,
                        device: torch.device, tp_group=None, dp_group=None) -> None:
        """Scale the gradients of ``params`` so that their norm over the whole pipeline (``group``: its
        stages; each gradient counted once, by its owner) is at most ``max_norm``. A gradient sharded over
        the tensor-parallel ranks (``tp_group``) or by FSDP over the replicas (``dp_group``) counts each
        shard once; a replicated one once."""
        names = self.names()
        params = [p for p in params if p.grad is not None]
        sums = {axes: torch.zeros((), dtype=torch.float32, device=device)
                for axes in [(), ("tp",), ("dp",), ("dp", "tp")]}  # squares, by the axes a gradient is sharded on
        for p in params:
            if self.owns(p, names.get(id(p), "")):
                sums[_sharded_axes(p.grad)] += _local(p.grad.detach()).float().pow(2).sum()
        for axis, axis_group in (("tp", tp_group), ("dp", dp_group)):  # one all-reduce per axis, of its buckets
            if axis_group is not None:
                keys = [axes for axes in sums if axis in axes]
                both = torch.stack([sums[k] for k in keys])
                dist.all_reduce(both, group=axis_group)
                sums.update(zip(keys, both.unbind()))
        sq = sum(sums.values())
        if group is not None:
            dist.all_reduce(sq, group=group)
        coef = torch.clamp(float(max_norm) / (sq.sqrt() + 1e-6), max=1.0)
        for p in params:
            g = _local(p.grad.detach())
            g.mul_(coef.to(g.dtype))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel (DTensor) gradient's local shard, in place; a plain tensor as it is."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():  # to_local() hands back the shard itself outside autograd
        return t.to_local()


def _sharded_axes(t: torch.Tensor) -> tuple:
    """The mesh axes (``"dp"`` and / or ``"tp"``) a DTensor is sharded on; a plain tensor: none. A
    tensor-parallel shard's mesh names its axis "tp", an FSDP shard's "dp" (FSDP over tensor-parallel
    shards: both)."""
    if not isinstance(t, DTensor):
        return ()
    names = t.device_mesh.mesh_dim_names or ("tp",) * t.device_mesh.ndim
    return tuple(sorted({n for n, p in zip(names, t.placements) if p.is_shard()}))


def sync_found_inf(scaler, optimizer, device: torch.device) -> None:
    """16-mixed: the GradScaler has unscaled this rank's gradients; an overflow found on any rank must skip
    the step on every rank (and halve the one loss scale everywhere), so the found-inf flags of
    ``optimizer`` are max-reduced over the world."""
    state = scaler_optimizer_state(scaler, optimizer)
    found = list(state["found_inf_per_device"].values())
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for f in found:
        flag = torch.maximum(flag, f.to(flag.device, torch.float32))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    for f in found:
        f.fill_(flag.item())
