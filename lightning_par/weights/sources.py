"""The weights files the reader opens, each listing its tensors without reading them and reading boxes
of one tensor at a time through a buffer of at most ``buffer_bytes``.

- :class:`SafetensorsSource`: one ``.safetensors`` file, or a Hugging Face sharded directory
  (``*.safetensors.index.json`` with a ``weight_map``), listed from its header and read by byte range
  (see [Note: reading safetensors by byte range]).
- :class:`TorchFileSource`: a ``torch.save`` state dict or a Lightning ``.ckpt`` (its ``state_dict``),
  read by byte range (see [Note: reading torch archives by byte range]).
- :class:`DCPSource`: a ``torch.distributed.checkpoint`` directory, reading only the saved chunks that
  overlap the box (see [Note: reading DCP chunks]).

:func:`open_source` picks one by what the path is.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from typing import Mapping, NamedTuple, Optional

import torch

from lightning_par.weights import torchzip
from lightning_par.weights.regions import Region, intersect, region_shape, region_slices, relative, split_region

DEFAULT_BUFFER_BYTES = 64 << 20


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


class Source:
    """A weights file or directory: ``tensors`` (name -> :class:`TensorInfo`), ``read`` of a box of one."""

    kind = "weights"

    def __init__(self, path, buffer_bytes: int = DEFAULT_BUFFER_BYTES):
        self.path = os.fspath(path)
        self.buffer_bytes = int(buffer_bytes)
        self.counter = torchzip.ByteCounter()
        self.tensors: dict[str, TensorInfo] = {}

    def read(self, name: str, region: Region, out: torch.Tensor) -> None:
        """Copy the box ``region`` of the tensor ``name`` into ``out`` (its shape; any dtype and device),
        piece by piece: no piece read at once is larger than ``buffer_bytes`` (or one element)."""
        itemsize = self.tensors[name].dtype.itemsize
        for piece in split_region(region, itemsize, self.buffer_bytes):
            if 0 in region_shape(piece):
                continue
            out[region_slices(relative(piece, region))].copy_(self._read_piece(name, piece))

    def _read_piece(self, name: str, piece: Region) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


# -- safetensors -------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)


class SafetensorsSource(Source):
    """``files``: tensor name -> the ``.safetensors`` file holding it (one file for a single-file source).

    [Note: reading safetensors by byte range]
    ``safe_open`` maps the whole file into one storage and ``get_slice(name)[box]`` hands back views of it: the
    pages a box touches stay resident while the view lives (a column box of a row-major tensor touches every
    page of it), and torch's allocator accounts the whole file's size to the mapping, so a meter of tensor bytes
    sees every rank hold the whole file for each read. The format is simple (an 8-byte header length, a JSON
    header with each tensor's ``data_offsets``, row-major data), so the header is read here and a box as a torch
    file's is (:func:`~lightning_par.weights.torchzip.read_region`): ``pread`` of its contiguous runs straight
    into the target when it is a contiguous CPU tensor of the file's dtype (no buffer at all), else into a
    buffer of one piece (``buffer_bytes`` at most) that is then copied; nothing is mapped.
    """

    kind = "safetensors"

    def __init__(self, path, files: Mapping[str, str], buffer_bytes: int = DEFAULT_BUFFER_BYTES):
        super().__init__(path, buffer_bytes)
        self._files = dict(files)
        self._stored: dict[str, torchzip.StoredTensor] = {}
        self._fds: dict[str, int] = {}
        wanted: dict[str, set] = {}
        for name, file in self._files.items():
            wanted.setdefault(file, set()).add(name)
        for file, names in wanted.items():
            if not os.path.isfile(file):
                raise ValueError(f"{self.path} names the file {file}, which does not exist")
            for name, shape, code, offset in _header(file, names):
                if code not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{file}: tensor {name!r} has the dtype {code}, which this reader does not know")
                self.tensors[name] = TensorInfo(shape, _SAFETENSORS_DTYPES[code])
                stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))  # row-major
                self._stored[name] = torchzip.StoredTensor(self.tensors[name].dtype, shape, stride, 0, offset, True)

    @classmethod
    def from_file(cls, path, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> "SafetensorsSource":
        path = os.fspath(path)
        return cls(path, {name: path for name, *_ in _header(path)}, buffer_bytes)

    @classmethod
    def from_index(cls, index_path, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> "SafetensorsSource":
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as err:
                raise ValueError(f"{index_path} is not a safetensors index (a JSON object with a "
                                 f"'weight_map'): {err}") from err
        folder = os.path.dirname(os.fspath(index_path))
        return cls(folder, {n: os.path.join(folder, file) for n, file in weight_map.items()}, buffer_bytes)

    def read(self, name: str, region: Region, out: torch.Tensor) -> None:
        """As :meth:`Source.read`; into a contiguous CPU ``out`` of the file's dtype the box's runs are read in
        place, without a buffer (a rank then holds its share and nothing beside it)."""
        tensor = self._stored[name]
        if out.device.type != "cpu" or out.dtype != tensor.dtype or not out.is_contiguous() or out.numel() == 0:
            return super().read(name, region, out)
        dst = torchzip.bytes_of(out.detach())
        run = torchzip.run_length(region, tensor.shape) * out.element_size()
        for i, start in enumerate(torchzip.run_starts(region, tensor.shape, tensor.stride, run // out.element_size())):
            torchzip.pread(self._fd(name), self._files[name], dst[i * run:(i + 1) * run],
                            tensor.offset + start * out.element_size(), self.counter)

    def _read_piece(self, name: str, piece: Region) -> torch.Tensor:
        return torchzip.read_region(self._fd(name), self._files[name], self._stored[name], piece, self.counter)

    def _fd(self, name: str) -> int:
        file = self._files[name]
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _header(file: str, names: Optional[set] = None) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, dtype code, byte offset of its data) of the tensors ``names`` (all if ``None``) of a
    safetensors file: an 8-byte little-endian header length, the JSON header, then the data, which each entry's
    ``data_offsets`` count from. Only the header is read; a header that does not describe the file is refused."""
    if sys.byteorder != "little":
        raise ValueError(f"{file}: safetensors data is little-endian and this machine is {sys.byteorder}-endian")
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            if length > size - 8:
                raise ValueError(f"its header length {length} exceeds the file's {size} bytes")
            header = json.loads(f.read(length))
        out = []
        for name, entry in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            shape, code = tuple(int(n) for n in entry["shape"]), entry["dtype"]
            begin, end = (int(n) for n in entry["data_offsets"])
            item = _SAFETENSORS_DTYPES[code].itemsize if code in _SAFETENSORS_DTYPES else None
            if end > size - 8 - length or (item is not None and end - begin != math.prod(shape) * item):
                raise ValueError(f"the data of {name!r} (bytes {begin}-{end} after the header, shape {shape}, "
                                 f"{code}) does not fit the file's {size} bytes")
            out.append((name, shape, code, 8 + length + begin))
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise ValueError(f"cannot read {file} as a safetensors file: {err}") from err
    if names is not None and set(names) - {n for n, *_ in out}:
        raise ValueError(f"{file} does not hold {sorted(set(names) - {n for n, *_ in out})[:10]}, which its index "
                         f"places there")
    return out


# -- torch.save files (state dicts, Lightning checkpoints) --------------------------------------------------

class TorchFileSource(Source):
    """A ``torch.save`` file: a state dict, or a Lightning checkpoint whose ``state_dict`` entry is one."""

    kind = "torch"

    def __init__(self, path, buffer_bytes: int = DEFAULT_BUFFER_BYTES):
        super().__init__(path, buffer_bytes)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._mmapped: Optional[dict] = None
        with torchzip.FileView(self._fd, 0, os.fstat(self._fd).st_size, self.counter) as view:
            state = _state_dict_of(torchzip.load_meta(view, self.path), self.path)
        self._stored = {}
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue  # e.g. a module's `_extra_state`: not a weight
            if type(value) is not torch.Tensor:
                raise ValueError(f"{self.path}: {name!r} is a {type(value).__name__}, not a plain tensor; save "
                                 f"full tensors (e.g. a consolidated checkpoint) to read it here")
            self._stored[name] = torchzip.stored(value)
            self.tensors[name] = TensorInfo(tuple(value.shape), value.dtype)

    def _read_piece(self, name: str, piece: Region) -> torch.Tensor:
        tensor = self._stored[name]
        if tensor.offset is not None:
            return torchzip.read_region(self._fd, self.path, tensor, piece, self.counter)
        # torch did not say where the storages lie: let it map the file, and touch only the box's pages
        if self._mmapped is None:
            self._mmapped = _state_dict_of(torch.load(self.path, mmap=True, weights_only=True), self.path)
        data = self._mmapped[name][region_slices(piece)]
        self.counter.data += data.numel() * data.element_size()
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._mmapped = None


def _state_dict_of(obj, path: str) -> Mapping:
    """The state dict in what a torch file holds: the object itself, or a Lightning checkpoint's ``state_dict``."""
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if isinstance(obj, Mapping) and any(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    keys = sorted(map(str, obj))[:10] if isinstance(obj, Mapping) else type(obj).__name__
    raise ValueError(f"{path} holds neither a state dict (name -> tensor) nor a Lightning checkpoint with a "
                     f"'state_dict' entry (found: {keys})")


# -- torch.distributed.checkpoint directories ----------------------------------------------------------------

class DCPSource(Source):
    """A ``torch.distributed.checkpoint`` directory; tensors under ``root`` (``state_dict``, as
    :func:`lightning_par.checkpoint.save_distributed` writes a module's) listed without the ``root.``.

    [Note: reading DCP chunks]
    The stock ``FileSystemReader`` answers a request for part of a tensor by loading each saved chunk it
    overlaps whole (``torch.load`` of the chunk's bytes) and narrowing it afterwards, so a rank whose
    shard cuts across another layout's chunks reads (and holds) those chunks entirely. Here the
    metadata's chunk boxes (``offsets``, ``sizes``) say which chunks overlap the box asked for, the
    storage data (relative path, byte offset, length) where each chunk's archive lies, and each chunk
    is an ordinary ``torch.save`` archive (the default ``SerializationFormat.TORCH_SAVE``), read by byte
    range like a torch file: only the overlap's bytes, plus the chunk's small zip directory and pickle.
    Chunks written with a storage transform (``transform_descriptors``: compression) or in another
    serialization format are refused with the tensor's name, not decoded half-way.
    """

    kind = "dcp"

    def __init__(self, path, root: Optional[str] = "state_dict", buffer_bytes: int = DEFAULT_BUFFER_BYTES):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        super().__init__(path, buffer_bytes)
        metadata = FileSystemReader(self.path).read_metadata()
        prefix = f"{root}." if root else ""
        storage: dict[str, dict[tuple, object]] = {}
        for index, info in metadata.storage_data.items():
            storage.setdefault(index.fqn, {})[tuple(index.offset or ())] = info
        self._chunks: dict[str, list[tuple[Region, object]]] = {}
        for fqn, entry in metadata.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata) or not fqn.startswith(prefix):
                continue
            name = fqn[len(prefix):]
            self.tensors[name] = TensorInfo(tuple(entry.size), entry.properties.dtype)
            self._chunks[name] = [(tuple(zip(c.offsets, c.sizes)), storage[fqn][tuple(c.offsets)])
                                  for c in entry.chunks]
        if not self.tensors:
            roots = sorted({fqn.split(".")[0] for fqn in metadata.state_dict_metadata})[:10]
            raise ValueError(f"{self.path} holds no tensors under {root!r} (its top-level entries: {roots}); "
                             f"pass the entry that holds the weights as dcp_root (None for every tensor)")
        self._fds: dict[str, int] = {}
        self._stored: dict[tuple[str, Region], torchzip.StoredTensor] = {}

    def _read_piece(self, name: str, piece: Region) -> torch.Tensor:
        out = torch.empty(region_shape(piece), dtype=self.tensors[name].dtype)
        covered = 0
        for box, info in self._chunks[name]:
            overlap = intersect(piece, box)
            if overlap is None:
                continue
            data = self._read_chunk(name, box, info, relative(overlap, box))
            out[region_slices(relative(overlap, piece))].copy_(data)
            covered += data.numel()
        if covered != out.numel():
            raise ValueError(f"{self.path}: the saved chunks of {name!r} cover {covered} of the {out.numel()} "
                             f"elements of the box {piece}; the checkpoint's metadata is inconsistent")
        return out

    def _read_chunk(self, name: str, box: Region, info, region: Region) -> torch.Tensor:
        where = f"{self.path} ({name!r}, chunk at {tuple(s for s, _ in box)} in {info.relative_path})"
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{where} was saved with the storage transforms {list(info.transform_descriptors)}, "
                             f"which this reader does not decode; convert it with torch.distributed.checkpoint."
                             f"format_utils.dcp_to_torch_save, or save it without transforms")
        fd = self._file(info.relative_path)
        key = (name, box)
        if key not in self._stored:
            view = torchzip.FileView(fd, info.offset, info.length, self.counter)
            if view.read(4) != b"PK\x03\x04":
                raise ValueError(f"{where} is not a torch.save archive (the default SerializationFormat."
                                 f"TORCH_SAVE); this reader does not read other formats")
            meta = torchzip.load_meta(view, where)
            if not isinstance(meta, torch.Tensor) or region_shape(box) != tuple(meta.shape):
                raise ValueError(f"{where} does not hold a tensor of the chunk's shape {region_shape(box)}")
            self._stored[key] = torchzip.stored(meta, base=info.offset)
        tensor = self._stored[key]
        if tensor.offset is not None:
            return torchzip.read_region(fd, where, tensor, region, self.counter)
        # torch did not say where the chunk's storage lies: read the whole chunk, as the stock reader does
        with torchzip.FileView(fd, info.offset, info.length, self.counter) as view:
            whole = torch.load(view, map_location="cpu", weights_only=True)
        self.counter.data += whole.numel() * whole.element_size()
        return whole[region_slices(region)]

    def _file(self, relative_path: str) -> int:
        if relative_path not in self._fds:
            self._fds[relative_path] = os.open(os.path.join(self.path, relative_path), os.O_RDONLY)
        return self._fds[relative_path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# -- choosing a source ---------------------------------------------------------------------------------------

def open_source(path, *, dcp_root: Optional[str] = "state_dict", buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> Source:
    """The :class:`Source` for ``path``: a ``.safetensors`` file; a directory with a ``.metadata`` file
    (DCP), a ``*.safetensors.index.json`` (Hugging Face shards) or a single ``model.safetensors``; an index
    file itself; any other
    file is read as a ``torch.save`` file (state dict or Lightning checkpoint)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, ".metadata")):
            return DCPSource(path, dcp_root, buffer_bytes)
        indexes = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if len(indexes) == 1:
            return SafetensorsSource.from_index(os.path.join(path, indexes[0]), buffer_bytes)
        if len(indexes) > 1:
            raise ValueError(f"{path} holds several safetensors indexes {indexes}; name the one to read")
        if os.path.isfile(os.path.join(path, "model.safetensors")):
            return SafetensorsSource.from_file(os.path.join(path, "model.safetensors"), buffer_bytes)
        raise ValueError(f"{path} is a directory without a torch.distributed.checkpoint '.metadata', a "
                         f"'*.safetensors.index.json' or a 'model.safetensors' (it holds "
                         f"{sorted(os.listdir(path))[:10]})")
    if not os.path.isfile(path):
        raise ValueError(f"the weights path {path} does not exist")
    if path.endswith(".safetensors"):
        return SafetensorsSource.from_file(path, buffer_bytes)
    if path.endswith(".safetensors.index.json"):
        return SafetensorsSource.from_index(path, buffer_bytes)
    return TorchFileSource(path, buffer_bytes)
