"""Save and load the state of a model whose parameters are partly DTensors.

Two forms:

- consolidated (default): every DTensor is gathered to its full tensor under the module's original
  names, so the file is an ordinary Lightning checkpoint that the unchanged module loads on one device
  (``load_from_checkpoint``; ``torch.load(weights_only=True)`` works). Loading slices each full tensor
  back to this rank's shard locally (no communication).
- distributed: the DTensors themselves go to a ``torch.distributed.checkpoint`` directory (each rank
  writes its shards), the rest of Lightning's checkpoint to a ``meta.pt`` file inside it. A DCP chunk is
  one block of rows, so a fused projection's shard (``_StridedShard``: a block from each of its parts, see
  [Note: fused projections]) is written whole instead, and sliced back locally on load.

Gathering is a collective: every rank calls :func:`full_state` in the same order.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_par._compat import strided_shard_type

_StridedShard = strided_shard_type()  # private in torch: reached through _compat

META_FILE = "meta.pt"


def full_state(obj: Any) -> Any:
    """``obj`` (nested dicts / lists / tuples) with every DTensor gathered to a plain full CPU tensor."""
    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().cpu()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: full_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_state(v) for v in obj)
    return obj


def local_state(obj: Any) -> Any:
    """``obj`` (nested dicts / lists / tuples) with every DTensor replaced by its local shard (no communication):
    what a rank's own optimizer state holds, picklable without its mesh."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach()
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_state(v) for v in obj)
    return obj


def local_shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``like``: sliced to its DTensor shard (locally), or moved to its device."""
    if isinstance(like, DTensor):
        if isinstance(full, DTensor):
            return full
        if tuple(full.shape) != tuple(like.shape):
            raise ValueError(f"checkpoint tensor of shape {tuple(full.shape)} does not fit a parameter of shape "
                             f"{tuple(like.shape)}; was it saved from a different model?")
        return distribute_tensor(full.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements,
                                 src_data_rank=None)
    return full.to(device=like.device) if isinstance(full, torch.Tensor) else full


def load_model_state(module: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load a consolidated (or distributed, already sharded) state dict into a partly-DTensor module."""
    current = module.state_dict()
    converted = {k: (local_shard_like(v, current[k]) if k in current and isinstance(v, torch.Tensor) else v)
                 for k, v in state.items()}
    module.load_state_dict(converted, strict=strict)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the order ``state_dict()`` numbers them."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], local: bool = False) -> None:
    """Load an optimizer state dict whose per-parameter tensors may be full tensors of DTensor parameters, or
    with ``local`` their local shards (as :func:`local_state` wrote them)."""
    params = optimizer_params(optimizer)
    per_param = {}
    for idx, entry in state["state"].items():
        p = params[int(idx)]
        if local and isinstance(p, DTensor):
            per_param[idx] = {k: (DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)
                                  if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.to_local().shape)
                                  and v.dim() > 0 else v) for k, v in entry.items()}
            continue
        per_param[idx] = {k: (local_shard_like(v, p) if isinstance(v, torch.Tensor) and v.dim() > 0
                              and tuple(v.shape) == tuple(p.shape) else v)
                          for k, v in entry.items()}
    optimizer.load_state_dict({**state, "state": per_param})


# -- distributed (DCP) form --------------------------------------------------------------------------

def sharded_model_state(module: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=False))


def sharded_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by parameter name, DTensors kept sharded (initialised if still empty)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=False))


def save_distributed(path: str, checkpoint: dict, *, is_rank_zero: bool) -> None:
    """Write ``checkpoint`` as a DCP directory: ``state_dict`` and ``optimizer_states`` (as produced by
    :func:`sharded_model_state` / :func:`sharded_optimizer_state`, or by a pipeline stage: see
    [Note: sharded pipeline checkpoint]) sharded, the rest to ``meta.pt`` by rank 0. Every rank calls it."""
    import torch.distributed.checkpoint as dcp

    checkpoint = dict(checkpoint)
    sharded = {"state_dict": checkpoint.pop("state_dict")}
    for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
        sharded[f"optimizer_{i}"] = opt_state
    os.makedirs(path, exist_ok=True)
    dcp.save(_map_strided(sharded, lambda t: t.full_tensor()), checkpoint_id=path)
    if is_rank_zero:
        torch.save(checkpoint, os.path.join(path, META_FILE))


def is_distributed_checkpoint(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META_FILE))


def load_distributed(path, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    """Read a DCP directory written by :func:`save_distributed` into ``module`` and ``optimizers`` (in place,
    same layout) and return the rest of Lightning's checkpoint (``state_dict`` / ``optimizer_states`` left out)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = {"state_dict": sharded_model_state(module)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = sharded_optimizer_state(module, opt)
    whole = _map_strided(state, lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device))
    dcp.load(whole, checkpoint_id=str(path))
    state = _zip_strided(state, whole)
    set_model_state_dict(module, state["state_dict"])
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"])
    return read_meta(path)


def read_meta(path) -> dict:
    """What :func:`save_distributed` wrote besides the sharded states (loops, schedulers, callbacks, ...)."""
    return torch.load(os.path.join(path, META_FILE), weights_only=False)


def _strided(t: Any) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def _map_strided(obj: Any, fn) -> Any:
    """``obj`` (nested dicts / lists) with ``fn`` applied to every DTensor whose shard is not one block of
    rows; the walk order is the same on every rank (``fn`` may be a collective)."""
    if _strided(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_strided(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_strided(v, fn) for v in obj]
    return obj


def _zip_strided(like: Any, loaded: Any) -> Any:
    """``loaded`` with each whole tensor that :func:`_map_strided` put in place of a strided DTensor of
    ``like`` sliced back to that DTensor's layout (locally)."""
    if _strided(like):
        return distribute_tensor(loaded, like.device_mesh, like.placements, src_data_rank=None)
    if isinstance(like, dict):
        return {k: _zip_strided(v, loaded[k]) for k, v in like.items()}
    if isinstance(like, list):
        return [_zip_strided(v, w) for v, w in zip(like, loaded)]
    return loaded
