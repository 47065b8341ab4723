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

[Note: expert tensors as DTensors]
A fused container's expert-indexed tensors (``gate_up_proj [E, 2I, H]``, ...) become DTensors sharded on dim 0 over
the ranks that divide them (a one-axis mesh ``ep`` over the expert-parallel group, or the tp mesh), holding this
rank's rows. What reads parameters by name then sees the whole tensor's layout: the consolidated checkpoint gathers
it (``full_tensor``), loading slices a whole tensor into the shard (any layout resumes any other), the optimizer
steps DTensors by mesh, and gradient clipping's total norm sums the shards' squares over the mesh, as for the
tensor-parallel layers. While the container's forward runs its tensors are swapped for their local shards
(``to_local``, differentiable), so the module's own code computes on plain tensors. A per-expert list's experts
stay whole modules: each rank simply holds fewer of them, under their own names.

[Note: who writes the experts]
A pipeline stage's consolidated state comes from its first replica (dp = cp = 0) alone, but that rank holds only
E/ep of its experts: the ranks of its expert-parallel group (the first ``ep`` of the stage's dp x cp ranks) add
their experts' entries and optimizer state, so that a fused tensor's ``full_tensor`` is called by every rank of
its mesh and a per-expert list's other modules reach the file from their holders.

[Note: expert parallelism inside pipeline stages]
With several pipeline stages each stage divides the experts of its own blocks (the other stages' blocks are ghosts
by step 6, holding nothing): the expert-parallel and expert-replica groups are formed within a stage (same pp and
tp index, [Note: which ranks hold which experts]), every rank forms every group (a stage without MoE layers too),
and the ranks of an expert-parallel group run the same schedule, so their all-to-alls come in the same order in
forward and backward. The stage's gradients are taken aside by the schedule runner and reduced by
:class:`lightning_par.pipeline.shared.SharedParameters`: its experts' by :meth:`ExpertParallel.reduce_gradients`
(over the replica group, / dp x cp), the rest averaged over dp (and cp) as before. A meta-built module's stage
divides its blocks' meta experts (found by the stage's block names: every parameter is meta before placement) and
reads this rank's rows / modules from ``weights=`` at placement, as with one stage.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_par.experts.discovery import FUSED, ExpertContainer, describe, find_experts
from lightning_par.experts.dispatch import dispatch_fused, divided_fused

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
    axis: str = "ep"  # "tp": divided over the tensor-parallel group ([Note: experts divided over the tensor-...])
    checked: str = ""  # the setup check's line ([Note: the setup check of an expert-parallel MoE layer])

    def describe(self) -> str:
        e0 = self.containers[0].num_experts // self.ep
        how = (f"gradients summed over {self.replicas} replicas' holders" if self.axis == "ep" else
               "tokens kept, partial outputs summed over tp; gradients averaged over dp as the rest")
        return (f"Expert parallel: {self.axis}={self.ep}, this rank holds experts [{self.rank * e0}, "
                f"{(self.rank + 1) * e0}) of each of {len(self.containers)} MoE layers; {how}\n"
                f"{describe(self.containers)}\n  routed experts divided over {self.axis}: "
                f"{', '.join(n for n, _ in self.parameters[:4])}{' ...' if len(self.parameters) > 4 else ''} "
                f"({len(self.parameters)} tensors); every other parameter keeps its axis")

    def expected_keys(self, keys: list[str]) -> list[str]:
        """The whole module's state-dict keys from this rank's ``keys``: a per-expert list's experts held by other
        ranks added under their own names (a fused tensor keeps its one name)."""
        out = list(keys)
        for c in self.containers:
            if c.kind == FUSED:
                continue
            local = c.num_experts // self.ep
            lo = self.rank * local
            mine = [k for k in keys if k.startswith(f"{c.name}.{lo}.")]
            suffixes = [k[len(f"{c.name}.{lo}."):] for k in mine]
            have = set(out)
            out += [f"{c.name}.{i}.{s}" for i in range(c.num_experts) for s in suffixes
                    if f"{c.name}.{i}.{s}" not in have]
        return out

    def _names(self) -> set[str]:
        return {n for n, _ in self.parameters}

    def dense_parameters(self, module: nn.Module) -> list:
        """``module``'s parameters that the data-parallel average covers (under ``tp``: all of them). By name: a
        later setup step may replace the parameter objects (placement, materialization)."""
        names = set() if self.axis == "tp" else self._names()
        return [p for n, p in module.named_parameters() if n not in names]

    def finish_gradients(self, module: Optional[nn.Module] = None) -> None:
        """Experts' gradients summed over the expert-replica group and divided by ``replicas`` ([Note: the experts'
        gradients]); one flat all-reduce. Under ``tp``: nothing (averaged over dp with the rest). ``module``: the
        one :func:`apply_expert_parallel` was given (its parameters looked up by name), else the ones it made."""
        if self.axis == "tp":
            return
        names = self._names()
        found = ([p for n, p in module.named_parameters() if n in names] if module is not None
                 else [p for _, p in self.parameters])
        params = [p for p in found if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.reduce_gradients([p.grad for p in params])

    def first_holders(self, topology, rank: int) -> bool:
        """Whether global ``rank`` is in the first expert-parallel group of its stage and tp index (``dp x cp``
        index below ep): its group together holds every expert once ([Note: who writes the experts])."""
        c = topology.coordinates(rank)
        return c["dp"] * topology.context_parallel_size + c.get("cp", 0) < self.ep

    def state(self, module: nn.Module) -> dict:
        """``module``'s state-dict entries of this rank's experts (fused: DTensors, gathered by all of their mesh)."""
        names = self._names()
        return {k: v.detach() for k, v in module.state_dict().items() if k in names}

    def reduce_gradients(self, grads: list) -> None:
        """``grads`` (this rank's expert parameters' gradients, plain or DTensor, in :attr:`parameters`' order
        everywhere) summed over the expert-replica group and divided by ``replicas`` in place; one flat
        all-reduce ([Note: the experts' gradients])."""
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.replica_group is not None:
            work = dist.all_reduce(flat, group=self.replica_group, async_op=True)
            work.wait(self.timeout or timedelta(minutes=30))
        if self.replicas != 1:
            flat /= self.replicas
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    def remove(self) -> None:
        """Undo the forwards' interception (the parameters stay this rank's share)."""
        for undo in self._undo:
            undo()
        self._undo.clear()


def _slice_fused(c: ExpertContainer, lo: int, hi: int, mesh) -> list[tuple[str, nn.Parameter]]:
    """Each expert-indexed tensor becomes a DTensor sharded on dim 0 over ``mesh`` ([Note: expert tensors as
    DTensors]) holding this rank's rows ``[lo, hi)``."""
    out = []
    for n in c.tensors:
        p = getattr(c.module, n)
        local = p.detach()[lo:hi].clone()
        share = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
                             requires_grad=p.requires_grad)
        setattr(share, EXPERT_MARK, True)
        setattr(c.module, n, share)
        out.append((f"{c.name}.{n}", share))
    return out


@contextlib.contextmanager
def _local_tensors(m: nn.Module, names: list[str]):
    """``m``'s DTensor expert tensors seen as their local shards while its forward runs (differentiably)."""
    saved = {n: m._parameters[n] for n in names}
    try:
        for n in names:
            m._parameters[n] = saved[n].to_local()
        yield
    finally:
        m._parameters.update(saved)


def _serve_fused(c: ExpertContainer, group, ep: int, timeout, rank: Optional[int] = None) -> callable:
    """``rank`` given: divided over a group holding the same tokens, without all-to-all (``divided_fused``)."""
    m, e = c.module, c.num_experts
    forward = type(m).forward  # for transformers 5: the experts interface's dispatch, as the config chose
    had = "num_experts" in m.__dict__ or hasattr(m, "num_experts")
    if had:
        m.num_experts = e // ep

    def ep_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"`{c.name}` was called with more than (hidden_states, top_k_index, top_k_weights); "
                            f"expert parallelism serves that call only. Leave it out of `experts=`.")
        if isinstance(hidden_states, DTensor):
            raise TypeError(f"`{c.name}` received a DTensor: its MoE block is inside a tensor-parallel region of the "
                            f"plan. Expert parallelism serves experts called on plain tensors; leave the MoE block "
                            f"out of the plan (`plan=`) or drop expert_parallel_size.")
        with _local_tensors(self, c.tensors):
            if rank is not None:
                return divided_fused(self, forward, hidden_states, top_k_index, top_k_weights, num_experts=e,
                                     group=group, size=ep, rank=rank, timeout=timeout)
            return dispatch_fused(self, forward, hidden_states, top_k_index, top_k_weights, num_experts=e,
                                  group=group, ep=ep, timeout=timeout)

    m.forward = types.MethodType(ep_forward, m)

    def undo():
        m.__dict__.pop("forward", None)
        if had:
            m.num_experts = e
    return undo


def apply_expert_parallel(module: nn.Module, group, replica_group, *, ep: int, rank: int, replicas: int,
                          experts: Optional[str] = None, timeout: Optional[timedelta] = None,
                          found: Optional[list[ExpertContainer]] = None) -> ExpertParallel:
    """Divide ``module``'s routed experts over the ``ep`` ranks of ``group`` (this rank is ``rank`` of it) and
    dispatch tokens to them; ``replica_group``: the ranks holding the same experts, ``replicas``: the
    data-parallel replicas the gradients average over ([Note: which ranks hold which experts], [Note: the
    experts' gradients]). Every rank must hold the same weights before (rank 0's): each keeps its slice."""
    from lightning_par.experts.replay import serve_list

    if found is None:  # ``found``: the containers to divide, a pipeline stage's (apply_experts)
        found = find_experts(module, experts)
    check_expert_layout(found, ep, type(module).__name__, experts)
    applied = ExpertParallel(found, ep, rank, group, replica_group, replicas, timeout)
    mesh = None
    for c in found:
        local = c.num_experts // ep
        lo, hi = rank * local, (rank + 1) * local
        if c.kind == FUSED:
            if mesh is None:
                mesh = _mesh_of(group, c.module)
            applied.parameters += _slice_fused(c, lo, hi, mesh)
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
                  timeout: Optional[timedelta] = None, tp_group=None, tp_mesh=None,
                  stage_blocks: Optional[tuple[str, ...]] = None) -> Optional[ExpertParallel]:
    """The parallelize order's expert-parallel step. At ``expert_parallel_size=1``: with tensor parallelism
    (``tp_group``), the fused experts divided over tp (:func:`apply_tensor_experts`), else None. Otherwise this
    rank's groups
    (:func:`~lightning_par.experts.layout.expert_groups`, every rank calls this) and :func:`apply_expert_parallel`
    with the replicas of [Note: the experts' gradients] (dp x cp). A module an earlier run divided keeps its
    experts (the same ``ep`` only). ``stage_blocks``: a pipeline stage's blocks' dotted names, whose experts it
    divides ([Note: expert parallelism inside pipeline stages])."""
    from lightning_par.experts.layout import expert_groups

    ep = expert_parallel_size
    if ep == 1:
        tp = topology.tensor_parallel_size
        if tp == 1 or tp_group is None:
            return None
        return apply_tensor_experts(module, tp_group, size=tp, rank=topology.coordinates(rank)["tp"],
                                    experts=experts, timeout=timeout, mesh=tp_mesh)
    before = module.__dict__.get(_APPLIED)
    if before is not None:
        if before.ep != ep:
            raise ValueError(f"{type(module).__name__}'s experts were divided by an earlier Trainer with "
                             f"expert_parallel_size={before.ep}, and this strategy has expert_parallel_size={ep}. "
                             f"Use expert_parallel_size={before.ep}, or build the module anew.")
        return before
    found = find_experts(module, experts)  # refused before any group is made: the same on every rank
    if stage_blocks is not None:  # this stage's blocks' experts ([Note: expert parallelism inside pipeline stages])
        from lightning_par.materialize import has_meta

        # in this stage's blocks (a meta-built module's too), or held whole outside the stack
        found = [c for c in found if any(c.name.startswith(f"{b}.") for b in stage_blocks) or not has_meta(c.module)]
        if found:
            check_expert_layout(found, ep, type(module).__name__, experts)
    else:
        check_expert_layout(found, ep, type(module).__name__, experts)
    group, replica_group, index = expert_groups(topology, rank, ep, timeout)  # every rank, every stage
    if not found:  # a stage without MoE layers
        return None
    applied = apply_expert_parallel(module, group, replica_group, ep=ep, rank=index,
                                    replicas=topology.data_parallel_size * topology.context_parallel_size,
                                    experts=experts, timeout=timeout, found=found)
    module.__dict__[_APPLIED] = applied
    return applied


def leave_experts_out(plan, module: nn.Module, *, expert_parallel_size: int, experts: Optional[str] = None,
                      stack: Optional[str] = None):
    """The tensor plan without the routed experts (divided whole over ep, not split over tp); refuses a module
    without experts or an ``ep`` that does not divide them, before any collective, and a pipeline's block
    ``stack`` that is (or lies in) an experts container. ``plan``: a
    :class:`~lightning_par.tensor.plan.TensorPlan`, or None without tensor parallelism (only the refusals)."""
    if expert_parallel_size == 1:
        return plan
    found = find_experts(module, experts)
    check_expert_layout(found, expert_parallel_size, type(module).__name__, experts)
    for c in found if stack is not None else []:
        if stack == c.name or stack.startswith(f"{c.name}."):
            raise ValueError(f"The pipeline's block stack `{stack}` is {type(module).__name__}'s routed experts "
                             f"`{c.name}` (found as the longest list of one class): expert parallelism divides them "
                             f"within a stage. Name the transformer layers with blocks=, e.g. blocks='model.layers'.")
    return plan.without([c.name for c in found]) if plan is not None else None


def _mesh_of(group, module: nn.Module) -> DeviceMesh:
    """A one-axis ``DeviceMesh`` named ``ep`` over ``group``'s ranks, on the device type of ``module``'s tensors
    (a meta-built module's: the group's backend's, NCCL's CUDA or gloo's CPU)."""
    device = next(iter(module.parameters())).device.type
    if device == "meta":
        device = "cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu"
    return DeviceMesh.from_group(group, device, mesh_dim_names=("ep",))


def apply_tensor_experts(module: nn.Module, group, *, size: int, rank: int, experts: Optional[str] = None,
                         timeout: Optional[timedelta] = None, mesh=None) -> Optional[ExpertParallel]:
    """Under tensor parallelism alone: each fused experts container's experts divided whole over the ``size`` ranks
    of the tp ``group`` ([Note: experts divided over the tensor-parallel group]). None where the module has no fused
    experts or ``size`` divides none of them (they stay as the tensor plan has them; a per-expert list is split
    by the plan's colwise / rowwise styles). Every rank must hold the same weights before."""
    before = module.__dict__.get(_APPLIED)
    if before is not None:
        return before
    found = [c for c in find_experts(module, experts) if c.kind == FUSED and c.num_experts % size == 0]
    if not found:
        return None
    applied = ExpertParallel(found, size, rank, group, None, 1, timeout, axis="tp")
    mesh = mesh if mesh is not None else _mesh_of(group, found[0].module)
    for c in found:
        local = c.num_experts // size
        applied.parameters += _slice_fused(c, rank * local, (rank + 1) * local, mesh)
        applied._undo.append(_serve_fused(c, group, size, timeout, rank=rank))
    module.__dict__[_APPLIED] = applied
    return applied


def divided_before(module: nn.Module, expert_parallel_size: int) -> Optional[ExpertParallel]:
    """What an earlier setup's :func:`apply_experts` made of ``module`` (it keeps its experts divided, as a
    tensor-parallel module keeps its shards), or None; a different ``expert_parallel_size`` is refused."""
    before = module.__dict__.get(_APPLIED)
    if before is not None and before.axis == "ep" and before.ep != expert_parallel_size:
        raise ValueError(f"{type(module).__name__}'s experts were divided by an earlier Trainer with "
                         f"expert_parallel_size={before.ep}, and this strategy has expert_parallel_size="
                         f"{expert_parallel_size}. Use expert_parallel_size={before.ep}, or build the module anew.")
    if before is not None and before.axis == "tp" and expert_parallel_size != 1:
        raise ValueError(f"{type(module).__name__}'s experts were divided over tensor_parallel_size={before.ep} by an "
                         f"earlier Trainer, and this strategy has expert_parallel_size={expert_parallel_size}. Build "
                         f"the module anew for this run.")
    return before
