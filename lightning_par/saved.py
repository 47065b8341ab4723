"""One meter of the tensors autograd saves for backward, for the stage runtime (activations per micro-batch),
:class:`~lightning_par.callbacks.ParallelMetrics` (peak bytes alive in a step) and the advisor's probe (bytes
per block).

Every saved tensor is keyed by its storage (a DTensor by its local shard's), so views of one storage count
once, and parameters (weights saved by matmuls) are not counted. A saved tensor stays alive until autograd
frees it after its backward (a weakref finalizer sees it go), so :attr:`SavedTensorMeter.peak` is the most
bytes alive at once, what a schedule's activation memory is (GPipe: every micro-batch; 1F1B: at most p).
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch

from lightning_par._compat import local_tensor


def saved_storage(t: torch.Tensor) -> Optional[tuple[tuple[int, str], int]]:
    """``(key, bytes)`` of the storage behind ``t`` (a DTensor's local shard), or None for a tensor
    without a real storage. Tensors that share a storage share the key, so each is counted once."""
    local = local_tensor(t)  # to_local() would record an autograd op inside a pack hook
    try:
        storage = local.untyped_storage()
        return (storage.data_ptr(), local.device.type), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def parameter_storages(params: Iterable[torch.Tensor]) -> set[tuple[int, str]]:
    """Keys of the storages of ``params``: tensors saved for backward that are weights."""
    return {s[0] for p in params if (s := saved_storage(p)) is not None}


class SavedTensorMeter:
    """Counts what autograd saves while :meth:`track` is active: ``total`` bytes, ``by_tag`` bytes per tag
    (the active :attr:`tag`: a micro-batch, a block), ``by_width`` bytes per element size, and ``peak`` bytes
    alive at once. ``params`` (the module's parameters) are not counted. With ``keep_keys``, :attr:`keys` maps
    each tag to the storages saved under it and their bytes (the advisor's probe sorts them)."""

    def __init__(self, params: Iterable[torch.Tensor], keep_keys: bool = False):
        self.params = parameter_storages(params)
        self.keys: dict[Any, dict[tuple[int, str], int]] | None = {} if keep_keys else None
        self.tag: Any = None
        self.total = self.peak = self.live_bytes = 0
        self.by_tag: dict[Any, int] = {}
        self.by_width: dict[int, int] = {}
        self._live: dict[tuple[int, str], int] = {}

    def track(self, tag: Any = None):
        """A context that counts what autograd saves inside it (under ``tag``, if given)."""
        if tag is not None:
            self.tag = tag
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _release(self, key: tuple[int, str]) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        found = saved_storage(t)
        if found is None:
            return t
        key, nbytes = found
        if key not in self.params and key not in self._live:
            self._live[key] = nbytes
            self.total += nbytes
            self.by_tag[self.tag] = self.by_tag.get(self.tag, 0) + nbytes
            self.by_width[t.element_size()] = self.by_width.get(t.element_size(), 0) + nbytes
            if self.keys is not None:
                self.keys.setdefault(self.tag, {})[key] = nbytes
            self.live_bytes += nbytes
            self.peak = max(self.peak, self.live_bytes)
            weakref.finalize(t, self._release, key)
        return t
