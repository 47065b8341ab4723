"""Sharded (``torch.distributed.checkpoint``) checkpoints of a pipeline.

[Note: sharded pipeline checkpoint]
Every stage of the first replica writes what it owns (its blocks; outside them, the parameters it owns
per [Note: shared parameters] and, on the first stage, the buffers) and every stage the optimizer state
of its parameters: nothing travels to rank 0, and each rank writes its own files. The directory is the
one :func:`lightning_par.checkpoint.save_distributed` writes (``state_dict`` and ``optimizer_<i>`` in DCP,
the rest in ``meta.pt``); entries are keyed by the unchanged module's names, not by stage
(``state_dict.<name>``, ``optimizer_<i>.<name>/<state key>``, and the param groups' hyperparameters, the
same on every stage, as ``optimizer_<i>.groups``), so a directory loads under any pipeline layout: a stage
reads the entries of the parameters it holds.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable

import torch
from torch import nn

_GROUPS = "groups"


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"  # as lightning_par.checkpoint.save_distributed names it


def optimizer_items(optimizer: torch.optim.Optimizer, names: dict[int, str],
                    owns: Callable[[nn.Parameter], bool]) -> dict[str, Any]:
    """The state of the optimizer's parameters this rank owns, keyed by parameter name, and the groups'
    hyperparameters (without their parameter lists)."""
    items: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer.state and owns(p):
                for key, value in optimizer.state[p].items():
                    items[f"{names[id(p)]}/{key}"] = _leaf(value)
    items[_GROUPS] = _leaf([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    return items


def _leaf(value: Any) -> Any:
    # DCP would flatten a container into entries of its own (``groups.0.lr``): anything but a tensor is
    # stored as one pickled object
    return value if isinstance(value, torch.Tensor) else pickle.dumps(value)


def _unleaf(value: Any) -> Any:
    return pickle.loads(value) if isinstance(value, bytes) else value


def _saved(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def optimizer_count(path: str) -> int:
    """How many optimizers the directory holds state for."""
    keys, count = _saved(path), 0
    while f"{_optimizer_key(count)}.{_GROUPS}" in keys:
        count += 1
    return count


def load_model(path: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read the entries of ``state``'s keys (a module's ``state_dict``, used for shapes and dtypes) from the
    directory; every rank calls it."""
    import torch.distributed.checkpoint as dcp

    items = {"state_dict": {k: torch.empty_like(v) for k, v in state.items()}}
    dcp.load(items, checkpoint_id=path)
    return items["state_dict"]


def load_optimizer(path: str, optimizer: torch.optim.Optimizer, index: int, names: dict[int, str]) -> None:
    """Load the saved state of this optimizer's parameters (those the directory has) and its groups'
    hyperparameters; every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = _optimizer_key(index) + "."
    ours = {names[id(p)] for g in optimizer.param_groups for p in g["params"] if not p.is_meta}  # held here
    entries: dict[str, Any] = {_GROUPS: None}
    for key, meta in _saved(path).items():
        entry = key[len(prefix):]
        if key.startswith(prefix) and entry != _GROUPS and entry.rpartition("/")[0] in ours:
            entries[entry] = (torch.empty(meta.size, dtype=meta.properties.dtype)
                              if isinstance(meta, TensorStorageMetadata) else None)
    items = {_optimizer_key(index): entries}
    dcp.load(items, checkpoint_id=path)
    entries = items[_optimizer_key(index)]
    groups = _unleaf(entries.pop(_GROUPS))
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"The checkpoint's optimizer {index} has {len(groups)} parameter groups; this one has "
                         f"{len(optimizer.param_groups)}. Resume with the module and optimizer that wrote it.")
    state: dict[int, dict] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        name = names[id(p)] + "/"
        entry = {k[len(name):]: _unleaf(v) for k, v in entries.items() if k.startswith(name)}
        if entry:
            state[i] = entry
    numbered, start = [], 0
    for saved_group, group in zip(groups, optimizer.param_groups):
        numbered.append({**saved_group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": numbered})
