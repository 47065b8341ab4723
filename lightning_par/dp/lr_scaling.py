"""Learning-rate scaling with the global batch: the arithmetic, finding the batch size, applying it.

Going from one device to ``N`` multiplies the global batch by ``N``; the usual advice is to scale the
learning rate the user tuned on one device by the same ratio (``"linear"``, Goyal et al. 2017) or by
its square root (``"sqrt"``, for adaptive optimizers). The ratio is ``global batch / reference batch``.

[Note: scaling an optimizer that a scheduler drives]
An LR scheduler remembers the learning rates it found at construction in ``base_lrs`` (and in each
group's ``"initial_lr"``) and recomputes ``lr = base_lr * f(step)`` at every step, so scaling
``group["lr"]`` alone is undone at the first ``scheduler.step()``. :func:`apply_lr_scale` multiplies
every absolute learning rate it knows of: the groups' ``lr``, ``initial_lr``, ``max_lr`` and
``min_lr`` (OneCycleLR), the schedulers' ``base_lrs``, ``max_lrs`` (CyclicLR) and last computed
``_last_lr``, recursively through SequentialLR / ChainedScheduler. Each group records the factor it
carries under ``"lr_scale_factor"``, so a run resumed from a checkpoint (whose restored learning
rates are already scaled) is rescaled only by the ratio of the new factor to the old one.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

from lightning_par._compat import child_schedulers

LR_SCALINGS = ("none", "linear", "sqrt")
GROUP_KEY = "lr_scale_factor"
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULER_LR_ATTRS = ("base_lrs", "max_lrs", "_last_lr")


def validate_lr_scaling(lr_scaling: str, reference_batch_size: int | None) -> None:
    """Raise ``ValueError`` for an unknown rule or an unusable reference batch size.

    Example:
        >>> validate_lr_scaling("linear", 256)
        >>> validate_lr_scaling("cubic", None)
        Traceback (most recent call last):
        ...
        ValueError: `lr_scaling='cubic'` is not a known rule. Choose one of 'none', 'linear', 'sqrt'.
    """
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(f"`lr_scaling={lr_scaling!r}` is not a known rule. "
                         f"Choose one of {', '.join(repr(s) for s in LR_SCALINGS)}.")
    if reference_batch_size is not None and (
        isinstance(reference_batch_size, bool) or not isinstance(reference_batch_size, int)
        or reference_batch_size < 1
    ):
        raise ValueError(f"`reference_batch_size={reference_batch_size!r}` must be a positive integer (the global "
                         f"batch size the configured learning rates were tuned for) or None (the batch one "
                         f"device sees per optimizer step: per-device batch x accumulate_grad_batches).")


def global_batch_size(per_device_batch: int, world_size: int, accumulate_grad_batches: int) -> int:
    """Samples per optimizer step over all replicas.

    Example:
        >>> global_batch_size(8, 4, 2)
        64
    """
    return per_device_batch * world_size * accumulate_grad_batches


def lr_scale_factor(lr_scaling: str, global_batch: int, reference_batch: int) -> float:
    """The factor the configured learning rates are multiplied by.

    Example:
        >>> lr_scale_factor("linear", 64, 16)
        4.0
        >>> lr_scale_factor("sqrt", 64, 16)
        2.0
        >>> lr_scale_factor("none", 64, 16)
        1.0
    """
    validate_lr_scaling(lr_scaling, reference_batch)
    if lr_scaling == "none":
        return 1.0
    ratio = global_batch / reference_batch
    return ratio if lr_scaling == "linear" else math.sqrt(ratio)


def find_batch_size(loader: Any) -> int | None:
    """The per-device batch size of a train dataloader, or ``None`` if it does not say.

    Accepts a ``DataLoader`` (its ``batch_size``, else its batch sampler's ``batch_size``) or a list /
    tuple / dict of them (Lightning's combined loaders), whose batch sizes are summed, as Lightning's
    ``max_size_cycle`` mode trains on one batch of each per step.
    """
    if isinstance(loader, dict):
        loader = list(loader.values())
    if isinstance(loader, (list, tuple)):
        sizes = [find_batch_size(x) for x in loader]
        return None if not sizes or None in sizes else sum(sizes)
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def resolve_lr_scale_factor(*, lr_scaling: str, reference_batch_size: int | None, per_device_batch: int | None,
                            world_size: int, accumulate_grad_batches: int) -> float:
    """The factor for a run, raising ``ValueError`` (with the fix) when the batch size is unknown.

    ``reference_batch_size=None`` means the batch one device sees per optimizer step
    (``per_device_batch × accumulate_grad_batches``), so the factor is ``world_size`` (linear) or
    ``sqrt(world_size)``.

    Example:
        >>> resolve_lr_scale_factor(lr_scaling="linear", reference_batch_size=None, per_device_batch=8,
        ...                         world_size=4, accumulate_grad_batches=2)
        4.0
    """
    validate_lr_scaling(lr_scaling, reference_batch_size)
    if lr_scaling == "none":
        return 1.0
    if per_device_batch is None:
        raise ValueError(
            f"`lr_scaling={lr_scaling!r}` needs the per-device batch size, but the train dataloader does not "
            f"state one (its `batch_size` and its batch sampler's `batch_size` are None; "
            f"reference_batch_size={reference_batch_size!r}). Give the DataLoader a `batch_size`, or set "
            f"`lr_scaling='none'` and scale the learning rate in `configure_optimizers` yourself."
        )
    global_batch = global_batch_size(per_device_batch, world_size, accumulate_grad_batches)
    reference = reference_batch_size or per_device_batch * accumulate_grad_batches
    return lr_scale_factor(lr_scaling, global_batch, reference)


def apply_lr_scale(optimizers: Iterable[Any], schedulers: Iterable[Any], factor: float) -> None:
    """Bring every learning rate of ``optimizers`` and ``schedulers`` to ``factor`` × the configured one
    (see [Note: scaling an optimizer that a scheduler drives]). Idempotent for an unchanged factor."""
    ratios = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            ratio = factor / group.get(GROUP_KEY, 1.0)
            ratios[id(optimizer)] = ratio  # groups of one optimizer always carry the same factor
            if ratio != 1.0:
                for key in _GROUP_LR_KEYS:
                    if isinstance(group.get(key), (int, float)) and not isinstance(group.get(key), bool):
                        group[key] = group[key] * ratio
            group[GROUP_KEY] = factor
    for scheduler in schedulers:
        for sched in _flatten(scheduler):
            ratio = ratios.get(id(getattr(sched, "optimizer", None)), 1.0)
            if ratio == 1.0:
                continue
            for attr in _SCHEDULER_LR_ATTRS:
                values = getattr(sched, attr, None)
                if isinstance(values, list):
                    setattr(sched, attr, [v * ratio for v in values])


def _flatten(scheduler: Any) -> list[Any]:
    """A scheduler and the schedulers it drives (SequentialLR, ChainedScheduler)."""
    out = [scheduler]
    for child in child_schedulers(scheduler):
        out.extend(_flatten(child))
    return out
