"""Models whose parameters are partly DTensors (the sharded layers) and partly plain tensors (the rest).

[Note: mixed DTensor / plain parameters]
torch refuses a list that mixes DTensors and plain tensors in one ``torch._foreach_*`` call, so
``clip_grad_norm_`` and ``foreach`` / ``fused`` optimizers fail on such a model. Making every parameter a
DTensor would put every norm and embedding through DTensor dispatch (slower, and user code that touches a
weight directly would then mix kinds itself). Instead the replicated parameters stay plain and:

- the optimizer steps each param group as one group per kind (and per mesh: FSDP over tensor-parallel
  shards adds a second one), with the same hyper-parameters (:func:`split_step_by_kind`, through torch's
  optimizer step hooks); outside ``step`` its ``param_groups`` and ``state_dict()`` keep the user's layout, so
  LR schedulers and checkpoints see exactly what ``configure_optimizers`` built;
- the gradient norm is computed per kind and mesh and combined (a sharded DTensor's norm is already global):
  :func:`clip_grad_norm_` / :func:`clip_grad_value_`.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def by_layout(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by kind and mesh: the plain ones, and the DTensors of each ``DeviceMesh`` (FSDP over
    tensor-parallel shards puts a model's DTensors on two meshes: ``dp`` and ``dp × tp``), in first-seen order."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


class StepByKind:
    """torch's step hooks on ``optimizer`` (a pre-hook and a post-hook) that step DTensor and plain parameters
    of a param group as separate groups: the pre-hook puts the split groups in, the post-hook the user's back.
    The strategy holds it for its run and takes it out at teardown (:meth:`remove`)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.groups: Optional[list] = None  # the user's groups while a split step is under way
        self.handles = [optimizer.register_step_pre_hook(self._split), optimizer.register_step_post_hook(self._join)]

    def _split(self, optimizer, args, kwargs) -> None:
        self._join(optimizer, args, kwargs)  # a step that raised ran no post-hook: its groups come back first
        split = []
        for g in optimizer.param_groups:
            parts = by_layout(g["params"])
            split += [{**g, "params": part} for part in parts] if len(parts) > 1 else [g]
        if len(split) != len(optimizer.param_groups):
            self.groups, optimizer.param_groups = optimizer.param_groups, split

    def _join(self, optimizer, args, kwargs) -> None:
        if self.groups is not None:
            optimizer.param_groups, self.groups = self.groups, None

    def restore(self) -> None:
        """The user's groups back now: a step left by an exception (``nonfinite="skip"``) ran no post-hook, and
        Lightning's scheduler steps before the next pre-hook would."""
        self._join(self.optimizer, (), {})

    def remove(self) -> None:
        self.restore()
        for handle in self.handles:
            handle.remove()
        self.handles = []


def split_step_by_kind(optimizer: torch.optim.Optimizer) -> StepByKind:
    """Make ``optimizer.step`` step DTensor and plain parameters of a group separately, through torch's step
    hooks (:class:`StepByKind`; ``optimizer.step`` itself is left as it is); the caller removes the hooks."""
    return StepByKind(optimizer)


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients together, as a plain tensor (sharded DTensors contribute their global norm)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norms = []
    for part in by_layout(grads):
        n = torch.nn.utils.get_total_norm(part, norm_type)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a mix of DTensor and plain parameters."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    for group in by_layout(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def clip_grad_value_(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    for group in by_layout(p for p in parameters if p.grad is not None):
        torch.nn.utils.clip_grad_value_(group, clip_value)


def subclass_copy(obj, cls: type):
    """A shallow copy of ``obj`` made as an instance of ``cls`` (a subclass of ``obj``'s class): the new object
    shares ``obj``'s state, as ``copy.copy`` would, and ``obj`` itself is left as it is."""
    new = cls.__new__(cls)
    new.__dict__.update(vars(obj))
    return new


_SCALERS: dict[type, type] = {}


def split_unscale_scaler(scaler):
    """A copy of ``scaler`` (sharing its state) whose class unscales DTensor and plain gradients in separate
    calls (torch's fused unscale refuses the mix) and merges the per-device inf flags: a subclass of the
    scaler's own class, made once per class."""
    base = type(scaler)
    if base not in _SCALERS:
        class SplitUnscaleScaler(base):  # type: ignore[misc, valid-type]
            def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
                groups = optimizer.param_groups
                merged: dict = {}
                try:
                    for want_dtensor in (True, False):
                        optimizer.param_groups = [{**g, "params": [p for p in g["params"]
                                                                   if isinstance(p, DTensor) == want_dtensor]}
                                                  for g in groups]
                        flags = super()._unscale_grads_(optimizer, inv_scale, torch.zeros_like(found_inf), allow_fp16)
                        for device, flag in flags.items():
                            merged[device] = merged[device] + flag if device in merged else flag
                finally:
                    optimizer.param_groups = groups
                return merged

        SplitUnscaleScaler.__name__ = SplitUnscaleScaler.__qualname__ = f"SplitUnscale{base.__name__}"
        _SCALERS[base] = SplitUnscaleScaler
    return subclass_copy(scaler, _SCALERS[base])


def reduce_partial_grads(parameters: Iterable[torch.Tensor], group) -> int:
    """:func:`settle_grads` applied to the parameters' own gradients; returns how many were changed."""
    parameters = list(parameters)
    settled = settle_grads(parameters, [p.grad for p in parameters], group)
    changed = 0
    for p, g in zip(parameters, settled):
        if g is not p.grad:
            p.grad, changed = g, changed + 1
    return changed


def settle_grads(parameters: list[torch.Tensor], grads: list, group) -> list:
    """``grads`` (of ``parameters``, ``None`` where absent) with ``Partial(sum)`` DTensor gradients turned into
    their parameter's placement by one all-reduce for all over the tensor-parallel ``group``, and other DTensor
    gradients whose placement is not their parameter's redistributed to it (replicated to sharded: no
    communication).

    Under sequence parallelism a replicated norm weight sees only this rank's part of the sequence, so its
    gradient comes out of backward as a partial sum over the tensor-parallel ranks. A plain parameter that a
    region's code used directly (not through its module) gets a DTensor gradient, computed under implicit
    replication (see [Note: one layout per region]); it becomes the plain full gradient.
    """
    out = list(grads)
    for i, (p, g) in enumerate(zip(parameters, grads)):
        if isinstance(g, DTensor) and not isinstance(p, DTensor):
            out[i] = g.full_tensor()
        elif (isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements
              and not any(pl.is_partial() for pl in g.placements)):
            # a replicated gradient of a sharded weight (a vocabulary-parallel embedding's lookup on a stage
            # without the tied head): this rank's shard of it, no communication
            out[i] = g.redistribute(p.device_mesh, p.placements)
    pending = [i for i, g in enumerate(out) if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements)]
    if not pending:
        return out
    if any(getattr(pl, "reduce_op", "sum") != "sum" for i in pending for pl in out[i].placements if pl.is_partial()):
        for i in pending:  # not a sum: let DTensor do it one by one
            out[i] = out[i].redistribute(out[i].device_mesh, parameters[i].placements)
        return out
    locals_ = [out[i].to_local() for i in pending]
    flat = torch.cat([g.reshape(-1) for g in locals_])
    dist.all_reduce(flat, group=group)
    offset = 0
    for i, g in zip(pending, locals_):
        chunk = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
        out[i] = DTensor.from_local(chunk, out[i].device_mesh, parameters[i].placements, run_check=False)
    return out


def average_grads(parameters: Iterable[torch.Tensor], group, size: int, *,
                  average: Optional[Callable[..., None]] = None) -> None:
    """Average gradients over a data-parallel ``group`` of ``size`` replicas (:func:`average_flat_`); or, given
    ``average`` (torchft's live replica groups, a communication hook: :func:`average_flat_`), with it.

    A DTensor gradient is averaged through its local shard: data-parallel peers hold the same shard.
    """
    if size == 1 and average is None:
        return
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    average_flat_(grads, group, size, average=average)


def average_flat_(tensors: Iterable[torch.Tensor], group, size: int, *,
                  average: Optional[Callable[..., None]] = None) -> None:
    """Average ``tensors`` in place over the ``size`` ranks of ``group``: one flat all-reduce (SUM, then / size) per
    dtype and device; or each flat tensor through ``average(flat, tensors, last)`` (in place; ``tensors``: what the
    flat one concatenates, ``last``: the last of them; torchft's live replica groups, or a DDP communication hook's
    :class:`~lightning_par.dp.comm_hooks.HookAverage`)."""
    if average is None:
        return start_average_flat(tensors, group, size)()
    buckets = _flat_buckets(tensors)
    for i, (same, flat) in enumerate(buckets):
        average(flat, same, i == len(buckets) - 1)
        _copy_back(same, flat)


def start_average_flat(tensors: Iterable[torch.Tensor], group, size: int) -> Callable[[], None]:
    """:func:`average_flat_` started asynchronously: the all-reduces are in flight on return; the returned callable
    waits for them and writes the averages into ``tensors`` (which must not change in between)."""
    pending = [(same, flat, dist.all_reduce(flat, group=group, async_op=True)) for same, flat in _flat_buckets(tensors)]

    def finish() -> None:
        for same, flat, work in pending:
            work.wait()
            flat /= size
            _copy_back(same, flat)

    return finish


def _flat_buckets(tensors: Iterable[torch.Tensor]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    return [(same, torch.cat([t.reshape(-1) for t in same])) for same in buckets.values()]


def _copy_back(same: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for t in same:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
