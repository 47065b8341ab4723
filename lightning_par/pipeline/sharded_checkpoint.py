"""Sharded (``torch.distributed.checkpoint``) checkpoints of a pipeline.

[Note: sharded pipeline checkpoint]
Every stage of the first replica writes what it owns (its blocks; outside them, the parameters it owns
per [Note: shared parameters] and, on the first stage, the buffers) and every stage the optimizer state
of its parameters: nothing travels to rank 0, and each rank writes its own files. Entries are keyed by
the unchanged module's names, not by stage (``model/<name>``, ``optim<i>/<name>/<state key>``, and the
param groups' hyperparameters, the same on every stage, as ``optim<i>/groups``), so a directory loads
under any pipeline layout: a stage reads the entries of the parameters it holds. Lightning's other
checkpoint contents (loops, schedulers, callbacks) go to ``meta.pt`` as in :mod:`lightning_par.checkpoint`.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Callable

import torch
from torch import nn

from lightning_par.checkpoint import META_FILE

_MODEL, _GROUPS = "model/", "groups"


def model_items(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of the model state, as checkpoint entries."""
    return {_MODEL + k: v for k, v in state.items()}


def optimizer_items(optimizer: torch.optim.Optimizer, index: int, names: dict[int, str],
                    owns: Callable[[nn.Parameter], bool]) -> dict[str, Any]:
    """The state of the optimizer's parameters this rank owns, keyed by parameter name, and the groups'
    hyperparameters (without their parameter lists)."""
    prefix = f"optim{index}/"
    items: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer.state and owns(p):
                for key, value in optimizer.state[p].items():
                    items[f"{prefix}{names[id(p)]}/{key}"] = _leaf(value)
    items[prefix + _GROUPS] = _leaf([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    return items


def _leaf(value: Any) -> Any:
    # DCP would flatten a container into entries of its own (``groups.0.lr``): anything but a tensor is
    # stored as one pickled object
    return value if isinstance(value, torch.Tensor) else pickle.dumps(value)


def _unleaf(value: Any) -> Any:
    return pickle.loads(value) if isinstance(value, bytes) else value


def save(path: str, checkpoint: dict, items: dict[str, Any], *, is_rank_zero: bool) -> None:
    """Write ``items`` (this rank's entries) as a DCP directory and the rest of ``checkpoint`` (its
    ``state_dict`` and ``optimizer_states`` left out) to ``meta.pt``. Every rank calls it."""
    import torch.distributed.checkpoint as dcp

    os.makedirs(path, exist_ok=True)
    dcp.save(items, checkpoint_id=path)
    if is_rank_zero:
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        torch.save(rest, os.path.join(path, META_FILE))


def optimizer_count(path: str) -> int:
    """How many optimizers the directory holds state for."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return sum(1 for k in keys if k.startswith("optim") and k.endswith("/" + _GROUPS))


def load_model(path: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read the entries of ``state``'s keys (a module's ``state_dict``, used for shapes and dtypes) from the
    directory; every rank calls it."""
    import torch.distributed.checkpoint as dcp

    items = {_MODEL + k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(items, checkpoint_id=path)
    return {k[len(_MODEL):]: v for k, v in items.items()}


def load_optimizer(path: str, optimizer: torch.optim.Optimizer, index: int, names: dict[int, str]) -> None:
    """Load the saved state of this optimizer's parameters (those the directory has) and its groups'
    hyperparameters; every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"optim{index}/"
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    ours = {names[id(p)] for g in optimizer.param_groups for p in g["params"]}
    items: dict[str, Any] = {prefix + _GROUPS: None}
    for key, meta in saved.items():
        if key.startswith(prefix) and key != prefix + _GROUPS and key[len(prefix):].rpartition("/")[0] in ours:
            items[key] = (torch.empty(meta.size, dtype=meta.properties.dtype)
                          if isinstance(meta, TensorStorageMetadata) else None)
    dcp.load(items, checkpoint_id=path)
    groups = _unleaf(items.pop(prefix + _GROUPS))
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"The checkpoint's optimizer {index} has {len(groups)} parameter groups; this one has "
                         f"{len(optimizer.param_groups)}. Resume with the module and optimizer that wrote it.")
    state: dict[int, dict] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        entry = {k[len(prefix) + len(names[id(p)]) + 1:]: _unleaf(v) for k, v in items.items()
                 if k.startswith(f"{prefix}{names[id(p)]}/")}
        if entry:
            state[i] = entry
    numbered, start = [], 0
    for saved_group, group in zip(groups, optimizer.param_groups):
        numbered.append({**saved_group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": numbered})
