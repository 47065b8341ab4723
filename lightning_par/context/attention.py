"""Attention across a context-parallel group: each rank's queries against every rank's keys and values.

    >>> out = context_attention(q, k, v, is_causal=True, group=cp_group)    # doctest: +SKIP

``q``, ``k``, ``v`` are this rank's pieces ([Note: load-balanced causal sharding]) in SDPA's layout
``[..., heads, L, E]``; the result is this rank's piece of what ``F.scaled_dot_product_attention`` computes on the
whole sequence. Causal and bidirectional attention, grouped-query attention (``enable_gqa``, k/v with fewer heads),
boolean or additive masks over the whole sequence (query rows whole, or already this rank's, or broadcast; key
columns whole), float32 / bfloat16 inputs (computed in float32). ``dropout_p > 0`` is refused by name.

[Note: all-gather or ring]
Two ways to bring every rank's keys/values to every rank's queries, both written here over the same kernel
([Note: the fused kernels]; the figures below were measured with the earlier one, [Note: a kernel of our own]), and
measured on gloo with ``benchmarks/context_attention.py`` (one layer's op,
causal, float32, batch 1, 8 heads of 64, forward + backward, median of 5 steps with the methods interleaved, on a
2-core machine shared with other work; ``--seq 2048`` and ``--seq 2048 --kv-heads 2``):

    sequence 2048   k/v heads   cp   all-gather MB / ms    ring MB / ms
                    8           2    8.39 / 3267           16.78 / 2192
                    8           4   12.58 / 4290           20.97 / 2844
                    2           2    2.10 / 2053            4.19 / 1100
                    2           4    3.15 / 1147            5.24 /  753

Bytes (exact, counted by ``count_comm``, per rank and layer, ``kv`` = this rank's K and V): the all-gather sends
``(cp-1)·kv`` in forward and reduce-scatters the K/V gradients in backward, ``(cp-1)·kv``; the ring sends
``(cp-1)·kv`` in forward and ``(cp-1)·kv + cp·kv`` in backward (the K/V again, and their gradient accumulators,
which travel one hop further to reach their owner): 1.7-2× the all-gather's. Time: the ring was faster in every
row above (1.5-1.9×; the kernel in query chunks of 2^18 scores) and in 7 of 8 comparisons made before the chunks
(by 5-70%; the machine's noise is of that order too): its hops overlap with the block's compute
(``batch_isend_irecv`` runs on gloo's threads); why the all-gather is slower beyond that was not profiled.
Memory: the all-gather keeps the whole sequence's K/V per layer until backward (``cp·kv``: Llama 3's choice, cheap
with few k/v heads), the ring only its own (``kv``), which is what lets activation memory fall as ``1/cp``. On
gloo bytes between local processes are cheap and time and memory decide: the ring is the default
(``method="ring"``); ``method="allgather"`` sends half the bytes, for links where bytes cost more than the overlap
gains.

[Note: the fused kernels]
Each step of the ring (and each source's block of the all-gather) is one call of the backend's own attention kernel
that returns its log-sum-exp, reached through ``_compat.lse_attention`` / ``lse_attention_backward``: torch's CPU
flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``) on CPU, CUDA's flash
kernel (16-bit, no mask) or memory-efficient kernel (float32, or a mask) on CUDA, as torch's own context parallel
merges them. The load-balanced layout makes every block pair of causal attention one of three kinds, each a plain
kernel call (:func:`_pair`): the rank's own keys, causal (``is_causal=True``: both hold the same positions, in the
same order); an earlier rank's keys, of which only the first chunk is before any of this rank's queries, whole
(no mask); a later rank's keys, which only this rank's second chunk sees, whole (no mask) — the rest is skipped,
so no block computes scores the causal mask throws away. Bidirectional attention and a user's mask run every pair
whole, the mask's key columns taken at the source's positions (a boolean mask made additive, in the queries'
dtype, as the kernels take it); a row that a mask leaves without keys in one block gets log-sum-exp ``-inf`` there
(the CPU kernel reports 0) so that it merges away. Partial outputs merge in float32 by their log-sum-exp; each
block's backward takes the rows' *final* output and log-sum-exp, as flash attention's backward does. Grouped-query
attention: the CPU kernel takes fewer k/v heads itself; on CUDA they are repeated and their gradients summed back.
The present kernel ([Note: a kernel of our own]) is kept where the fused one does not serve the inputs
(``_compat.lse_attention_supported``): queries of other than 4 dimensions, a mask of more than 4, a device other
than CPU / CUDA, a dtype or (CUDA) head size above 256 the kernels do not take. Measured: the fused kernel on one
block runs at the speed of one device's SDPA (it is the same kernel), so a cp-2 rank's attention costs 0.51 × one
device's in forward and 0.52 × in backward at 2048 tokens (causal, batch 4, 8 heads of 32, CPU time, one thread).

[Note: one op for activation checkpointing]
Each method is one ``torch.library`` custom op (``lightning_par::context_attention_allgather`` / ``_ring``) whose
implementation holds the communication; its backward is registered with ``torch.library.register_autograd``. A
``TorchDispatchMode`` sees the op as a unit (its inside runs below the mode), so torch's selective checkpointing
with the policy of :mod:`lightning_par.memory.checkpointing` (which lists these ops as saved) keeps its outputs
from forward and replays them in recompute: no communication is repeated. Full checkpointing recomputes the op,
communication included, in the same block order on every rank (the backward order is the same on every rank).
The all-gather op returns the gathered K/V as outputs too (not differentiable), so that what its backward needs is
what checkpointing saves. :func:`lightning_par.comm.count_comm` enters these ops to count their collectives.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_par._compat import (lse_attention, lse_attention_backward, lse_attention_supported,
                                   resolve_process_group)
from lightning_par.context.kernel import NEG_INF, block_backward, block_bias, block_forward, merge
from lightning_par.context.sharding import local_positions

METHODS = ("ring", "allgather")  # the first is the default: [Note: all-gather or ring]


def _pack(k: Tensor, v: Tensor) -> Tensor:
    """``k``, ``v`` as one ``[L, n]`` buffer, sequence first (the layout the collectives cut along)."""
    return torch.cat([k.movedim(-2, 0).reshape(k.shape[-2], -1), v.movedim(-2, 0).reshape(v.shape[-2], -1)], 1)


def _unpack(buf: Tensor, k_shape, v_shape) -> tuple[Tensor, Tensor]:
    def shaped(part, shape):
        moved = (shape[-2], *shape[:-2], shape[-1])
        return part.reshape(buf.shape[0], *moved[1:]).movedim(0, -2)

    nk = math.prod(k_shape) // k_shape[-2]
    return shaped(buf[:, :nk], k_shape), shaped(buf[:, nk:], v_shape)


def _columns(mask: Optional[Tensor], pos: Tensor) -> Optional[Tensor]:
    return None if mask is None else mask.index_select(-1, pos)


def _group(name: str):
    group = resolve_process_group(name)
    return group, dist.get_world_size(group), dist.get_rank(group)


# ---- one block pair ---------------------------------------------------------------------------------------------

def _pair(rank: int, source: int, causal: bool, length: int):
    """(query rows, key rows, is_causal) of this rank's queries against ``source``'s keys, or None (nothing to
    attend): [Note: the fused kernels]."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if source == rank:
        return everything, everything, True
    if source < rank:
        return everything, slice(0, length // 2), False
    return slice(length // 2, None), everything, False


def _block_forward(q, k, v, mask, causal: bool, scale: float, groups: int):
    """(output float32, log-sum-exp) of ``q`` against one block of keys: the backend's fused kernel, or the present
    one where the fused kernel does not serve the inputs ([Note: the fused kernels])."""
    if lse_attention_supported(q, k, mask):
        out, lse = lse_attention(q, k, v, is_causal=causal, scale=scale, mask=mask)
        if mask is not None:  # a row with no key in this block: the kernel says lse 0, the merge needs -inf
            lse = lse.masked_fill(torch.isneginf(mask).all(-1), NEG_INF)
        return out.float(), lse
    rows = torch.arange(q.shape[-2], device=q.device)
    return block_forward(q, k, v, scale, block_bias(rows, rows, causal, mask), groups)


def _block_backward(dout, q, k, v, out, lse, mask, causal: bool, scale: float, groups: int):
    """(dq, dk, dv) of one block given the rows' final output and log-sum-exp."""
    if lse_attention_supported(q, k, mask):
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).contiguous()
        return lse_attention_backward(dout.contiguous(), q, k, v, out.contiguous(), safe, is_causal=causal,
                                      scale=scale, mask=mask)
    rows = torch.arange(q.shape[-2], device=q.device)
    return block_backward(q, k, v, scale, block_bias(rows, rows, causal, mask), out, lse, dout, groups)


def _merge_into(out, lse, rows, out_b, lse_b):
    if out is None:
        return out_b, lse_b
    if rows == slice(None):
        return merge(out, lse, out_b, lse_b)
    o, l_ = merge(out[..., rows, :], lse[..., rows], out_b, lse_b)
    out, lse = out.clone(), lse.clone()
    out[..., rows, :], lse[..., rows] = o, l_
    return out, lse


def _attend(q, k_b, v_b, mask, is_causal, scale, groups, rank, source, seq, cp, out, lse):
    """Merge ``q`` against ``source``'s keys into ``(out, lse)``."""
    qs, ks, causal = _pair(rank, source, is_causal, q.shape[-2])
    cols = _columns(mask, local_positions(seq, cp, source, q.device))
    o, l_ = _block_forward(q[..., qs, :], k_b[..., ks, :], v_b[..., ks, :], cols, causal, scale, groups)
    if out is None and qs != slice(None):  # the first block covers only some rows
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], NEG_INF, dtype=torch.float32, device=q.device)
    return _merge_into(out, lse, qs, o, l_)


def _attend_backward(dout, q, k_b, v_b, out, lse, mask, is_causal, scale, groups, rank, source, seq, cp, dq, dk, dv):
    """Add the gradients of ``q`` against ``source``'s keys to ``dq`` and to ``dk`` / ``dv`` (float32, that
    block's)."""
    qs, ks, causal = _pair(rank, source, is_causal, q.shape[-2])
    cols = _columns(mask, local_positions(seq, cp, source, q.device))
    dq_b, dk_b, dv_b = _block_backward(dout[..., qs, :], q[..., qs, :], k_b[..., ks, :], v_b[..., ks, :],
                                       out[..., qs, :], lse[..., qs], cols, causal, scale, groups)
    dq[..., qs, :] += dq_b
    dk[..., ks, :] += dk_b
    dv[..., ks, :] += dv_b


# ---- all-gather ------------------------------------------------------------------------------------------------

def _blocks(t: Tensor, cp: int):
    """The gathered ``t`` as its ``cp`` sources' blocks (views), in rank order."""
    return t.chunk(cp, dim=-2)


def _allgather_impl(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], is_causal: bool, scale: float,
                         groups: int, group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    group, cp, rank = _group(group_name)
    kv = _pack(k, v)
    everything = kv.new_empty((cp * kv.shape[0], kv.shape[1]))
    dist.all_gather_single(everything, kv, group=group)
    seq = everything.shape[0]
    k_all, v_all = _unpack(everything, (*k.shape[:-2], seq, k.shape[-1]), (*v.shape[:-2], seq, v.shape[-1]))
    out = lse = None
    for source, (k_b, v_b) in enumerate(zip(_blocks(k_all, cp), _blocks(v_all, cp))):
        out, lse = _attend(q, k_b, v_b, mask, is_causal, scale, groups, rank, source, seq, cp, out, lse)
    return out.to(q.dtype), lse, k_all.clone(), v_all.clone()  # outputs own their storage


_allgather_attention = torch.library.custom_op("lightning_par::context_attention_allgather", _allgather_impl,
                                               mutates_args=())


@_allgather_attention.register_fake
def _(q, k, v, mask, is_causal, scale, groups, group_name):
    cp = dist.get_world_size(resolve_process_group(group_name))
    seq = cp * k.shape[-2]
    return (q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32),
            k.new_empty((*k.shape[:-2], seq, k.shape[-1])), v.new_empty((*v.shape[:-2], seq, v.shape[-1])))


def _allgather_setup(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, groups, group_name = inputs
    out, lse, k_all, v_all = output
    ctx.save_for_backward(q, k_all, v_all, mask, out, lse)
    ctx.is_causal, ctx.scale, ctx.groups, ctx.group_name = is_causal, scale, groups, group_name
    ctx.k_dtype, ctx.v_dtype = k.dtype, v.dtype


def _allgather_backward(ctx, dout, dlse, dk_all, dv_all):
    q, k_all, v_all, mask, out, lse = ctx.saved_tensors
    group, cp, rank = _group(ctx.group_name)
    seq = k_all.shape[-2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k_all.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v_all.shape, dtype=torch.float32, device=q.device)
    for source, (k_b, v_b, dk_b, dv_b) in enumerate(zip(_blocks(k_all, cp), _blocks(v_all, cp), _blocks(dk, cp),
                                                        _blocks(dv, cp))):
        _attend_backward(dout, q, k_b, v_b, out, lse, mask, ctx.is_causal, ctx.scale, ctx.groups, rank, source, seq,
                         cp, dq, dk_b, dv_b)
    full = _pack(dk.to(ctx.k_dtype), dv.to(ctx.v_dtype)).contiguous()
    mine = full.new_empty((seq // cp, full.shape[1]))
    dist.reduce_scatter_single(mine, full, group=group)
    l_shape = lambda t: (*t.shape[:-2], seq // cp, t.shape[-1])  # noqa: E731
    dk, dv = _unpack(mine, l_shape(k_all), l_shape(v_all))
    return dq.to(q.dtype), dk, dv, None, None, None, None, None


_allgather_attention.register_autograd(_allgather_backward, setup_context=_allgather_setup)


# ---- ring ------------------------------------------------------------------------------------------------------

def _peers(group, cp: int, rank: int) -> tuple[int, int]:
    return dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)


def _exchange(group, send: Tensor, nxt: int, prv: int, tag: int):
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return recv, dist.batch_isend_irecv(ops)


def _flat(k: Tensor, v: Tensor) -> Tensor:
    """``k``, ``v`` as one flat buffer, each contiguous in its own layout (what the ring passes on whole)."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unflat(buf: Tensor, k_shape, v_shape) -> tuple[Tensor, Tensor]:
    nk = math.prod(k_shape)
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


def _ring_impl(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], is_causal: bool, scale: float,
                    groups: int, group_name: str) -> tuple[Tensor, Tensor]:
    group, cp, rank = _group(group_name)
    nxt, prv = _peers(group, cp, rank)
    seq = cp * q.shape[-2]
    kv, out, lse = _flat(k, v), None, None
    for step in range(cp):
        pending = _exchange(group, kv, nxt, prv, 0) if step < cp - 1 else None  # overlaps the block below
        k_b, v_b = _unflat(kv, k.shape, v.shape)
        out, lse = _attend(q, k_b, v_b, mask, is_causal, scale, groups, rank, (rank - step) % cp, seq, cp, out, lse)
        if pending is not None:
            for work in pending[1]:
                work.wait()
            kv = pending[0]
    return out.to(q.dtype), lse


_ring_attention = torch.library.custom_op("lightning_par::context_attention_ring", _ring_impl, mutates_args=())


@_ring_attention.register_fake
def _(q, k, v, mask, is_causal, scale, groups, group_name):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _ring_setup(ctx, inputs, output):
    q, k, v, mask, is_causal, scale, groups, group_name = inputs
    ctx.save_for_backward(q, k, v, mask, *output)
    ctx.is_causal, ctx.scale, ctx.groups, ctx.group_name = is_causal, scale, groups, group_name


def _ring_backward(ctx, dout, dlse):
    q, k, v, mask, out, lse = ctx.saved_tensors
    group, cp, rank = _group(ctx.group_name)
    nxt, prv = _peers(group, cp, rank)
    seq = cp * q.shape[-2]
    kv = _flat(k, v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # the gradients of the keys held now
    for step in range(cp):
        pending = _exchange(group, kv, nxt, prv, 0) if step < cp - 1 else None
        k_b, v_b = _unflat(kv, k.shape, v.shape)
        dk_b, dv_b = _unflat(dkv, k.shape, v.shape)
        _attend_backward(dout, q, k_b, v_b, out, lse, mask, ctx.is_causal, ctx.scale, ctx.groups, rank,
                         (rank - step) % cp, seq, cp, dq, dk_b, dv_b)
        dkv, moving = _exchange(group, dkv, nxt, prv, 1)  # one hop on, towards the keys' owner
        for work in moving + (pending[1] if pending is not None else []):
            work.wait()
        if pending is not None:
            kv = pending[0]
    dk, dv = _unflat(dkv, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


_ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup)

OPS = (torch.ops.lightning_par.context_attention_allgather.default,
       torch.ops.lightning_par.context_attention_ring.default)
IMPLEMENTATIONS = dict(zip(OPS, (_allgather_impl, _ring_impl)))  # what a dispatch mode may enter to see inside


# ---- the entry point -------------------------------------------------------------------------------------------

def _local_mask(mask: Optional[Tensor], q: Tensor, seq: int, cp: int, rank: int) -> Optional[Tensor]:
    """The mask with its query rows at this rank's positions (whole rows are cut, local or broadcast rows kept)."""
    if mask is None:
        return None
    if mask.requires_grad:
        raise ValueError(
            "Context-parallel attention takes masks that need no gradient; this attention mask requires grad (a "
            "learned additive bias, such as T5's relative position bias, is not supported under context "
            "parallelism). Run this model with context_parallel_size=1.")
    if mask.dim() < 2 or mask.shape[-1] != seq or mask.shape[-2] not in (1, q.shape[-2], seq):
        raise ValueError(
            f"Context-parallel attention needs masks over the whole sequence ({seq} keys, as the module computes "
            f"them before its blocks), with {seq}, {q.shape[-2]} (this rank's) or 1 query rows; got a mask of shape "
            f"{tuple(mask.shape)}. A mask built inside the blocks from the local length cannot be sliced.")
    if mask.shape[-2] == seq:
        mask = mask.index_select(-2, local_positions(seq, cp, rank, mask.device))
    if mask.dtype == torch.bool:  # additive, in the queries' dtype, as the fused kernels take it
        return torch.zeros(mask.shape, dtype=q.dtype, device=mask.device).masked_fill_(~mask, NEG_INF)
    return mask.to(q.dtype)


def context_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                      enable_gqa: bool = False, *, group, method: str = "ring") -> Tensor:
    """This rank's piece of SDPA over the whole sequence of ``group``; SDPA's arguments (see the module docstring,
    [Note: all-gather or ring] for ``method``)."""
    if method not in METHODS:
        raise ValueError(f"context attention `method={method!r}`: choose one of {METHODS}.")
    if dropout_p:
        raise ValueError(
            f"Context-parallel attention runs with dropout_p == 0 only; SDPA was called with dropout_p={dropout_p} "
            f"(training with attention dropout). Set the model's attention dropout to 0 (e.g. "
            f"`attention_dropout=0.0` in a Hugging Face config, `dropout=0.0` in the reference GPT).")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention takes `attn_mask` or `is_causal=True`, not both.")
    if query.shape[-2] != key.shape[-2] or key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"Context-parallel attention is self-attention over one sequence: queries, keys and values of one length "
            f"per rank; got {query.shape[-2]} queries against {key.shape[-2]} keys (cross-attention, or decoding "
            f"with a cache, is not sharded). Call the model with `use_cache=False`, or without context parallelism.")
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if heads != kv_heads and (not (enable_gqa or kv_heads == 1) or heads % kv_heads):  # one k/v head: broadcast
        raise ValueError(
            f"scaled_dot_product_attention got {heads} query heads and {kv_heads} key/value heads; that needs "
            f"`enable_gqa=True` and {kv_heads} dividing {heads} (or one key/value head, broadcast).")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = cp * query.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    mask = _local_mask(attn_mask, query, seq, cp, rank)
    op = _allgather_attention if method == "allgather" else _ring_attention
    return op(query, key.contiguous(), value.contiguous(), mask, bool(is_causal), scale, heads // kv_heads,
              group.group_name)[0]


__all__ = ["IMPLEMENTATIONS", "METHODS", "OPS", "context_attention"]
