"""Boxes of a tensor: which part of a full tensor a rank's shard covers, and how to read it piece by piece.

A region is a tuple with one ``(start, length)`` pair per dimension of the full tensor. It is what a
DTensor ``Shard(d)`` local shard, FSDP's dim-0 chunk or a pipeline stage's whole tensor needs, and it
converts to the ``tuple[slice, ...]`` that indexes the full tensor.

Example:
    >>> from torch.distributed.tensor import Shard
    >>> shard_region((10, 4), [Shard(0)], mesh_shape=(4,), coordinate=(3,))  # torch.chunk sizes 3, 3, 3, 1
    ((9, 1), (0, 4))
    >>> region_slices(as_region((1, 2, 2), (10, 4)))                           # (dim, start, length)
    (slice(0, 10, None), slice(2, 4, None))
"""
from __future__ import annotations

import math
from typing import Iterator, Optional, Sequence, Union

from lightning_par import _compat

Region = tuple[tuple[int, int], ...]
Index = Union[None, Region, tuple[slice, ...], tuple[int, int, int]]


def full_region(shape: Sequence[int]) -> Region:
    return tuple((0, int(n)) for n in shape)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(length for _, length in region)


def region_slices(region: Region) -> tuple[slice, ...]:
    return tuple(slice(start, start + length) for start, length in region)


def as_region(index: Index, shape: Sequence[int]) -> Region:
    """``index`` as a region of a tensor of ``shape``.

    ``index`` is ``None`` (the whole tensor), a region, a tuple of step-1 slices (trailing dimensions
    whole) or ``(dim, start, length)``. Anything else, or a box outside ``shape``, is a ``ValueError``.

    Example:
        >>> as_region((slice(None, 2),), (5, 3))
        ((0, 2), (0, 3))
        >>> as_region((0, 4, 1), (5, 3))
        ((4, 1), (0, 3))
    """
    shape = tuple(int(n) for n in shape)
    if index is None:
        return full_region(shape)
    index = tuple(index)
    if len(index) == 3 and all(isinstance(i, int) for i in index):
        dim, start, length = index
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"(dim, start, length)={index}: dim {dim} is not a dimension of a tensor of shape {shape}")
        region = list(full_region(shape))
        region[dim % len(shape)] = (start, length)
        return _checked(tuple(region), shape, index)
    if index and all(isinstance(i, tuple) and len(i) == 2 for i in index):
        if len(index) != len(shape):
            raise ValueError(f"region {index} has {len(index)} dimensions, the tensor {len(shape)} (shape {shape})")
        return _checked(tuple((int(s), int(n)) for s, n in index), shape, index)
    if all(isinstance(i, slice) for i in index):
        if len(index) > len(shape):
            raise ValueError(f"{len(index)} slices for a tensor of {len(shape)} dimensions (shape {shape})")
        region = []
        for sl, n in zip(index + (slice(None),) * (len(shape) - len(index)), shape):
            start, stop, step = sl.indices(n)
            if step != 1:
                raise ValueError(f"slice {sl} has step {step}: only contiguous boxes (step 1) can be read")
            region.append((start, max(0, stop - start)))
        return tuple(region)
    raise ValueError(f"cannot read the index {index!r}: give None, a tuple of slices, (dim, start, length) or "
                     f"a region of (start, length) pairs")


def _checked(region: Region, shape: tuple[int, ...], given) -> Region:
    for (start, length), n in zip(region, shape):
        if start < 0 or length < 0 or start + length > n:
            raise ValueError(f"the box {given} does not lie inside a tensor of shape {shape}")
    return region


def shard_region(global_shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int],
                 coordinate: Sequence[int]) -> Region:
    """The region of a full tensor of ``global_shape`` that the device at ``coordinate`` of a mesh of
    ``mesh_shape`` holds under ``placements`` (``Shard``/``Replicate``/``Partial``, one per mesh axis), by
    torch's own shard arithmetic (uneven splits as ``torch.chunk``: the last shards smaller, maybe empty).
    FSDP2's dim-0 chunk of rank ``r`` of ``n`` is ``shard_region(shape, [Shard(0)], (n,), (r,))``.

    Example:
        >>> from torch.distributed.tensor import Replicate, Shard
        >>> shard_region((6, 5), [Shard(1)], (2,), (1,))
        ((0, 6), (3, 2))
        >>> shard_region((6, 5), [Shard(0), Shard(1)], (2, 2), (1, 0))
        ((3, 3), (0, 3))
        >>> shard_region((6, 5), [Replicate()], (2,), (1,))
        ((0, 6), (0, 5))
    """
    strided = _compat.strided_shard_type()
    nested = _fsdp_over_tensor_parallel(global_shape, placements, mesh_shape, coordinate, strided)
    if nested is not None:
        return nested
    if any(isinstance(p, strided) for p in placements):
        raise ValueError(f"placements {tuple(placements)} include a strided shard: its local tensor is several "
                         f"blocks of the full tensor, not one region; read the full tensor's blocks one by one")
    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise ValueError(f"placements {tuple(placements)}, mesh shape {tuple(mesh_shape)} and coordinate "
                         f"{tuple(coordinate)} must have one entry per mesh axis")
    shape, offset = _compat.local_shape_and_offset(global_shape, mesh_shape, coordinate, placements)
    return tuple((int(o), int(n)) for o, n in zip(offset, shape))  # an empty shard starts at the dim's end


def _fsdp_over_tensor_parallel(global_shape, placements, mesh_shape, coordinate, strided) -> Optional[Region]:
    """FSDP2 over a tensor-parallel shard of the same dim: placements ``(_StridedShard(d, sf=B), Shard(d))`` on a
    mesh ``(A, B)`` mean "split dim d in B (tensor parallel), then each part in A (FSDP)": one region, the
    ``a``-th chunk of the ``b``-th chunk. Any other strided layout: ``None``.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> S = _compat.strided_shard_type()
        >>> _fsdp_over_tensor_parallel((8, 3), [S(0, split_factor=2), Shard(0)], (2, 2), (1, 0), S)
        ((2, 2), (0, 3))
    """
    if len(placements) != 2 or len(mesh_shape) != 2 or not isinstance(placements[0], strided):
        return None
    outer, inner = placements
    if not (inner.is_shard() and not isinstance(inner, strided) and inner.dim == outer.dim
            and outer.split_factor == mesh_shape[1]):
        return None
    d = outer.dim
    (start, length), = [shard_region((global_shape[d],), [inner], (mesh_shape[1],), (coordinate[1],))[0]]
    (sub, count), = [shard_region((length,), [type(inner)(0)], (mesh_shape[0],), (coordinate[0],))[0]]
    return tuple((start + sub, count) if i == d else (0, n) for i, n in enumerate(global_shape))


def dtensor_region(tensor) -> Region:
    """The region of the full tensor that this rank's local shard of the DTensor ``tensor`` covers."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the DTensor's device mesh: it holds no shard to read")
    return shard_region(tuple(tensor.shape), tensor.placements, tuple(mesh.shape), coordinate)


def intersect(a: Region, b: Region) -> Optional[Region]:
    """The common box of ``a`` and ``b``, or ``None`` if they do not overlap."""
    out = []
    for (sa, la), (sb, lb) in zip(a, b):
        start, stop = max(sa, sb), min(sa + la, sb + lb)
        if stop <= start:
            return None
        out.append((start, stop - start))
    return tuple(out)


def relative(inner: Region, outer: Region) -> Region:
    """``inner`` in the coordinates of ``outer``'s first corner."""
    return tuple((si - so, li) for (si, li), (so, _) in zip(inner, outer))


def split_region(region: Region, itemsize: int, limit: int) -> Iterator[Region]:
    """``region`` cut, in row-major order, into boxes of at most ``limit`` bytes each (a box of one element
    when even that is larger): the pieces a bounded buffer reads one after the other.

    Example:
        >>> list(split_region(((0, 4), (0, 3)), itemsize=4, limit=24))   # two rows of 12 bytes a piece
        [((0, 2), (0, 3)), ((2, 2), (0, 3))]
        >>> list(split_region(((0, 1), (0, 3)), itemsize=4, limit=8))
        [((0, 1), (0, 2)), ((0, 1), (2, 1))]
    """
    yield from _split(tuple(region), itemsize, max(int(limit), 1), 0)


def _split(region: Region, itemsize: int, limit: int, dim: int) -> Iterator[Region]:
    if math.prod(region_shape(region)) * itemsize <= limit or dim == len(region):
        yield region
        return
    start, length = region[dim]
    inner = math.prod(region_shape(region[dim + 1:])) * itemsize
    step = limit // inner
    if step >= 1:
        for s in range(0, length, step):
            yield region[:dim] + ((start + s, min(step, length - s)),) + region[dim + 1:]
    else:
        for s in range(length):
            yield from _split(region[:dim] + ((start + s, 1),) + region[dim + 1:], itemsize, limit, dim + 1)


def element_offsets(region: Region, stride: Sequence[int]) -> tuple[int, int]:
    """The lowest and highest element offsets (from the tensor's first element) that ``region`` touches in
    a tensor of ``stride`` (non-negative strides)."""
    low = sum(start * s for (start, _), s in zip(region, stride))
    high = low + sum((length - 1) * s for (_, length), s in zip(region, stride))
    return low, high

