"""Converting and inspecting checkpoints one tensor at a time (``lightning-par-checkpoint``).

    convert("ckpt/epoch=0-step=2.ckpt", "one.ckpt")             # DCP directory -> plain Lightning file
    convert("one.ckpt", "model.safetensors", strip_prefix="net.")  # weights only, names as HF takes them
    print(describe("ckpt/epoch=0-step=2.ckpt"))

[Note: streaming conversion]
A source lists its tensors without reading them (DCP's ``.metadata``; a ``.ckpt``'s pickle, loaded with every
storage on the meta device; a safetensors header) and reads one whole tensor at a time through the weights
reader (:mod:`lightning_par.weights`), chunk by chunk. A writer takes the list first and then the tensors in
order: safetensors and the ``.ckpt`` zip archive (the layout ``torch.save`` writes: ``data.pkl`` naming one
storage record per tensor, then the records) have their headers written from the list, and a DCP directory
is written by DCP's ``FileSystemWriter`` with a planner that reads each tensor when DCP asks for its bytes,
one data file per entry (the writer holds a file's tensors until the file is complete).
So a conversion holds at most one tensor (plus the reader's bounded buffer) besides the small metadata.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from lightning_par.atomic import clear_temporary, write_file
from lightning_par.checkpoint import sharded
from lightning_par.checkpoint.optim import to_positional
from lightning_par.weights import torchzip
from lightning_par.weights.regions import full_region
from lightning_par.weights.sources import DCPSource, SafetensorsSource, TensorInfo


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


class Checkpoint:
    """What a source holds: ``meta`` (Lightning's checkpoint without module and optimizer states), ``model``
    (name -> :class:`Lazy`), ``optimizers`` (named: ``{"state": {name: {key: Lazy | value}}, "param_groups":
    [... "params": names]}``, or None where only positions are known) and ``kind``."""

    def __init__(self, path: str, kind: str, meta: dict, model: dict, optimizers: list, positional: list,
                 close: Callable[[], None] = lambda: None):
        self.path, self.kind, self.meta, self.model = path, kind, meta, model
        self.optimizers, self.positional = optimizers, positional
        self.close = close  # the source's open files

    def named_optimizers(self) -> list[dict]:
        if any(o is None for o in self.optimizers):
            raise ValueError(f"The optimizer states in {self.path} are numbered by position and the file does not "
                             f"say which parameter each position is (a plain Lightning checkpoint); converting "
                             f"them needs the names. Convert with --weights-only, or resume from the file itself "
                             f"(every lightning_par strategy reads it).")
        return self.optimizers


def open_checkpoint(path) -> Checkpoint:
    path = os.fspath(path)
    if sharded.is_sharded(path):
        return _open_dcp(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is neither a checkpoint file nor a torch.distributed.checkpoint directory.")
    if path.endswith(".safetensors"):
        return _open_safetensors(path)
    return _open_torch(path)


def _open_dcp(path: str) -> Checkpoint:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = sharded.read_meta(path)
    source = DCPSource(path, root=None)
    entries = sharded.saved_entries(path)

    def lazy(key):
        info = source.tensors[key]

        def read():
            out = torch.empty(info.shape, dtype=info.dtype)
            source.read(key, full_region(info.shape), out)
            return out
        return Lazy(info, read)

    model = {k[len(sharded.MODEL) + 1:]: lazy(k) for k in entries
             if k.startswith(sharded.MODEL + ".") and isinstance(entries[k], TensorStorageMetadata)}
    optimizers = []
    for i in range(sharded.optimizer_count(path)):
        prefix = f"{sharded.optimizer_prefix(i)}.state."
        values = {sharded.optimizer_prefix(i) + ".param_groups": b""}
        values.update({k: b"" for k, m in entries.items() if k.startswith(prefix)
                       and not isinstance(m, TensorStorageMetadata)})
        sharded._load(path, values)  # the groups and any non-tensor state values (small)
        state: dict[str, dict] = {}
        for k in entries:
            if k.startswith(prefix):
                name, _, key = k[len(prefix):].rpartition(".")
                state.setdefault(name, {})[key] = lazy(k) if k in source.tensors else sharded._unleaf(values[k])
        groups = sharded._unleaf(values[sharded.optimizer_prefix(i) + ".param_groups"])
        optimizers.append({"state": state, "param_groups": groups})
    return Checkpoint(path, "dcp", meta, model, optimizers, [None] * len(optimizers), source.close)


def _open_safetensors(path: str) -> Checkpoint:
    source = SafetensorsSource.from_file(path)

    def lazy(name):
        info = source.tensors[name]

        def read():
            out = torch.empty(info.shape, dtype=info.dtype)
            source.read(name, full_region(info.shape), out)
            return out
        return Lazy(info, read)
    return Checkpoint(path, "safetensors", {}, {n: lazy(n) for n in source.tensors}, [], [], source.close)


def _open_torch(path: str) -> Checkpoint:
    fd = os.open(path, os.O_RDONLY)
    counter = torchzip.ByteCounter()
    try:
        with torchzip.FileView(fd, 0, os.fstat(fd).st_size, counter) as view:
            obj = torchzip.load_meta(view, path)
    except BaseException:
        os.close(fd)
        raise
    if not isinstance(obj, dict) or not isinstance(obj.get("state_dict"), dict):
        keys = sorted(map(str, obj))[:10] if isinstance(obj, dict) else type(obj).__name__
        obj = {"state_dict": obj} if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()) \
            else None
        if obj is None:
            os.close(fd)
            raise ValueError(f"{path} is neither a Lightning checkpoint nor a state dict (found: {keys}).")

    def lazy(meta_tensor):
        where = torchzip.stored(meta_tensor)
        info = TensorInfo(tuple(meta_tensor.shape), meta_tensor.dtype)
        if where.offset is None:
            raise ValueError(f"{path}: torch did not report where a tensor's storage lies; re-save it with torch.save")
        return Lazy(info, lambda: torchzip.read_region(fd, path, where, full_region(info.shape), counter))

    def lazies(x):
        if isinstance(x, torch.Tensor):
            return lazy(x)
        if isinstance(x, dict):
            return {k: lazies(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(lazies(v) for v in x)
        return x

    meta = {k: v for k, v in obj.items() if k not in ("state_dict", "optimizer_states")}
    model = {k: lazy(v) for k, v in obj["state_dict"].items() if isinstance(v, torch.Tensor)}
    positional = [lazies(o) for o in obj.get("optimizer_states", [])]
    orders = (meta.get(sharded.INFO_KEY) or {}).get("param_names")
    optimizers = []
    for i, opt in enumerate(positional):
        if not orders or i >= len(orders):
            optimizers.append(None)
            continue
        name_of = {}
        for g, names in zip(opt["param_groups"], orders[i]):
            name_of.update(dict(zip(g["params"], names)))
        optimizers.append({"state": {name_of[int(p)]: dict(s) for p, s in opt["state"].items()},
                           "param_groups": [{**g, "params": list(names)} for g, names in
                                            zip(opt["param_groups"], orders[i])]})
    return Checkpoint(path, "ckpt", meta, model, optimizers, positional, lambda: os.close(fd))


# -- writers -------------------------------------------------------------------------------------------------

def _lazies_in(obj: Any) -> list[Lazy]:
    if isinstance(obj, Lazy):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _lazies_in(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _lazies_in(v)]
    return []


class _Storage:
    def __init__(self, key: str, lazy: Lazy):
        self.key, self.lazy = key, lazy


class _TensorRecord:
    """Pickles as ``torch._utils._rebuild_tensor_v2`` over a storage record, as ``torch.save`` writes a tensor."""

    def __init__(self, storage: _Storage):
        self.storage = storage

    def __reduce_ex__(self, protocol):
        shape = self.storage.lazy.shape
        stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) if i + 1 < len(shape) else 1 for i in range(len(shape)))
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, shape, stride, False, OrderedDict())


_STORAGE_TYPES = {torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
                  torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
                  torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
                  torch.bool: "BoolStorage", torch.complex64: "ComplexFloatStorage",
                  torch.complex128: "ComplexDoubleStorage"}


class _Pickler(pickle.Pickler):
    """Names storages as ``torch.save``'s pickler does: ``("storage", <dtype>Storage, key, location, numel)``."""

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            lazy = obj.lazy
            if lazy.dtype not in _STORAGE_TYPES:
                raise ValueError(f"writing a {lazy.dtype} tensor into a .ckpt is not supported")
            return ("storage", getattr(torch, _STORAGE_TYPES[lazy.dtype]), obj.key, "cpu",
                    int(torch.Size(lazy.shape).numel()))
        return None


def write_torch(path: str, obj: Any) -> None:
    """``torch.save(obj, path)`` with every :class:`Lazy` in ``obj`` read only when its record is written."""
    storages: list[_Storage] = []

    def placeholders(x):
        if isinstance(x, torch.Tensor):  # a small tensor of the metadata (an RNG state)
            x = Lazy(TensorInfo(tuple(x.shape), x.dtype), lambda t=x.detach().cpu(): t)
        if isinstance(x, Lazy):
            storages.append(_Storage(str(len(storages)), x))
            return _TensorRecord(storages[-1])
        if isinstance(x, dict):
            return type(x)((k, placeholders(v)) for k, v in x.items()) if isinstance(x, OrderedDict) else \
                {k: placeholders(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(placeholders(v) for v in x)
        return x

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(placeholders(obj))
    root = "archive"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        archive.writestr(f"{root}/data.pkl", buffer.getvalue())
        archive.writestr(f"{root}/byteorder", "little")
        for storage in storages:
            tensor = storage.lazy.read().contiguous()
            with archive.open(f"{root}/data/{storage.key}", "w", force_zip64=True) as record:
                record.write(memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else b"")
            del tensor
        archive.writestr(f"{root}/version", "3\n")


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def write_safetensors(path: str, tensors: dict[str, Lazy], metadata: Optional[dict] = None) -> None:
    """A safetensors file of ``tensors``, its header written first and each tensor read when its bytes are."""
    header: dict[str, Any] = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    for name, lazy in tensors.items():
        if lazy.dtype not in _ST_DTYPES:
            raise ValueError(f"safetensors has no dtype for {name!r} ({lazy.dtype})")
        size = int(torch.Size(lazy.shape).numel()) * lazy.dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[lazy.dtype], "shape": list(lazy.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for lazy in tensors.values():
            tensor = lazy.read().contiguous()
            if tensor.numel():
                f.write(memoryview(tensor.view(-1).view(torch.uint8).numpy()))
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


def convert(src, dst, *, strip_prefix: str = "", weights_only: bool = False) -> str:
    """Convert ``src`` (DCP directory, ``.ckpt`` or ``.safetensors``) to ``dst``, whose form its suffix names:
    ``.safetensors`` (weights only, names without ``strip_prefix``), ``.ckpt`` / ``.pt`` / ``.pth`` (plain
    Lightning's one-device file), anything else a DCP directory. Returns the form written."""
    ckpt = open_checkpoint(src)
    try:
        return _convert(ckpt, src, os.fspath(dst), strip_prefix=strip_prefix, weights_only=weights_only)
    finally:
        ckpt.close()


def _convert(ckpt: Checkpoint, src, dst: str, *, strip_prefix: str, weights_only: bool) -> str:
    model = {(k[len(strip_prefix):] if strip_prefix and k.startswith(strip_prefix) else k): v
             for k, v in ckpt.model.items()}
    if dst.endswith(".safetensors"):
        write_safetensors(dst, model, {"source": os.path.basename(os.fspath(src).rstrip("/"))})
        return "safetensors"
    if ckpt.kind == "safetensors" and not weights_only:
        raise ValueError(f"{src} holds weights only; pass --weights-only to write a {dst} without optimizer and "
                         f"loop state (it cannot resume a fit).")
    meta = dict(ckpt.meta)
    optimizers = [] if weights_only else ckpt.named_optimizers()
    if weights_only:
        meta.pop("lr_schedulers", None)
    if dst.endswith((".ckpt", ".pt", ".pth")):
        out = {**meta, "state_dict": model}
        if not weights_only:
            out["optimizer_states"] = [to_positional(o["state"], o["param_groups"]) for o in optimizers]
        write_file(dst, lambda tmp: write_torch(tmp, out))
        return "ckpt"
    write_dcp(dst, sharded.flatten(model, optimizers, meta, tensor_type=(torch.Tensor, Lazy)))
    return "dcp"


def describe(path) -> str:
    """What ``path`` holds: its form, the layout that wrote it, the step, and every tensor."""
    ckpt = open_checkpoint(path)
    ckpt.close()  # the listing reads no tensor
    info = ckpt.meta.get(sharded.INFO_KEY) or {}
    layout = info.get("layout")
    kinds = {"dcp": "torch.distributed.checkpoint directory", "ckpt": "Lightning checkpoint file",
             "safetensors": "safetensors file"}
    lines = [f"{ckpt.path}: {kinds[ckpt.kind]}",
             "layout: " + (", ".join(f"{k}={v}" for k, v in layout.items()) if layout else
                           ("weights only" if ckpt.kind == "safetensors" else "plain Lightning (one device)"))]
    if "global_step" in ckpt.meta:
        lines.append(f"epoch: {ckpt.meta.get('epoch')}  global_step: {ckpt.meta['global_step']}  "
                     f"lightning: {ckpt.meta.get('pytorch-lightning_version')}")
    total = sum(int(torch.Size(v.shape).numel()) * v.dtype.itemsize for v in ckpt.model.values())
    lines.append(f"state_dict: {len(ckpt.model)} tensors, {total / 2**20:.2f} MiB")
    lines += [f"  {name}  {list(v.shape)}  {str(v.dtype).replace('torch.', '')}" for name, v in ckpt.model.items()]
    for i, (named, positional) in enumerate(zip(ckpt.optimizers, ckpt.positional)):
        source = named or positional
        tensors = _lazies_in(source["state"])
        sizes = [len(g["params"]) for g in source["param_groups"]]
        nbytes = sum(int(torch.Size(t.shape).numel()) * t.dtype.itemsize for t in tensors)
        lines.append(f"optimizer {i}: groups of {sizes} parameters, state of {len(source['state'])} "
                     f"({len(tensors)} tensors, {nbytes / 2**20:.2f} MiB)"
                     + ("" if named else "; numbered by position"))
    return "\n".join(lines)


__all__ = ["Checkpoint", "Lazy", "convert", "describe", "open_checkpoint", "write_dcp", "write_safetensors",
           "write_torch"]
