"""The converter's writers: a ``torch.save`` archive, a safetensors file and a DCP directory, each reading
its tensors one at a time ([Note: streaming conversion] in :mod:`lightning_par.checkpoint.convert`).

[Note: torch's own archive, bytes filled in]
:func:`write_torch` has ``torch.save`` write the archive, so its records (``.format_version``,
``.storage_alignment``, ``byteorder``, ``.data/serialization_id``), the 64-byte alignment of every storage
and every dtype are torch's: each tensor is saved as a FakeTensor under
``torch.serialization.skip_data(materialize_fake_tensors=True)``, which writes every storage record's header
and leaves its bytes a hole (a sparse file). ``torch.load(map_location="meta")`` of that archive then says
where each storage starts (as the weights reader locates tensors), and each tensor is read from its source
and written at its offset. ``skip_data`` leaves the CRC-32 of those records 0; the writer computes each
while writing and puts it into the record's data descriptor and central directory entry, so zip tools
verify the file too.
"""
from __future__ import annotations

import json
import os
import struct
import zipfile
import zlib
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from lightning_par import _compat
from lightning_par.atomic import clear_temporary
from lightning_par.checkpoint import sharded
from lightning_par.weights import torchzip
from lightning_par.weights.sources import _SAFETENSORS_DTYPES, TensorInfo


class Lazy:
    """A tensor of a source, read when asked (:meth:`read`)."""

    def __init__(self, info: TensorInfo, read: Callable[[], torch.Tensor]):
        self.shape, self.dtype, self._read = tuple(info.shape), info.dtype, read

    def read(self) -> torch.Tensor:
        t = self._read()
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise ValueError(f"read a tensor of {tuple(t.shape)} {t.dtype}, listed as {self.shape} {self.dtype}")
        return t

    def __repr__(self) -> str:
        return f"Lazy({list(self.shape)}, {self.dtype})"


def tensor_leaves(x: Any) -> list:
    """The tensors and :class:`Lazy` of a nested dict / list / tuple, in the order pickle visits them."""
    if isinstance(x, (torch.Tensor, Lazy)):
        return [x]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in tensor_leaves(v)]
    if isinstance(x, (list, tuple)):
        return [leaf for v in x for leaf in tensor_leaves(v)]
    return []


def map_leaves(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``x`` (nested dicts / lists / tuples) with ``fn`` applied to every tensor and :class:`Lazy` in it."""
    if isinstance(x, (torch.Tensor, Lazy)):
        return fn(x)
    if isinstance(x, dict):
        items = ((k, map_leaves(v, fn)) for k, v in x.items())
        return OrderedDict(items) if isinstance(x, OrderedDict) else dict(items)
    if isinstance(x, (list, tuple)):
        return type(x)(map_leaves(v, fn) for v in x)
    return x


def read_all(x: Any) -> Any:
    """``x`` with every :class:`Lazy` read (for small metadata that is written whole)."""
    return map_leaves(x, lambda leaf: leaf.read() if isinstance(leaf, Lazy) else leaf)


def _as_lazy(x: Any) -> Any:
    """``x`` with every tensor (small ones of the metadata: RNG states) a :class:`Lazy` of itself."""
    return map_leaves(x, lambda t: Lazy(TensorInfo(tuple(t.shape), t.dtype), lambda c=t.detach().cpu(): c)
                      if isinstance(t, torch.Tensor) else t)


def write_torch(path: str, obj: Any, *, where: Optional[str] = None) -> None:
    """``torch.save(obj, path)`` with every :class:`Lazy` in ``obj`` read only when its bytes are written
    ([Note: torch's own archive, bytes filled in]). ``where`` names the file in errors (``path`` if None: a
    temporary name of it, say)."""
    where = where or path
    obj = _as_lazy(obj)
    fakes: dict[int, torch.Tensor] = {}  # one fake per Lazy: a Lazy named twice is one storage, as in torch.save

    def fake(lazy: Lazy) -> torch.Tensor:
        if id(lazy) not in fakes:
            fakes[id(lazy)] = _compat.fake_empty(lazy.shape, lazy.dtype)
        return fakes[id(lazy)]

    with open(path, "wb") as f, torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(map_leaves(obj, fake), f)
    with zipfile.ZipFile(path) as archive:
        records = sum("/data/" in name for name in archive.namelist())
    if records != len(fakes):  # a tensor inside an object map_leaves does not enter: its bytes would stay 0
        raise ValueError(f"Cannot write {where}: it would hold {records - len(fakes)} tensor(s) inside objects other "
                         f"than dicts, lists and tuples (a callback's or the module's custom state?), which the "
                         f"converter cannot stream. Convert with --weights-only, or load and torch.save it whole.")
    fakes.clear()
    with open(path, "r+b") as f:
        # the archive this process just wrote from the objects it holds: unpickling it imports nothing new
        saved = tensor_leaves(torchzip.load_meta(f, path, weights_only=False))
        lazies = tensor_leaves(obj)
        if len(saved) != len(lazies):
            raise RuntimeError(f"{path}: torch.save wrote {len(saved)} tensors for {len(lazies)}")
        crcs: dict[int, int] = {}
        for lazy, meta in zip(lazies, saved):
            where = torchzip.stored(meta)
            if (where.shape, where.dtype) != (lazy.shape, lazy.dtype) or where.offset is None:
                raise RuntimeError(f"{path}: torch.save wrote a {list(where.shape)} {where.dtype} tensor where "
                                   f"a {list(lazy.shape)} {lazy.dtype} one was expected")
            if where.offset not in crcs:
                tensor = lazy.read().contiguous()
                crcs[where.offset] = _write_at(f.fileno(), torchzip.bytes_of(tensor), where.offset)
                del tensor
        _set_crcs(f, crcs)


def _write_at(fd: int, data: memoryview, offset: int) -> int:
    """Write ``data`` at byte ``offset`` of ``fd``; returns its CRC-32."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    return zlib.crc32(data)


def _set_crcs(f, crcs: dict[int, int]) -> None:
    """Put ``crcs`` (data offset of a record -> CRC-32 of its bytes) into the archive ``f``'s data descriptors
    (or local headers) and central directory."""
    f.seek(0)
    with zipfile.ZipFile(f) as archive:
        infos, start = archive.infolist(), archive.start_dir
    fd = f.fileno()
    data_start = {}
    for info in infos:
        name_len, extra_len = struct.unpack("<HH", os.pread(fd, 4, info.header_offset + 26))
        data_start[info.filename] = info.header_offset + 30 + name_len + extra_len
    central = os.pread(fd, os.fstat(fd).st_size - start, start)
    pos = 0
    for info in infos:  # the central directory lists the records in infolist's order
        if central[pos:pos + 4] != b"PK\x01\x02":
            raise RuntimeError("unexpected central directory layout in a torch.save archive")
        name_len, extra_len, comment_len = struct.unpack("<HHH", central[pos + 28:pos + 34])
        crc = crcs.get(data_start[info.filename])
        if crc is not None:
            os.pwrite(fd, struct.pack("<I", crc), start + pos + 16)
            if info.flag_bits & 0x08:  # a data descriptor follows the data: [signature] crc sizes
                end = data_start[info.filename] + info.file_size
                signed = os.pread(fd, 4, end) == b"PK\x07\x08"
                os.pwrite(fd, struct.pack("<I", crc), end + (4 if signed else 0))
            else:
                os.pwrite(fd, struct.pack("<I", crc), info.header_offset + 14)
        pos += 46 + name_len + extra_len + comment_len


# safetensors' dtype codes: the weights reader's table, inverted (every dtype it reads, it writes)
_ST_CODES = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}


def write_safetensors(path: str, tensors: dict[str, Lazy], metadata: Optional[dict] = None) -> None:
    """A safetensors file of ``tensors``, its header written first and each tensor read when its bytes are."""
    header: dict[str, Any] = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    for name, lazy in tensors.items():
        if lazy.dtype not in _ST_CODES:
            raise ValueError(f"safetensors has no dtype for {name!r} ({lazy.dtype}); it takes "
                             f"{', '.join(sorted(str(d).replace('torch.', '') for d in _ST_CODES))}. "
                             f"Convert to a .ckpt instead.")
        size = int(torch.Size(lazy.shape).numel()) * lazy.dtype.itemsize
        header[name] = {"dtype": _ST_CODES[lazy.dtype], "shape": list(lazy.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for lazy in tensors.values():
            tensor = lazy.read().contiguous()
            f.write(torchzip.bytes_of(tensor))
            del tensor


def write_dcp(path: str, flat: dict[str, Any]) -> None:
    """A DCP directory of ``flat`` (keys as :func:`lightning_par.checkpoint.sharded.flatten` makes them), every
    :class:`Lazy` read when DCP writes its bytes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    lazies = {k: v for k, v in flat.items() if isinstance(v, Lazy)}
    state = {k: (torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, Lazy) else v)
             for k, v in flat.items()}

    class ReadingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            key = write_item.index.fqn
            if key in lazies:
                return lazies[key].read()
            return super().resolve_data(write_item)

    tmp = clear_temporary(path)
    # one data file per entry: torch's FileSystemWriter keeps every tensor of a file until the file is done
    dcp.save(state, storage_writer=FileSystemWriter(tmp, thread_count=1, single_file_per_rank=False),
             planner=ReadingPlanner(), no_dist=True)
    sharded.publish(tmp, path)


__all__ = ["Lazy", "map_leaves", "read_all", "tensor_leaves", "write_dcp", "write_safetensors", "write_torch"]
