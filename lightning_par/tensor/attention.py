"""Sharding rules DTensor lacks for attention kernels.

``F.scaled_dot_product_attention`` on CPU dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``,
for which DTensor (torch 2.13) has no strategy. Attention is independent per head (dim 1 of
``(B, H, T, hd)``), so q, k, v, the output and the log-sum-exp may all be sharded by head, or all be
replicated; a mask, which broadcasts over heads, stays replicated. CUDA's
flash / memory-efficient kernels already have DTensor strategies and need nothing here.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

_registered = False


def register_attention_rules() -> None:
    """Register the CPU flash-attention rules once per process (idempotent)."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is None or bwd is None:  # a torch build without the CPU kernel
        _registered = True
        return

    def options(n_out: int, n_in: int, mask: bool):
        # kwarg tensors (attn_mask) come after the positional ones; non-tensor args are None
        tail = [Replicate()] if mask else []
        yield [Replicate()] * n_out, [Replicate()] * n_in + [None, None] + tail
        yield [Shard(1)] * n_out, [Shard(1)] * n_in + [None, None] + tail  # split by head

    @register_sharding(fwd.default)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        return list(options(2, 3, attn_mask is not None))

    @register_sharding(bwd.default)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
        return list(options(3, 6, attn_mask is not None))

    _registered = True
