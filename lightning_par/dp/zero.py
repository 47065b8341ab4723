"""ZeRO stages: their meanings and their check; stage 1 here (stages 2 and 3 are FSDP2, in
:mod:`lightning_par.dp.fsdp`).

Stage 1: shard the optimizer state of the user's optimizer over the data-parallel ranks.

[Note: wrapping the user's optimizer]
``configure_optimizers`` returns an ordinary optimizer (its LR schedulers already bound to it). We
build torch's ``ZeroRedundancyOptimizer`` over the same parameter groups, with the same class and the
groups' own hyper-parameters (so every group keeps its ``lr``, ``weight_decay``, ``initial_lr``...),
then point every scheduler at the wrapper: ZeRO copies its groups' hyper-parameters into the local
optimizer before each step, so a scheduler writing ``wrapper.param_groups[i]["lr"]`` keeps working.
Each rank keeps the state (Adam's moments) of about 1/N of the parameters, updates those, and
broadcasts them to the other ranks after the step. Checkpoints call ``consolidate_state_dict`` (a
collective, every rank) and save rank 0's consolidated state, which has the layout of the wrapped
optimizer's own ``state_dict`` and therefore loads into a plain optimizer on one device, or back into
a wrapper (which keeps only its shard).

[Note: ZeRO on the core's data axis]
``zero_stage`` has one meaning on every strategy: what the data-parallel replicas shard. On the hybrid
core (and so on the pipeline and tensor presets) the replicas are the ``dp`` axis of its mesh, and each
stage / tensor-parallel shard is sharded over its own replicas only:
- 1: the optimizer is wrapped in ``ZeroRedundancyOptimizer`` over the dp group, after the stage is
  installed (a stage's optimizer holds its own parameters; the meta copies of what it does not hold are
  left out). Its broadcast of updated parameters sends a tensor-parallel DTensor's local shard (the dp
  peers hold the same shard): ``shard_aware_zero_optimizer`` in ``_compat``.
- 2 / 3: FSDP2 ``fully_shard`` over ``mesh["dp"]``, per block of this rank's stage and then the module
  (the ends); tensor-parallel parameters are DTensors on ``mesh["tp"]``, so FSDP shards them 2-D. FSDP's
  reduce-scatter averages the gradients over the replicas, so the core's own replica average is skipped.
  With one stage Lightning runs the step through the root unit, as ``DataParallelStrategy`` does; with
  several, the schedule runner drives the units ([Note: FSDP under pipeline parallelism] in fsdp.py).
With one replica there is nothing to shard: every stage trains as stage 0.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any

from torch.optim import Optimizer

from lightning_par._compat import child_schedulers, shard_aware_zero_optimizer

ZERO_STAGES = {
    0: "replicas: every rank holds everything, DDP all-reduces the gradients",
    1: "optimizer state sharded (torch's ZeroRedundancyOptimizer)",
    2: "gradients reduce-scattered and sharded as well (FSDP2, parameters gathered once per step)",
    3: "parameters sharded as well (FSDP2, gathered per block in forward and again in backward)",
}


def validate_zero_stage(zero_stage: int) -> None:
    """Raise ``ValueError`` unless ``zero_stage`` is one of :data:`ZERO_STAGES`.

    Example:
        >>> validate_zero_stage(3)
        >>> validate_zero_stage(4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `zero_stage=4` is not a ZeRO stage. Choose 0 (replicas: ...), 1 (optimizer state sharded ...
    """
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
        stages = ", ".join(f"{k} ({v})" for k, v in ZERO_STAGES.items())
        raise ValueError(f"`zero_stage={zero_stage!r}` is not a ZeRO stage. Choose {stages}.")


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (``AdamW`` stores
    ``decoupled_weight_decay`` in ``defaults`` but does not take it)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def shard_optimizer(optimizer: Optimizer, process_group: Any = None, experts: Any = None) -> Optimizer:
    """A ``ZeroRedundancyOptimizer`` over ``optimizer``'s groups (see [Note: wrapping the user's optimizer]).
    Must be called on every rank of ``process_group``; an optimizer that is already sharded is returned.
    ``experts``: a :class:`lightning_par.experts.zero.ExpertShards`, the expert parameters partitioned apart
    ([Note: ZeRO-1 with expert parallelism])."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(f"{type(optimizer).__name__} already holds state; zero_stage=1 must shard it before the "
                         f"first step. Create the optimizer in `configure_optimizers` without stepping it.")
    # every key, params included; a pipeline stage's meta copies of what it does not hold are left out
    groups = [{**group, "params": [p for p in group["params"] if not p.is_meta]} for group in optimizer.param_groups]
    if experts is not None:
        from lightning_par._compat.experts import expert_zero_optimizer

        return expert_zero_optimizer(groups, experts=experts.experts, slots=experts.slots,
                                     slot_group=experts.slot_group, slot_ranks=experts.slot_ranks,
                                     optimizer_class=type(optimizer), process_group=process_group,
                                     **_constructor_defaults(optimizer))
    return shard_aware_zero_optimizer()(groups, optimizer_class=type(optimizer), process_group=process_group,
                                   **_constructor_defaults(optimizer))


def shard_optimizers(optimizers: list, scheduler_configs=(), process_group: Any = None, experts: Any = None) -> list:
    """:func:`shard_optimizer` for each of Lightning's ``optimizers``, with every LR scheduler of
    ``scheduler_configs`` pointed at its optimizer's wrapper; returns the wrappers (every rank calls it)."""
    sharded = [shard_optimizer(opt, process_group, experts) for opt in optimizers]
    by_id = {id(old): new for old, new in zip(optimizers, sharded)}
    for config in scheduler_configs:
        new = by_id.get(id(config.scheduler.optimizer))
        if new is not None:
            rebind_scheduler(config.scheduler, new)
    return sharded


def rebind_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Point ``scheduler`` (and the schedulers it drives) at ``optimizer``. ZeRO's optimizer class carries the
    mark torch's ``LRScheduler`` puts on ``step`` at construction (``shard_aware_zero_optimizer`` in
    ``_compat``), so the scheduler's "lr_scheduler.step() before optimizer.step()" check keeps working
    instead of warning about an overridden ``step``; nothing is changed on the optimizer object."""
    scheduler.optimizer = optimizer
    for child in child_schedulers(scheduler):
        rebind_scheduler(child, optimizer)


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer that holds this rank's state: ZeRO's local shard optimizer, else the optimizer.

    [Note: no import for an isinstance check]
    Importing ``torch.distributed.optim`` compiles its functional optimizers with TorchScript (~0.4 s of CPU in
    every rank that imports it); an optimizer can only be a ``ZeroRedundancyOptimizer`` once that module is
    imported, so a run without ZeRO-1 does not import it here."""
    zero = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", None)
    return optimizer.optim if zero is not None and isinstance(optimizer, zero) else optimizer


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of optimizer state (tensors) this rank holds: its shard under ZeRO, everything otherwise."""
    from lightning_par.comm import local_nbytes

    return sum(local_nbytes(v) for state in local_optimizer(optimizer).state.values() for v in state.values())

