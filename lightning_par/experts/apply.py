"""Expert parallelism for an unchanged module: each rank of an expert-parallel group holds E/ep whole experts of
every MoE layer, and every token's hidden state travels to its experts' ranks and back.

    >>> applied = apply_expert_parallel(model, ep_group, replica_group, replicas=2)    # doctest: +SKIP
    >>> loss_fn(model(idx), targets).backward()      # router and dense layers as written, experts dispatched
    >>> applied.finish_gradients()                   # experts' gradients over the ranks holding the same experts
    >>> # everything else: averaged over the data-parallel replicas as before (applied.dense_parameters())

[Note: which ranks hold which experts]
The expert-parallel ranks are borrowed from the data-parallel ones (x the context-parallel ones), as torchtitan
borrows them from ``dp_shard x cp``: the world stays dp x pp x cp x tp. Flatten (dp, cp) to ``i = dp_index * cp +
cp_index``; ranks with the same pipeline stage and tensor-parallel index and the same ``i // ep`` form an
expert-parallel group (they exchange tokens), and rank ``i % ep`` of that group holds experts ``[r E/ep, (r+1)
E/ep)`` of every MoE layer. Ranks with the same ``i % ep`` (and pp, tp) hold the same experts: the expert-replica
group, ``dp x cp / ep`` ranks.

[Note: the experts' gradients]
With dense parameters each replica computes the gradient of its own loss and the replicas average: g = (1/R)
sum_r g_r, R = dp x cp (the cp average and the dp average of the core, one after the other). An expert's
gradient on its holder is already the sum over the expert-parallel group of every rank's loss's contribution
(the tokens came from all of them, and their gradients came back by the all-to-all's backward), so summing it over
the expert-replica group covers every rank once: g_expert = (1/R) sum over the replica group. An expert that
received no token on a rank has no gradient there; it gets zeros (a fused tensor's unused rows are zeros on one
device too) so that the replicas' flat buffers line up.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.experts.discovery import FUSED, ExpertContainer, describe, find_experts
from lightning_par.experts.dispatch import dispatch_fused

EXPERT_MARK = "_lightning_par_expert"


def is_expert_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is a routed expert's weight divided by :func:`apply_expert_parallel`."""
    return bool(getattr(p, EXPERT_MARK, False))


def check_expert_layout(found: list[ExpertContainer], ep: int, module_name: str, experts: Optional[str]) -> None:
    """Refuse, before any collective, a module without experts or an ``ep`` that does not divide every layer's."""
    if not found:
        raise ValueError(f"`expert_parallel_size={ep}`: {module_name} has no routed experts (no fused expert "
                         f"tensors called as experts(hidden_states, top_k_index, top_k_weights), no nn.ModuleList "
                         f"named `experts`){' matching experts=' + repr(experts) if experts else ''}. Name its "
                         f"experts container with `experts='<glob>'`, or drop expert_parallel_size.")
    for c in found:
        if c.num_experts % ep:
            raise ValueError(f"`expert_parallel_size={ep}` does not divide the {c.num_experts} experts of "
                             f"`{c.name}`: each rank holds E/ep whole experts. Choose a divisor of "
                             f"{c.num_experts}.")


@dataclass
class ExpertParallel:
    """What :func:`apply_expert_parallel` made: the containers, this rank's expert parameters, the groups."""

    containers: list[ExpertContainer]
    ep: int
    rank: int
    group: object
    replica_group: object
    replicas: int  # R of [Note: the experts' gradients]
    timeout: Optional[timedelta] = None
    parameters: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    _undo: list = field(default_factory=list)

    def describe(self) -> str:
        e0 = self.containers[0].num_experts // self.ep
        return (f"Expert parallel: ep={self.ep}, this rank holds experts [{self.rank * e0}, {(self.rank + 1) * e0}) "
                f"of each of {len(self.containers)} MoE layers; gradients summed over {self.replicas} replicas' "
                f"holders\n{describe(self.containers)}\n  routed experts divided over ep: "
                f"{', '.join(n for n, _ in self.parameters[:4])}{' ...' if len(self.parameters) > 4 else ''} "
                f"({len(self.parameters)} tensors); every other parameter keeps its axis")

    def finish_gradients(self) -> None:
        """Experts' gradients summed over the expert-replica group and divided by ``replicas`` ([Note: the experts'
        gradients]); one flat all-reduce."""
        params = [p for _, p in self.parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        if self.replica_group is not None:
            work = dist.all_reduce(flat, group=self.replica_group, async_op=True)
            work.wait(self.timeout or timedelta(minutes=30))
        if self.replicas != 1:
            flat /= self.replicas
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def whole_state(self, state: dict) -> dict:
        """``state`` (this rank's ``state_dict``) with each fused expert tensor gathered whole over the
        expert-parallel group (every rank of it calls this, in the same order); a per-expert list's experts keep
        their own names, which differ by rank, so a union of the ranks' states holds them all."""
        names = {f"{c.name}.{t}" for c in self.containers for t in c.tensors}
        out = dict(state)
        for key in sorted(state):
            short = next((n for n in names if key == n or key.endswith("." + n)), None)
            if short is None:
                continue
            local = state[key].detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(self.ep)]
            work = dist.all_gather(parts, local, group=self.group, async_op=True)
            work.wait(self.timeout or timedelta(minutes=30))
            out[key] = torch.cat(parts)
        return out

    def remove(self) -> None:
        """Undo the forwards' interception (the parameters stay this rank's share)."""
        for undo in self._undo:
            undo()
        self._undo.clear()


def _slice_fused(c: ExpertContainer, lo: int, hi: int) -> list[tuple[str, nn.Parameter]]:
    out = []
    for n in c.tensors:
        p = getattr(c.module, n)
        share = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
        setattr(share, EXPERT_MARK, True)
        setattr(c.module, n, share)
        out.append((f"{c.name}.{n}", share))
    return out


def _serve_fused(c: ExpertContainer, group, ep: int, timeout) -> callable:
    m, e = c.module, c.num_experts
    forward = type(m).forward  # for transformers 5: the experts interface's dispatch, as the config chose
    had = "num_experts" in m.__dict__ or hasattr(m, "num_experts")
    if had:
        m.num_experts = e // ep

    def ep_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"`{c.name}` was called with more than (hidden_states, top_k_index, top_k_weights); "
                            f"expert parallelism serves that call only. Leave it out of `experts=`.")
        return dispatch_fused(self, forward, hidden_states, top_k_index, top_k_weights, num_experts=e,
                              group=group, ep=ep, timeout=timeout)

    m.forward = types.MethodType(ep_forward, m)

    def undo():
        m.__dict__.pop("forward", None)
        if had:
            m.num_experts = e
    return undo


def apply_expert_parallel(module: nn.Module, group, replica_group, *, ep: int, rank: int, replicas: int,
                          experts: Optional[str] = None, timeout: Optional[timedelta] = None) -> ExpertParallel:
    """Divide ``module``'s routed experts over the ``ep`` ranks of ``group`` (this rank is ``rank`` of it) and
    dispatch tokens to them; ``replica_group``: the ranks holding the same experts, ``replicas``: the
    data-parallel replicas the gradients average over ([Note: which ranks hold which experts], [Note: the
    experts' gradients]). Every rank must hold the same weights before (rank 0's): each keeps its slice."""
    from lightning_par.experts.replay import serve_list

    found = find_experts(module, experts)
    check_expert_layout(found, ep, type(module).__name__, experts)
    applied = ExpertParallel(found, ep, rank, group, replica_group, replicas, timeout)
    for c in found:
        local = c.num_experts // ep
        lo, hi = rank * local, (rank + 1) * local
        if c.kind == FUSED:
            applied.parameters += _slice_fused(c, lo, hi)
            applied._undo.append(_serve_fused(c, group, ep, timeout))
        else:
            served = serve_list(c, group, ep, rank, timeout)
            for i, m in enumerate(served.mine):
                for n, p in m.named_parameters():
                    setattr(p, EXPERT_MARK, True)
                    applied.parameters.append((f"{c.name}.{lo + i}.{n}", p))
            applied._undo.append(served.remove)
    return applied


_APPLIED = "_lightning_par_expert_parallel"


def apply_experts(module: nn.Module, topology, rank: int, *, expert_parallel_size: int, experts: Optional[str] = None,
                  timeout: Optional[timedelta] = None) -> Optional[ExpertParallel]:
    """The parallelize order's expert-parallel step: None at ``expert_parallel_size=1``; else this rank's groups
    (:func:`~lightning_par.experts.layout.expert_groups`, every rank calls this) and :func:`apply_expert_parallel`
    with the replicas of [Note: the experts' gradients] (dp x cp). A module an earlier run divided keeps its
    experts (the same ``ep`` only)."""
    from lightning_par.experts.layout import expert_groups

    ep = expert_parallel_size
    if ep == 1:
        return None
    before = module.__dict__.get(_APPLIED)
    if before is not None:
        if before.ep != ep:
            raise ValueError(f"{type(module).__name__}'s experts were divided by an earlier Trainer with "
                             f"expert_parallel_size={before.ep}, and this strategy has expert_parallel_size={ep}. "
                             f"Use expert_parallel_size={before.ep}, or build the module anew.")
        return before
    found = find_experts(module, experts)  # refused before any group is made: the same on every rank
    check_expert_layout(found, ep, type(module).__name__, experts)
    group, replica_group, index = expert_groups(topology, rank, ep, timeout)
    applied = apply_expert_parallel(module, group, replica_group, ep=ep, rank=index,
                                    replicas=topology.data_parallel_size * topology.context_parallel_size,
                                    experts=experts, timeout=timeout)
    module.__dict__[_APPLIED] = applied
    return applied


def clip_grad_norm_with_experts(parameters, max_norm: float, applied: ExpertParallel) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) over the whole model's gradients when this rank holds only its
    experts: the experts' squares are summed over the expert-parallel group (each expert counted once; its
    replicas hold the same averaged gradient), the rest are the same on every rank. Every rank then scales by the
    same coefficient, as one device would."""
    params = [p for p in parameters if p.grad is not None]
    dense = [p.grad for p in params if not is_expert_parameter(p)]
    experts = [p.grad for p in params if is_expert_parameter(p)]
    zero = torch.zeros((), dtype=torch.float32, device=params[0].grad.device if params else "cpu")
    sq_dense = sum((g.detach().float().pow(2).sum() for g in dense), zero)
    sq_experts = sum((g.detach().float().pow(2).sum() for g in experts), zero.clone())
    work = dist.all_reduce(sq_experts, group=applied.group, async_op=True)
    work.wait(applied.timeout or timedelta(minutes=30))
    total = (sq_dense + sq_experts).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return total


def leave_experts_out(plan, module: nn.Module, *, expert_parallel_size: int, experts: Optional[str] = None):
    """The tensor plan without the routed experts (divided whole over ep, not split over tp); refuses a module
    without experts or an ``ep`` that does not divide them, before any collective. ``plan``: a
    :class:`~lightning_par.tensor.plan.TensorPlan`."""
    if expert_parallel_size == 1:
        return plan
    found = find_experts(module, experts)
    check_expert_layout(found, expert_parallel_size, type(module).__name__, experts)
    return plan.without([c.name for c in found])
