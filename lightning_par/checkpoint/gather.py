"""Every rank's share of a checkpoint gathered on rank 0 as full plain tensors (the consolidated file).

[Note: who sends what when consolidating]
A rank's share maps keys to plain tensors or DTensors (a tensor-parallel or FSDP shard). The ranks first
tell each other their keys (small); each key is then sent by the lowest rank that holds it, so replicas
(data-parallel copies, the replicated entries of tensor-parallel peers) travel once, and entries only one
rank holds (a ZeRO-1 rank's optimizer state, a pipeline stage's blocks) come from that rank. A DTensor is
gathered with ``full_tensor`` by all the ranks of its mesh, in one key order, and kept by the sender only.
Every rank calls :func:`gather_share`; without a process group the share is returned as full tensors.
"""
from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _plain(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def gather_share(share: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
    """On rank 0 the union of every rank's ``share`` (full CPU tensors; a key held by several ranks from the
    lowest), ``{}`` on the other ranks. See [Note: who sends what when consolidating]."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {k: (v.full_tensor().cpu() if isinstance(v, DTensor) else _plain(v)) for k, v in share.items()}
    rank = dist.get_rank()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(share))
    sender: dict[Hashable, int] = {}
    for r, keys in enumerate(everyone):
        for k in keys:
            sender.setdefault(k, r)
    mine = {}
    for k in sorted(share, key=repr):  # the same order on every rank of a DTensor's mesh
        v = share[k]
        if isinstance(v, DTensor):
            v = v.full_tensor()  # collective over the DTensor's mesh
        if sender[k] == rank:
            mine[k] = _plain(v)
    parts: list = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if rank != 0:
        return {}
    merged: dict[Hashable, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


__all__ = ["gather_share"]
