"""Converting and inspecting checkpoints one tensor at a time (``lightning-par-checkpoint``).

    convert("ckpt/epoch=0-step=2.ckpt", "one.ckpt")             # DCP directory -> plain Lightning file
    convert("one.ckpt", "model.safetensors", strip_prefix="net.")  # weights only, names as HF takes them
    print(describe("ckpt/epoch=0-step=2.ckpt"))

[Note: streaming conversion]
A source lists its tensors without reading them (DCP's ``.metadata``; a ``.ckpt``'s pickle, loaded with every
storage on the meta device; a safetensors header) and reads one whole tensor at a time through the weights
reader (:mod:`lightning_par.weights`), chunk by chunk. A writer (:mod:`lightning_par.checkpoint.writers`)
takes the list first and then the tensors in order: a safetensors header is written from the list; the
``.ckpt`` archive is written by ``torch.save`` itself with tensors that hold no bytes, which are then written
at the offsets torch gave them ([Note: torch's own archive, bytes filled in]); and a DCP directory is written
by DCP's ``FileSystemWriter`` with a planner that reads each tensor when DCP asks for its bytes, one data file
per entry (the writer holds a file's tensors until the file is complete).
So a conversion holds at most one tensor (plus the reader's bounded buffer) besides the small metadata.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Callable

import torch

from lightning_par.atomic import write_file
from lightning_par.checkpoint import sharded
from lightning_par.checkpoint.optim import to_positional
from lightning_par.checkpoint.writers import (Lazy, map_leaves, read_all, tensor_leaves, write_dcp, write_safetensors,
                                              write_torch)
from lightning_par.weights import torchzip
from lightning_par.weights.regions import full_region
from lightning_par.weights.sources import DCPSource, SafetensorsSource, TensorInfo


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
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: give the path of a checkpoint file or directory.")
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
    kind = "ckpt"
    if not isinstance(obj, dict) or not isinstance(obj.get("state_dict"), dict):
        keys = sorted(map(str, obj))[:10] if isinstance(obj, dict) else type(obj).__name__
        obj, kind = ({"state_dict": obj}, "state_dict") if isinstance(obj, dict) and obj and \
            all(isinstance(v, torch.Tensor) for v in obj.values()) else (None, kind)
        if obj is None:
            os.close(fd)
            raise ValueError(f"{path} is neither a Lightning checkpoint nor a state dict (found: {keys}).")

    def lazy(meta_tensor):
        where = torchzip.stored(meta_tensor)
        info = TensorInfo(tuple(meta_tensor.shape), meta_tensor.dtype)
        if where.offset is None:
            raise ValueError(f"{path}: torch did not report where a tensor's storage lies; re-save it with torch.save")
        return Lazy(info, lambda: torchzip.read_region(fd, path, where, full_region(info.shape), counter))

    # tensors outside the module's state (RNG states, ModelCheckpoint's scores) are lazy too: on the meta device
    # they hold no values
    meta = {k: map_leaves(v, lazy) for k, v in obj.items() if k not in ("state_dict", "optimizer_states")}
    model = {k: lazy(v) for k, v in obj["state_dict"].items() if isinstance(v, torch.Tensor)}
    positional = [map_leaves(o, lazy) for o in obj.get("optimizer_states", [])]
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
    return Checkpoint(path, kind, meta, model, optimizers, positional, lambda: os.close(fd))


# -- converting ----------------------------------------------------------------------------------------------

_TORCH_SUFFIXES = (".ckpt", ".pt", ".pth")  # written by torch.save; ".safetensors" by safetensors; else a DCP directory


def convert(src, dst, *, strip_prefix: str = "", weights_only: bool = False) -> str:
    """Convert ``src`` (DCP directory, ``.ckpt`` or ``.safetensors``) to ``dst``, whose form its suffix names:
    ``.safetensors`` (weights only, names without ``strip_prefix``), ``.ckpt`` / ``.pt`` / ``.pth`` (plain
    Lightning's one-device file), anything else a DCP directory. Returns the form written."""
    ckpt = open_checkpoint(src)
    try:
        dst = os.fspath(dst)
        folder = os.path.dirname(os.path.abspath(dst))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"The folder {folder} of {dst} does not exist: create it first "
                                    f"(mkdir -p {folder}) or write somewhere else.")
        if not dst.endswith((*_TORCH_SUFFIXES, ".safetensors")) and os.path.exists(dst) and not sharded.is_sharded(dst):
            raise FileExistsError(f"{dst} exists and is not a checkpoint directory; a destination without a file "
                                  f"suffix (.ckpt, .pt, .pth, .safetensors) is written as a DCP directory, which "
                                  f"would replace it. Name a new directory (say {os.path.join(dst, 'ckpt')}) or a "
                                  f"file.")
        if strip_prefix and not any(k.startswith(strip_prefix) for k in ckpt.model):
            raise ValueError(f"The prefix {strip_prefix!r} (--strip-prefix) starts none of the {len(ckpt.model)} "
                             f"tensor names in {ckpt.path}; they start with {_prefixes(ckpt.model)}. Pass one of "
                             f"those, or no prefix.")
        return _convert(ckpt, src, dst, strip_prefix=strip_prefix, weights_only=weights_only)
    finally:
        ckpt.close()


def _prefixes(names, shown: int = 5) -> str:
    """The most common first components of ``names`` with their counts: ``'net.' (10), 'head.' (2)``."""
    counts = Counter(n.split(".", 1)[0] + "." if "." in n else n for n in names)
    common = ", ".join(f"{p!r} ({c})" for p, c in counts.most_common(shown))
    return common + (f" and {len(counts) - shown} more" if len(counts) > shown else "")


def _convert(ckpt: Checkpoint, src, dst: str, *, strip_prefix: str, weights_only: bool) -> str:
    model = {(k[len(strip_prefix):] if strip_prefix and k.startswith(strip_prefix) else k): v
             for k, v in ckpt.model.items()}
    if dst.endswith(".safetensors"):
        write_safetensors(dst, model, {"source": os.path.basename(os.fspath(src).rstrip("/"))})
        return "safetensors"
    if ckpt.kind in ("safetensors", "state_dict") and not weights_only:
        raise ValueError(f"{src} holds weights only; pass --weights-only to write a {dst} without optimizer and "
                         f"loop state (it cannot resume a fit).")
    meta = dict(ckpt.meta)
    optimizers = [] if weights_only else ckpt.named_optimizers()
    if weights_only:
        meta.pop("lr_schedulers", None)
    if dst.endswith(_TORCH_SUFFIXES):
        out = {**meta, "state_dict": model}
        if not weights_only:
            out["optimizer_states"] = [to_positional(o["state"], o["param_groups"]) for o in optimizers]
        write_file(dst, lambda tmp: write_torch(tmp, out, where=dst))
        return "ckpt"
    # a DCP directory keeps Lightning's metadata as one pickled entry: its few tensors are read here
    write_dcp(dst, sharded.flatten(model, optimizers, read_all(meta), tensor_type=(torch.Tensor, Lazy)))
    return "dcp"


def describe(path) -> str:
    """What ``path`` holds: its form, the layout that wrote it, the step, and every tensor."""
    ckpt = open_checkpoint(path)
    ckpt.close()  # the listing reads no tensor
    info = ckpt.meta.get(sharded.INFO_KEY) or {}
    layout = info.get("layout")
    kinds = {"dcp": "torch.distributed.checkpoint directory", "ckpt": "Lightning checkpoint file",
             "safetensors": "safetensors file", "state_dict": f"a state dict of {len(ckpt.model)} tensors "
                                                              f"(torch.save file, not a Lightning checkpoint)"}
    weights = ckpt.kind in ("safetensors", "state_dict")
    lines = [f"{ckpt.path}: {kinds[ckpt.kind]}",
             "layout: " + (", ".join(f"{k}={v}" for k, v in layout.items()) if layout else
                           ("weights only" if weights else "plain Lightning (one device)"))]
    if "global_step" in ckpt.meta:
        lines.append(f"epoch: {ckpt.meta.get('epoch')}  global_step: {ckpt.meta['global_step']}  "
                     f"lightning: {ckpt.meta.get('pytorch-lightning_version')}")
    total = sum(int(torch.Size(v.shape).numel()) * v.dtype.itemsize for v in ckpt.model.values())
    lines.append(f"state_dict: {len(ckpt.model)} tensors, {total / 2**20:.2f} MiB")
    lines += [f"  {name}  {list(v.shape)}  {str(v.dtype).replace('torch.', '')}" for name, v in ckpt.model.items()]
    for i, (named, positional) in enumerate(zip(ckpt.optimizers, ckpt.positional)):
        source = named or positional
        tensors = tensor_leaves(source["state"])
        sizes = [len(g["params"]) for g in source["param_groups"]]
        nbytes = sum(int(torch.Size(t.shape).numel()) * t.dtype.itemsize for t in tensors)
        lines.append(f"optimizer {i}: groups of {sizes} parameters, state of {len(source['state'])} "
                     f"({len(tensors)} tensors, {nbytes / 2**20:.2f} MiB)"
                     + ("" if named else "; numbered by position"))
    return "\n".join(lines)


__all__ = ["Checkpoint", "Lazy", "convert", "describe", "open_checkpoint", "write_dcp", "write_safetensors",
           "write_torch"]
