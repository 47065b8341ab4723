"""Tensors inside ``torch.save`` archives, read by byte range: a box of a tensor costs the box's bytes.

[Note: reading torch archives by byte range]
``torch.save`` writes a zip archive whose tensor storages are stored uncompressed, each one contiguous
record. ``torch.load(f, map_location="meta", weights_only=True)`` reads only the archive's pickle and
records on every storage where its record starts (see ``_compat.checkpoint_offset``); with the tensor's
shape, stride and storage offset that locates every element in the file. A region is then read with
``os.preadv`` into a buffer of the region's size: for the row-major tensors that state dicts hold, one
read per contiguous run (a block of rows is one read, a block of columns one read per row). This serves
torch state-dict files, Lightning ``.ckpt`` files and the chunks of a ``torch.distributed.checkpoint``
directory alike (each chunk is such an archive at a byte range of a ``.distcp`` file), and it was chosen
over ``torch.load(mmap=True)`` because the pages of a mapping stay resident (and count in a process's
resident memory) while the mapping lives, which for a loaded state dict is until every tensor is
dropped, and because reads we issue ourselves are counted exactly. Tensors saved non-contiguous
(rare: ``torch.save`` of a transposed view) are read as the span of storage their region covers.
Archives written on a machine of the other byte order are refused.
"""
from __future__ import annotations

import io
import itertools
import math
import os
import sys
import zipfile
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_par import _compat
from lightning_par.weights.regions import Region, element_offsets, region_shape


class ByteCounter:
    """Bytes a source read from its files: ``data`` (tensor elements) and ``overhead`` (headers, pickles,
    metadata read through this package's own file views)."""

    def __init__(self) -> None:
        self.data = 0
        self.overhead = 0


class FileView(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of an open file as a seekable read-only file, reading with
    ``os.preadv`` (no shared file position) and counting what it reads as overhead."""

    def __init__(self, fd: int, offset: int, length: int, counter: ByteCounter):
        super().__init__()
        self._fd, self._offset, self._length, self._counter, self._pos = fd, offset, length, counter, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        got = os.preadv(self._fd, [view[:n]], self._offset + self._pos) if n else 0
        self._pos += got
        self._counter.overhead += got
        return got


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's elements lie in a file: ``offset`` is the byte of its storage's first element
    (``None`` if torch did not report it), ``storage_offset`` and ``stride`` in elements."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    offset: Optional[int]
    contiguous: bool


def load_meta(fileobj, where: str, *, weights_only: bool = True) -> Any:
    """What the archive ``fileobj`` holds, every tensor on the meta device (only the pickle is read).

    ``where`` names the archive in errors. Refuses archives of the other byte order and, unless
    ``weights_only=False`` (only for an archive this process wrote itself), objects that ``weights_only=True``
    does not allow.
    """
    _check_byte_order(fileobj, where)
    fileobj.seek(0)
    try:
        return torch.load(fileobj, map_location="meta", weights_only=weights_only)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, ... depending on what is wrong
        raise ValueError(f"cannot read {where} as a torch.save archive with weights_only=True: {err}") from err


def _check_byte_order(fileobj, where: str) -> None:
    try:
        archive = zipfile.ZipFile(fileobj)
    except zipfile.BadZipFile as err:
        raise ValueError(f"{where} is not a zip-format torch.save archive (truncated, or saved with "
                         f"_use_new_zipfile_serialization=False?): {err}") from err
    with archive:
        for name in archive.namelist():
            if name.endswith("/byteorder"):
                order = archive.read(name).decode()
                if order != sys.byteorder:
                    raise ValueError(f"{where} was saved on a {order}-endian machine and this one is "
                                     f"{sys.byteorder}-endian; load and re-save it with torch.load/torch.save")


def stored(meta: torch.Tensor, base: int = 0) -> StoredTensor:
    """The location of the meta tensor ``meta`` loaded by :func:`load_meta` from an archive that starts at
    byte ``base`` of its file."""
    offset = _compat.checkpoint_offset(meta.untyped_storage())
    return StoredTensor(meta.dtype, tuple(meta.shape), tuple(meta.stride()), meta.storage_offset(),
                        None if offset is None else base + offset, meta.is_contiguous())


def read_region(fd: int, where: str, tensor: StoredTensor, region: Region, counter: ByteCounter) -> torch.Tensor:
    """The box ``region`` of ``tensor`` (``offset`` known) as a new contiguous CPU tensor, read from ``fd``."""
    out = torch.empty(region_shape(region), dtype=tensor.dtype)
    if out.numel() == 0:
        return out
    item = out.element_size()
    if tensor.contiguous:
        dst = bytes_of(out)
        run = run_length(region, tensor.shape)
        for i, start in enumerate(run_starts(region, tensor.shape, tensor.stride, run)):
            pread(fd, where, dst[i * run * item:(i + 1) * run * item],
                   tensor.offset + (tensor.storage_offset + start) * item, counter)
        return out
    low, high = element_offsets(region, tensor.stride)
    span = torch.empty(high - low + 1, dtype=tensor.dtype)
    pread(fd, where, bytes_of(span), tensor.offset + (tensor.storage_offset + low) * item, counter)
    return out.copy_(span.as_strided(region_shape(region), tensor.stride))


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` (any dtype), without a copy."""
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


def run_length(region: Region, shape: tuple[int, ...]) -> int:
    """Elements per contiguous run: the innermost partial dimension's length times the whole ones after it."""
    partial = [d for d, ((start, length), n) in enumerate(zip(region, shape)) if length != n]
    if not partial:
        return math.prod(shape)
    k = partial[-1]
    return region[k][1] * math.prod(shape[k + 1:])


def run_starts(region: Region, shape, stride, run: int):
    """Element offset of each contiguous run of ``region``, in row-major order."""
    partial = [d for d, ((start, length), n) in enumerate(zip(region, shape)) if length != n]
    if not partial:
        yield 0
        return
    k = partial[-1]
    first = region[k][0] * stride[k]
    for idx in itertools.product(*(range(s, s + n) for s, n in region[:k])):
        yield first + sum(i * s for i, s in zip(idx, stride))


def pread(fd: int, where: str, view: memoryview, offset: int, counter: ByteCounter) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ValueError(f"{where} ends before byte {offset + len(view)}: the file is truncated")
        got += n
    counter.data += len(view)
