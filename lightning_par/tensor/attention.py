"""Sharding rules DTensor lacks for attention.

``F.scaled_dot_product_attention`` on CPU dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``,
for which DTensor (torch 2.13) has no strategy. Attention is independent per head (dim 1 of
``(B, H, T, hd)``), so q, k, v, the output and the log-sum-exp may all be sharded by head, or all be
replicated; a mask that broadcasts over heads (size 1 there) stays replicated, one with a head dim (T5's
position bias, ``(B, H, T, S)``) must be split by head with q, k and v. DTensor never redistributes keyword
arguments (``attn_mask`` is one), so the split option is offered only for a mask already in that layout
(:mod:`.parallelize` splits a replicated one before the call); else q, k and v are gathered. CUDA's
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

    def options(n_out: int, n_in: int, mask):
        # kwarg tensors (attn_mask) come after the positional ones; non-tensor args are None
        split = _head_split_mask(mask)
        if mask is None or tuple(mask.placements) == (Replicate(),):
            yield [Replicate()] * n_out, [Replicate()] * n_in + [None, None] + ([Replicate()] if mask is not None else [])
        if split is not None:
            yield [Shard(1)] * n_out, [Shard(1)] * n_in + [None, None] + split  # split by head

    @register_sharding(fwd.default)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        return list(options(2, 3, attn_mask))

    @register_sharding(bwd.default)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
        return list(options(3, 6, attn_mask))

    _registered = True


def head_dim_of_mask(shape) -> int | None:
    """The dim of an attention mask that lines up with the heads of ``(B, H, T, S)`` (masks broadcast from the
    right), or ``None`` when the mask has no such dim or size 1 there (it broadcasts over heads)."""
    return len(shape) - 3 if len(shape) >= 3 and shape[-3] > 1 else None


def _head_split_mask(mask) -> list | None:
    """The mask's placement when q, k and v are split by head: ``[]`` without a mask, ``[Replicate()]`` for one
    that broadcasts over heads, ``[Shard(d)]`` for one already split on its head dim ``d``; ``None``: the mask
    has a head dim but is not split on it (a keyword argument is never redistributed, see above).

    Example::

        >>> from types import SimpleNamespace as Spec
        >>> _head_split_mask(Spec(shape=(1, 4, 16, 16), placements=(Shard(1),)))
        [Shard(dim=1)]
        >>> _head_split_mask(Spec(shape=(2, 1, 16, 16), placements=(Replicate(),)))
        [Replicate()]
        >>> _head_split_mask(Spec(shape=(1, 4, 16, 16), placements=(Replicate(),))) is None
        True
    """
    if mask is None:
        return []
    d = head_dim_of_mask(tuple(mask.shape))
    placements = tuple(mask.placements)
    if d is None:
        return [Replicate()] if placements == (Replicate(),) else None
    return [Shard(d)] if placements == (Shard(d),) else None


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


class SplitAttentionMasks(torch.overrides.TorchFunctionMode):
    """Active while a region runs (:class:`~lightning_par.tensor.parallelize.PrepareBlockInput`): before
    ``F.scaled_dot_product_attention`` with head-split q, a mask with a head dim (T5's position bias, a plain
    tensor the region built or a replicated DTensor) is split by head too, differentiably, so the kernel runs on
    each rank's heads (see the top of this module: DTensor would not split it, a keyword argument)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            args, kwargs = _split_mask(list(args), kwargs)
        return func(*args, **kwargs)


def _split_mask(args: list, kwargs: dict):
    from torch.distributed.tensor import DTensor

    query = args[0] if args else kwargs.get("query")
    in_args = len(args) > 3
    mask = args[3] if in_args else kwargs.get("attn_mask")
    if not isinstance(query, DTensor) or tuple(query.placements) != (Shard(1),) or not isinstance(mask, torch.Tensor):
        return args, kwargs
    d = head_dim_of_mask(tuple(mask.shape))
    if d is None or (isinstance(mask, DTensor) and tuple(mask.placements) == (Shard(d),)):
        return args, kwargs
    if not isinstance(mask, DTensor):
        mask = DTensor.from_local(mask, query.device_mesh, (Replicate(),), run_check=False)
    if tuple(mask.placements) != (Replicate(),):
        return args, kwargs  # some other layout: left to the rule (which then gathers)
    mask = mask.redistribute(query.device_mesh, (Shard(d),))
    if in_args:
        args[3] = mask
    else:
        kwargs["attn_mask"] = mask
    return args, kwargs
