"""Cut a batch into micro-batches along dimension 0 and combine their results, weighted by size.

Every tensor leaf whose first dimension is the batch size is split with ``torch.tensor_split`` (sizes
differ by at most one when the batch does not divide); every other leaf (a float, a string, a shared
table) is handed unchanged to each micro-batch.

Example::

    >>> import torch
    >>> parts = split_batch((torch.arange(5), "meta"), 2)
    >>> [(mb[0].tolist(), mb[1]) for mb in parts], batch_size((torch.arange(5), "meta"))
    ([([0, 1, 2], 'meta'), ([3, 4], 'meta')], 5)
    >>> round(weighted_mean([torch.tensor(1.0), torch.tensor(4.0)], [3, 2]).item(), 4)
    2.2
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from lightning_par._compat import tree_flatten, tree_unflatten


def batch_size(batch: Any) -> int:
    """The first dimension of the batch's first tensor leaf (0-dim tensors do not count)."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError(
        f"Pipeline parallelism splits the batch into micro-batches along dimension 0, but the batch "
        f"({type(batch).__name__}) holds no tensor with a batch dimension."
    )


def split_batch(batch: Any, microbatches: int) -> list[Any]:
    """``min(microbatches, batch size)`` micro-batches of (nearly) equal size."""
    size = batch_size(batch)
    n = max(min(microbatches, size), 1)
    leaves, spec = tree_flatten(batch)
    parts = [
        torch.tensor_split(leaf, n) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == size
        else [leaf] * n
        for leaf in leaves
    ]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(n)]


def check_microbatches(microbatches: int | None, per_device_batch: int | None) -> None:
    """Refuse a micro-batch count that does not divide the loader's batch size (checked when training starts).

    Example::

        >>> check_microbatches(4, 12)
        >>> check_microbatches(5, 12)
        Traceback (most recent call last):
        ...
        ValueError: `microbatches=5` must divide the per-device batch size (12). Choose a divisor of 12 (e.g. 4) or change the DataLoader's batch_size.
    """
    if microbatches is None or not isinstance(per_device_batch, int):
        return
    if per_device_batch % microbatches:
        divisor = max(d for d in range(1, min(microbatches, per_device_batch) + 1) if per_device_batch % d == 0)
        raise ValueError(
            f"`microbatches={microbatches}` must divide the per-device batch size ({per_device_batch}). Choose a "
            f"divisor of {per_device_batch} (e.g. {divisor}) or change the DataLoader's batch_size."
        )


def weighted_mean(values: Sequence[Any], sizes: Sequence[int]) -> Any:
    """Σ sizeᵢ·valueᵢ / Σ sizeᵢ for tensors or numbers (the batch mean of per-micro-batch means)."""
    total = float(sum(sizes))
    acc = None
    for v, n in zip(values, sizes):
        term = v * (n / total)
        acc = term if acc is None else acc + term
    return acc


def first_batch(loaders: Any) -> Any:
    """The first batch of a data loader, or of the first of several (a list or dict of loaders); ``None``
    without one."""
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    return None if loaders is None else next(iter(loaders), None)
