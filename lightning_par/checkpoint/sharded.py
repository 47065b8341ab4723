"""The sharded checkpoint: one ``torch.distributed.checkpoint`` (DCP) directory for every layout.

[Note: one sharded format]
Entries are keyed by the unchanged module's names, never by rank or stage:

- ``state_dict.<name>``: the module's state dict (DTensors as DTensors: each rank writes its shards);
- ``optimizer_<i>.state.<name>.<key>``: optimizer ``i``'s state of parameter ``<name>`` (``exp_avg``, ``step``);
- ``optimizer_<i>.param_groups``: the groups' hyperparameters, ``params`` holding the one-device order of
  names ([Note: optimizer state by name] in :mod:`lightning_par.checkpoint.optim`);
- ``lightning``: the rest of Lightning's checkpoint (loops, LR schedulers, callbacks, loss scaler, version,
  and ``lightning_par``: the layout that wrote it and rank 0's RNG state), written by rank 0.

Each rank passes what it writes (a pipeline stage its blocks, a ZeRO-1 rank the state of its partition);
entries several ranks pass (replicas) are written once (DCP's deduplication). A rank reading the directory
asks for the entries it holds, laid out as it holds them, and DCP reads the overlapping saved chunks, so
any layout reads any other's directory. Non-tensor values are stored as pickled bytes (DCP would flatten a
container into entries of its own). The directory is written under ``<path>.incomplete`` and renamed when
complete (:func:`publish`).
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_par.atomic import clear_temporary, hidden_name, publish_directory
from lightning_par.checkpoint.tensors import is_strided, map_strided, zip_strided
from lightning_par.waits import named_wait

MODEL = "state_dict"
META = "lightning"
INFO_KEY = "lightning_par"  # in Lightning's checkpoint: the layout that wrote it, names of the optimizer order, RNG
def incomplete(path: str) -> str:
    """Where a directory is written before it is published: hidden, in the same folder ([Note: atomic
    checkpoints] in :mod:`lightning_par.atomic`)."""
    return hidden_name(os.path.normpath(os.fspath(path)), "partial")


def optimizer_prefix(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded(path) -> bool:
    """Whether ``path`` is a DCP directory (it has DCP's ``.metadata``)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def publish(tmp: str, path: str) -> None:
    """Give a completed checkpoint ``tmp`` its final name ``path`` (replacing an older one) atomically."""
    publish_directory(tmp, path)


def _leaf(value: Any) -> Any:
    return value if isinstance(value, torch.Tensor) else pickle.dumps(value)


def _unleaf(value: Any) -> Any:
    return pickle.loads(value) if isinstance(value, bytes) else value


def flatten(model: Mapping[str, Any], optimizers: Sequence[Mapping[str, Any]],
            meta: Optional[Mapping[str, Any]], tensor_type: type = torch.Tensor) -> dict[str, Any]:
    """The flat DCP state of one rank: its ``model`` entries, its named optimizer shares
    (``{"state": {name: {key: value}}, "param_groups": [...]}``) and, on rank 0, ``meta``. Values of
    ``tensor_type`` (tensors; the converter's lazy tensors) are kept, others pickled."""
    flat: dict[str, Any] = {f"{MODEL}.{k}": v for k, v in model.items()}
    for i, opt in enumerate(optimizers):
        prefix = optimizer_prefix(i)
        for name, entry in opt["state"].items():
            for key, value in entry.items():
                flat[f"{prefix}.state.{name}.{key}"] = value if isinstance(value, tensor_type) else _leaf(value)
        flat[f"{prefix}.param_groups"] = _leaf(opt["param_groups"])
    if meta is not None:
        flat[META] = _leaf(dict(meta))
    return flat


def start_save(path: str, flat: Mapping[str, Any], *, async_save: bool = False, process_group=None):
    """Write ``flat`` to ``<path>.incomplete`` (every rank calls it). Synchronous: returns None once every rank
    has written (the caller publishes). ``async_save``: returns DCP's future once the state is staged (one
    copy of this rank's share); the directory is complete when the future is done on the coordinator."""
    import torch.distributed.checkpoint as dcp

    flat = map_strided(dict(flat), lambda t: t.full_tensor())
    # what a killed save left is removed by the coordinator while the others wait: dcp.save makes the directory
    # on every rank as it plans, and a rank whose mkdir ran into the coordinator's removal failed the save
    # (pathlib's mkdir found the name taken, then no directory there: FileExistsError, seen under load)
    tmp = clear_temporary(path) if not dist.is_initialized() or dist.get_rank() == 0 else incomplete(path)
    if dist.is_initialized():
        with named_wait(f"the checkpoint save's start ({path}: the coordinator clears what a killed save left)"):
            dist.barrier(group=process_group)
    if async_save:
        response = dcp.async_save(flat, checkpoint_id=tmp, process_group=process_group)
        return getattr(response, "upload_completion", response)
    dcp.save(flat, checkpoint_id=tmp)
    return None


def save(path: str, model: Mapping[str, Any], optimizers: Sequence[Mapping[str, Any]] = (),
         meta: Optional[Mapping[str, Any]] = None, *, is_rank_zero: bool = True) -> None:
    """Write one rank's share (see :func:`flatten`; ``meta`` from rank 0) and give the directory its final name
    once every rank has written. Every rank calls it; the caller synchronises the ranks before reading."""
    start_save(path, flatten(model, optimizers, meta if is_rank_zero else None))
    if is_rank_zero:
        publish(incomplete(path), path)


def _metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as err:  # truncated or foreign metadata
        raise ValueError(f"The checkpoint {path} cannot be read as a torch.distributed.checkpoint directory: "
                         f"{type(err).__name__}: {err}") from err


def saved_entries(path: str) -> dict[str, Any]:
    """Key -> DCP metadata of every entry in the directory."""
    return _metadata(path).state_dict_metadata


def _load(path: str, flat: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        dcp.load(flat, checkpoint_id=path, no_dist=True)  # every rank reads its own entries, no collective
    except (Exception, CheckpointException) as err:
        shown = sorted(flat)[:8]
        raise ValueError(f"Reading {len(flat)} entries ({', '.join(shown)}{', ...' if len(flat) > 8 else ''}) "
                         f"from the checkpoint {path} failed: {type(err).__name__}: {err}") from err


def read_meta(path: str) -> dict[str, Any]:
    """Lightning's checkpoint without the module and optimizer states (the ``lightning`` entry)."""
    if META not in saved_entries(path):
        raise ValueError(f"The directory {path} is a torch.distributed.checkpoint without the `{META}` entry "
                         f"that lightning_par writes (Lightning's loops, schedulers, callbacks); it was not "
                         f"written by a lightning_par strategy.")
    flat = {META: b""}
    _load(path, flat)
    return _unleaf(flat[META])


def optimizer_count(path: str) -> int:
    keys, count = saved_entries(path), 0
    while f"{optimizer_prefix(count)}.param_groups" in keys:
        count += 1
    return count


def model_names(path: str) -> dict[str, tuple]:
    """Module name -> saved full shape of every model entry."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = MODEL + "."
    return {k[len(prefix):]: tuple(m.size) for k, m in saved_entries(path).items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}


def load_model(path: str, targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``targets``' keys (tensors as this rank holds them: plain or DTensor) read from the
    directory, laid out like the targets. The caller has checked the names (:func:`model_names`)."""
    wanted = {f"{MODEL}.{k}": v for k, v in targets.items()}
    flat = map_strided(wanted, lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device))
    flat = {k: (v if k not in wanted or is_strided(wanted[k]) else torch.empty_like(v)) for k, v in flat.items()}
    _load(path, flat)
    loaded = zip_strided(wanted, flat)
    return {k[len(MODEL) + 1:]: v for k, v in loaded.items()}


def load_optimizer(path: str, index: int, params: Mapping[str, torch.Tensor]) -> tuple[dict, list[dict]]:
    """Optimizer ``index``'s state of the parameters ``params`` (name -> this rank's parameter) and its groups;
    a state tensor of a parameter's shape is read laid out like the parameter (its DTensor shard)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{optimizer_prefix(index)}.state."
    groups_key = f"{optimizer_prefix(index)}.param_groups"
    flat: dict[str, Any] = {groups_key: b""}
    owner: dict[str, tuple[str, str]] = {}
    for key, meta in saved_entries(path).items():
        if not key.startswith(prefix):
            continue
        name, _, state_key = key[len(prefix):].rpartition(".")
        p = params.get(name)
        if p is None:
            continue
        owner[key] = (name, state_key)
        if not isinstance(meta, TensorStorageMetadata):
            flat[key] = b""
        elif tuple(meta.size) == tuple(p.shape) and len(meta.size) > 0:
            flat[key] = torch.empty_like(p, dtype=meta.properties.dtype)
        else:
            flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    like = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    staged = map_strided(like, lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device))
    flat.update(staged)
    _load(path, flat)
    flat.update(zip_strided(like, {k: flat[k] for k in like}))
    state: dict[str, dict[str, Any]] = {}
    for key, (name, state_key) in owner.items():
        state.setdefault(name, {})[state_key] = _unleaf(flat[key])
    return state, _unleaf(flat[groups_key])


__all__ = ["incomplete", "INFO_KEY", "META", "MODEL", "flatten", "is_sharded", "load_model", "load_optimizer",
           "model_names", "optimizer_count", "optimizer_prefix", "publish", "read_meta", "save", "saved_entries",
           "start_save"]
