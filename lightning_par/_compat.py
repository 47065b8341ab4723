"""The private torch APIs the package relies on, imported here and nowhere else.

A torch release that moves or renames one of them then breaks this file only, with the name at hand.
Each function says what it wraps and what its callers do when the API is not there.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def local_shape_and_offset(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                           placements: Sequence) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape of a DTensor shard and its offset in the full tensor, for the device at ``coordinate``
    of a mesh of ``mesh_shape``, without a mesh or a process group.

    Wraps ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``, the plain-data core of
    the public ``compute_local_shape_and_global_offset`` (which needs a live ``DeviceMesh``), so the shard
    arithmetic is torch's own, uneven splits included.
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return _compute_local_shape_and_global_offset(tuple(global_shape), tuple(mesh_shape), list(coordinate),
                                                  list(placements))


def strided_shard_type() -> type:
    """``torch.distributed.tensor.placement_types._StridedShard``: a shard made of several strided blocks."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def checkpoint_offset(storage: torch.UntypedStorage) -> Optional[int]:
    """Where a storage's bytes start in the archive it was loaded from, or ``None`` if torch did not say.

    ``torch.load(..., map_location="meta")`` reads only an archive's pickle and records on each (meta)
    storage the offset of its data record in ``_checkpoint_offset``; callers fall back to slower, whole
    reads when it is missing.
    """
    offset = getattr(storage, "_checkpoint_offset", None)
    return offset if isinstance(offset, int) else None


def lightning_optimizers(module) -> list:
    """The optimizers the module's ``configure_optimizers`` returns, parsed as Lightning parses them (any of
    its return forms), without installing them anywhere.

    Wraps ``lightning.pytorch.core.optimizer._init_optimizers_and_lr_schedulers`` (private: the parser that
    ``Strategy.setup_optimizers`` calls); callers record from them which parameters each group holds.
    """
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    return _init_optimizers_and_lr_schedulers(module)[0]
