"""Tensors of a model whose parameters are partly DTensors: gathered to full plain tensors, or a full tensor
laid out like a (DTensor) parameter again.

A DCP chunk is one block of rows, so a fused projection's shard (``_StridedShard``: a block from each of its
parts, see [Note: fused projections]) is written whole (:func:`map_strided`) and sliced back locally on load
(:func:`zip_strided`). Gathering is a collective: every rank calls :func:`full_state` in the same order.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_par._compat import strided_shard_type

_StridedShard = strided_shard_type()  # private in torch: reached through _compat


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


def is_strided(t: Any) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def map_strided(obj: Any, fn) -> Any:
    """``obj`` (nested dicts / lists) with ``fn`` applied to every DTensor whose shard is not one block of
    rows; the walk order is the same on every rank (``fn`` may be a collective)."""
    if is_strided(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_strided(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_strided(v, fn) for v in obj]
    return obj


def zip_strided(like: Any, loaded: Any) -> Any:
    """``loaded`` with each whole tensor that :func:`map_strided` put in place of a strided DTensor of
    ``like`` sliced back to that DTensor's layout (locally)."""
    if is_strided(like):
        return distribute_tensor(loaded, like.device_mesh, like.placements, src_data_rank=None)
    if isinstance(like, dict):
        return {k: zip_strided(v, loaded[k]) for k, v in like.items()}
    if isinstance(like, list):
        return [zip_strided(v, w) for v, w in zip(like, loaded)]
    return loaded
