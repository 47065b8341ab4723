"""Non-finite losses and gradients: found on the rank that holds them, agreed on by every rank, and then
either stopped on (``nonfinite="error"``, the default) or skipped (``nonfinite="skip"``).

[Note: non-finite values]
A NaN or an infinity in the loss or in one gradient poisons every weight it reaches at the optimizer step,
and under model parallelism only the rank that holds the value knows it: a pipeline's loss exists on its
last stage, a gradient on the stage (or the tensor-parallel shard) that holds its parameter. So at every
optimizer step each rank checks what it holds (its loss on the last pipeline stage, the gradients of the
stepped optimizer's parameters after the strategy's reductions) and the ranks agree with one all-reduce
(MAX) of a one-element flag over the world, bounded by the strategy's timeout like every collective. Only
on a step where a flag is up do the ranks gather what each found (``all_gather_object``), so that every
rank raises the same message, or skips the same step: a rank that stepped while another did not would
leave the replicas apart for good. Under ``16-mixed`` the ``GradScaler`` already finds inf / NaN gradients
(the scaled loss overflows by design while the scale is searched) and skips those steps itself, so only
the loss is checked then. With ``accumulate_grad_batches=k`` the check runs at the optimizer step: the
gradients of all k batches, the loss of the last one (a non-finite loss earlier reaches the gradients).

Example::

    >>> import torch
    >>> find_nonfinite(torch.tensor(float("nan")), [("w", torch.ones(2)), ("b", torch.tensor([1.0, float("-inf")]))])
    ['loss is nan', 'gradient of `b` is -inf']
    >>> find_nonfinite(torch.tensor(1.0), [("w", torch.ones(2))])
    []
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

MODES = ("error", "skip")


class NonFiniteError(FloatingPointError):
    """A loss or gradient was NaN or infinite at an optimizer step (``nonfinite="error"``)."""


def check_nonfinite(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"`nonfinite={mode!r}` must be 'error' (stop at the first NaN / inf loss or gradient, "
                         f"naming it) or 'skip' (skip that optimizer step on every rank).")
    return mode


def kind_of(t: torch.Tensor) -> Optional[str]:
    """``"nan"``, ``"inf"`` or ``"-inf"`` for a tensor holding such a value (NaN first), else ``None``.

    Example::

        >>> kind_of(torch.tensor([1.0, float("inf")])), kind_of(torch.zeros(3))
        ('inf', None)
    """
    if t.is_floating_point() or t.is_complex():
        if bool(torch.isfinite(t).all()):
            return None
        if bool(torch.isnan(t).any()):
            return "nan"
        return "inf" if bool((t == float("inf")).any()) else "-inf"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard (the other ranks check theirs)
    return (to_local() if to_local is not None else t).detach()


def find_nonfinite(loss: Optional[torch.Tensor], named_grads: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """What is non-finite here: the loss (``None``: not checked), and the first gradient in ``named_grads``'s
    order (the module's parameter order) that holds a NaN or an infinity."""
    found = []
    if isinstance(loss, torch.Tensor):
        kind = kind_of(_local(loss))
        if kind is not None:
            found.append(f"loss is {kind}")
    named = [(n, _local(g)) for n, g in named_grads if g is not None]
    if named and not _all_finite([g for _, g in named]):
        bad = torch.stack([~torch.isfinite(g).all() for _, g in named])
        if bool(bad.any()):
            name, g = named[int(bad.nonzero()[0])]
            found.append(f"gradient of `{name}` is {kind_of(g)}")
    return found


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite, decided by one norm over all of them ([Note: one norm
    for a healthy step]).

    [Note: one norm for a healthy step]
    A finite 2-norm means every square, so every element, is finite: NaN and infinities carry through the
    sum. So a healthy step costs one multi-tensor norm (``clip_grad``'s ``get_total_norm``: one fused kernel per
    device and dtype, a single pass with no temporary) and one synchronisation, where testing each gradient with
    ``isfinite`` writes a boolean copy of all of them (about 7x the time on a 2-core CPU for a 6 M-parameter
    stage, measured). A norm that is not finite is only a suspicion (finite values of about 1e19 and up
    overflow their squares): :func:`find_nonfinite` then tests each gradient exactly, so a finding is never
    the norm's."""
    norm = torch.nn.utils.get_total_norm(tensors, 2.0, foreach=None)
    return bool(torch.isfinite(norm))


def agree(found: list[str], *, where: str, device: torch.device) -> list[str]:
    """Every rank's findings (each prefixed by its ``where``), the same list on every rank; empty when every
    rank found nothing. Collective over the world when one exists ([Note: non-finite values])."""
    mine = [f"{text} on {where}" for text in found]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    flag = torch.tensor([float(bool(found))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return []
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [text for rank_found in everyone for text in rank_found]


def message(findings: list[str], *, step: int, epoch: int, mode: str) -> str:
    """The error (``mode="error"``) or warning (``"skip"``) for a step whose values were not finite.

    Example::

        >>> message(["loss is nan on rank 1 (pipeline stage 1 of 2)"], step=3, epoch=0, mode="skip")
        'Non-finite values at global step 3 (epoch 0): loss is nan on rank 1 (pipeline stage 1 of 2). The optimizer step was skipped on every rank (nonfinite="skip").'
    """
    head = f"Non-finite values at global step {step} (epoch {epoch}): {'; '.join(findings)}."
    if mode == "skip":
        return f"{head} The optimizer step was skipped on every rank (nonfinite=\"skip\")."
    return (f"{head} Training stops (nonfinite=\"error\"). Look for a learning rate too high, a log or a division "
            f"by zero in the loss, or bad input data; the strategy's `nonfinite=\"skip\"` skips such steps on "
            f"every rank instead.")
