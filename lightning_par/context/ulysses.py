"""Ulysses: the module's own attention on whole sequences for this rank's share of the heads.

    >>> with UlyssesRoute(group):                                                # doctest: +SKIP
    ...     y = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # q, k, v: this rank's positions

[Note: Ulysses]
The ring and the all-gather compute attention themselves, so they serve only the attention they can compute (SDPA).
Ulysses (DeepSpeed's, Hugging Face's context_parallel.py) leaves the attention to the module: before it, an
all-to-all turns q, k and v from sequence-sharded ``[B, H, L/cp, E]`` (all heads, this rank's positions) into
head-sharded ``[B, H/cp, L, E]`` (this rank's heads, every position), the module's attention runs as on one device,
and an all-to-all turns its output back. Heads are independent, so the result is one device's for those heads.

- What it wraps: ``F.scaled_dot_product_attention`` where a module calls it itself (a ``TorchFunctionMode``, as
  [Note: routing SDPA]), and Hugging Face's attention interface: while a block runs, the config of its attention
  modules names an implementation registered here (transformers' ``AttentionInterface.register``), which wraps the
  module's own implementation (its ``eager_attention_forward`` with soft-capping, sinks or a sliding window, or
  SDPA, or any other registered one). A call through neither (Bloom's ALiBi added with ``baddbmm``, a module's own
  ``softmax(q kᵀ) v``) is not seen: the setup check refuses it ([Note: the setup check of context parallelism]).
- The order of the sequence: the pieces arrive in rank order, which the load-balanced layout ([Note:
  load-balanced causal sharding]) makes chunks ``0, 2cp-1, 1, 2cp-2, ...``; they are put back in natural order
  before the attention runs, so the module's causal, sliding-window or padding mask (computed on the whole
  sequence before the blocks and not cut under Ulysses) applies as on one device, and in rank order after.
- Heads: the query heads must divide by cp (refused by name). Key/value heads are split the same way when cp
  divides them; else (fewer than cp, or not a multiple) they are repeated to ``lcm(kv, cp)`` heads first, as
  DeepSpeed's Ulysses does, which keeps each query head with its own key/value head (the module's
  ``num_key_value_groups`` is set to match while its attention runs, and restored).
- Bytes per rank and layer: 4 all-to-alls of ``(cp-1)/cp`` of q, k, v and the output in forward, the same in
  backward; each rank holds the whole sequence's q, k, v for ``H/cp`` heads while its attention runs.
- Under tensor parallelism q, k, v are DTensors sharded by head: the local heads go through the all-to-all and
  the output takes their layout back ([Note: DTensor attention]).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from lightning_par._compat import (attn_implementation, hf_attention_function, hf_register_attention,
                                   hf_set_attention_implementation)
from lightning_par.context.sharding import group_positions

NAME = "lightning_par_ulysses"  # the implementation registered in Hugging Face's attention interface
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_ACTIVE: list = []  # the routes entered, innermost last (the registered function serves the innermost)


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``scatter`` into cp parts, part ``j`` to rank ``j``; what arrives concatenated along
    ``gather`` in rank order. Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter: int, gather: int):
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _all_to_all(x, group, scatter: int, gather: int):
    cp = dist.get_world_size(group)
    send = torch.stack([p.contiguous() for p in x.chunk(cp, scatter)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


def _natural(seq: int, cp: int, device) -> torch.Tensor:
    order = torch.empty(seq, dtype=torch.long, device=device)
    order[group_positions(seq, cp, device)] = torch.arange(seq, device=device)
    return order


def to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., H, L/cp, E]`` (this rank's positions) -> ``[..., H/cp, L, E]`` (this rank's heads, natural order)."""
    y = _AllToAll.apply(x, group, x.dim() - 3, x.dim() - 2)
    return y.index_select(-2, _natural(y.shape[-2], dist.get_world_size(group), y.device))


def to_positions(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`to_heads`."""
    cp = dist.get_world_size(group)
    y = y.index_select(-2, group_positions(y.shape[-2], cp, y.device))
    return _AllToAll.apply(y, group, y.dim() - 2, y.dim() - 3)


def _kv_repeat(heads: int, kv_heads: int, cp: int, where: str) -> int:
    """How many times each key/value head is repeated so that cp divides them ([Note: Ulysses])."""
    if heads % cp:
        raise ValueError(
            f"Ulysses context parallelism splits the attention heads over the {cp} ranks of the group, and {where} "
            f"has {heads} query heads, which {cp} does not divide. Use a context_parallel_size that divides {heads}, "
            f"or context_parallel_method='ring'.")
    if kv_heads == 1 or kv_heads % cp == 0:
        return 1 if kv_heads % cp == 0 else cp
    return (kv_heads * cp // math.gcd(kv_heads, cp)) // kv_heads


def _heads_of_mask(mask, heads: int, group):
    """A mask with a head dimension of ``heads`` cut to this rank's heads; one broadcast over heads kept."""
    if mask is None or mask.dim() < 3 or mask.shape[-3] != heads or heads == 1:
        return mask
    return mask.chunk(dist.get_world_size(group), -3)[dist.get_rank(group)]


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class UlyssesRoute(TorchFunctionMode):
    """Entered while a block runs: routes its SDPA calls and its Hugging Face attention modules' calls through
    Ulysses over ``group`` ([Note: Ulysses]); ``configs``: the configs of the block's Hugging Face attention
    modules; ``calls``: how many attention calls it served since entered."""

    def __init__(self, group, configs=()):
        super().__init__()
        self.group, self.calls, self._inside = group, 0, False
        self._configs = list(configs)
        self._original: dict = {}

    def __enter__(self):
        register()
        for config in self._configs:
            self._original[id(config)] = attn_implementation(config)
            hf_set_attention_implementation(config, NAME)
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if _ACTIVE and _ACTIVE[-1] is self:
                _ACTIVE.pop()
            for config in self._configs:
                hf_set_attention_implementation(config, self._original.pop(id(config)))

    @contextlib.contextmanager
    def _own(self):
        """The wrapped attention runs: its own SDPA call is not routed again."""
        inside, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = inside

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self._inside:
            return func(*args, **kwargs)
        self.calls += 1
        named = dict(zip(_SDPA_NAMES, args), **kwargs)
        q, k, v = named.pop("query"), named.pop("key"), named.pop("value")
        layout = (q.device_mesh, q.placements) if isinstance(q, DTensor) else None
        q, k, v = _local(q), _local(k), _local(v)
        rep = _kv_repeat(q.shape[-3], k.shape[-3], dist.get_world_size(self.group), "F.scaled_dot_product_attention")
        if rep > 1:
            k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        mask = _heads_of_mask(_local(named.pop("attn_mask", None)), q.shape[-3], self.group)
        qh, kh, vh = (to_heads(t, self.group) for t in (q, k, v))
        gqa = bool(named.pop("enable_gqa", False)) or kh.shape[-3] not in (1, qh.shape[-3])
        with self._own():
            out = func(qh, kh, vh, attn_mask=mask, enable_gqa=gqa, **named) if gqa else \
                func(qh, kh, vh, attn_mask=mask, **named)
        out = to_positions(out, self.group)
        return out if layout is None else DTensor.from_local(out, *layout, run_check=False)


def _hf_ulysses(module, query, key, value, attention_mask, **kwargs):
    """The implementation registered in Hugging Face's attention interface ([Note: Ulysses])."""
    route = _ACTIVE[-1]
    original = route._original.get(id(module.config))
    fn = hf_attention_function(module, original)
    route.calls += 1
    layout = (query.device_mesh, query.placements) if isinstance(query, DTensor) else None
    q, k, v = _local(query), _local(key), _local(value)
    cp = dist.get_world_size(route.group)
    rep = _kv_repeat(q.shape[1], k.shape[1], cp, f"`{type(module).__name__}`")
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = _heads_of_mask(_local(attention_mask), q.shape[1], route.group)
    qh, kh, vh = (to_heads(t, route.group) for t in (q, k, v))
    groups = qh.shape[1] // kh.shape[1]
    saved = getattr(module, "num_key_value_groups", None)
    try:
        if saved is not None:
            module.num_key_value_groups = groups
        with route._own():
            out, _ = fn(module, qh, kh, vh, mask, **kwargs)  # [B, L, H/cp, E]
    finally:
        if saved is not None:
            module.num_key_value_groups = saved
    out = to_positions(out.transpose(1, 2), route.group).transpose(1, 2)
    if layout is not None:
        placements = tuple(Shard(2) if p == Shard(1) else p for p in layout[1])
        out = DTensor.from_local(out, layout[0], placements, run_check=False)
    return out, None


_registered = False


def register() -> None:
    """Register :data:`NAME` in Hugging Face's attention interface, once (nothing without transformers)."""
    global _registered
    if _registered:
        return
    try:
        hf_register_attention(NAME, _hf_ulysses)
    except ImportError:
        pass
    _registered = True


__all__ = ["NAME", "UlyssesRoute", "register", "to_heads", "to_positions"]
