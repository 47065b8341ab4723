"""Sharding rules DTensor lacks for attention.

``F.scaled_dot_product_attention`` on CPU dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``,
for which DTensor (torch 2.13) has no strategy. Attention is independent per head (dim 1 of
``(B, H, T, hd)``), so q, k, v, the output and the log-sum-exp may all be sharded by head, or all be
replicated; a mask, which broadcasts over heads, stays replicated. CUDA's
flash / memory-efficient kernels already have DTensor strategies and need nothing here.

A KV cache that starts empty (Hugging Face's ``DynamicLayer``: ``torch.cat([torch.tensor([]), keys],
dim=-2)``, which a model builds even in training unless called with ``use_cache=False``) concatenates a
legacy 1-D empty tensor, which ``cat`` skips, with head-sharded keys; torch's strategy tries to shard the
empty tensor like the keys and fails. The rule here lets the empty one stay replicated and the result
keep the keys' placement.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from lightning_par.tensor.rules import only_spec, wrap_strategy

_registered = False


def register_attention_rules() -> None:
    """Register the KV-cache and CPU flash-attention rules once per process (idempotent)."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten
    wrap_strategy(aten.cat.default, _cat_onto_empty)
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


def _cat_onto_empty(op_schema):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    args = op_schema.args_schema
    if not isinstance(args[0], TupleStrategy):
        return None
    children = args[0].children
    specs = [only_spec(c) for c in children]
    if any(s is None for s in specs):
        return None
    empty = [tuple(s.shape) == (0,) for s in specs]
    rest = [s for s, e in zip(specs, empty) if not e]
    if not any(empty) or not rest or any(s.placements != rest[0].placements for s in rest):
        return None
    placements, ndim = rest[0].placements, len(rest[0].shape)
    dim = (args[1] if len(args) > 1 else 0) % ndim
    if any(p.is_partial() or p.is_shard(dim) for p in placements):
        return None
    mesh = rest[0].mesh
    inputs = [DTensorSpec(mesh, (Replicate(),), tensor_meta=s.tensor_meta) if e else s for s, e in zip(specs, empty)]
    return OpStrategy([OpSpec(output_specs=DTensorSpec(mesh, placements), input_specs=tuple(inputs),
                              redistribute_cost=[generate_redistribute_costs(c, i) for c, i in zip(children, inputs)])])
