"""Attention across a context-parallel group (lightning_par.context) on real gloo ranks: every rank's piece of the
output and of the gradients of q, k, v equals one process's SDPA over the whole sequence (float32, 1e-5; bfloat16 at
the tolerance derived from its format), by the backend's fused kernel and by the present one, for causal
and bidirectional attention, grouped-query attention, boolean and additive masks, by all-gather and by ring; and
the bytes each rank sends per layer equal the formula of [Note: all-gather or ring]."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_par.comm import CommCounter, count_comm
from lightning_par.context import attention, context_attention, gather, shard
from harness import TIMEOUT_S, free_port, start_ranks

B, H, S, E = 2, 4, 16, 8

CASES = {  # name: (kv heads, sdpa keywords, a mask maker)
    "causal": (H, dict(is_causal=True), None),
    "bidirectional": (H, dict(), None),
    "gqa_causal": (2, dict(is_causal=True, enable_gqa=True), None),
    "one_kv_head_broadcast": (1, dict(is_causal=True), None),  # SDPA broadcasts one k/v head (Falcon's MQA)
    "bool_mask": (H, dict(), lambda g: (torch.rand(B, 1, S, S, generator=g) > 0.4) | torch.eye(S, dtype=torch.bool)),
    "additive_mask": (2, dict(enable_gqa=True), lambda g: torch.randn(B, H, S, S, generator=g)),
    "key_mask": (H, dict(), lambda g: torch.arange(S).expand(B, 1, 1, S) < torch.tensor([S, S - 5]).view(B, 1, 1, 1)),
}


# bfloat16 keeps 8 significant bits (a rounding is within 2^-8, relative). Against float32 SDPA on the same bfloat16
# inputs: the output is each block's bfloat16 output (rounded once, its probabilities once more) merged in float32
# and rounded once more: 3 x 2^-8. A gradient sums up to cp block gradients each rounded twice, then is rounded
# once: (2 cp + 1) x 2^-8; both relative to the largest entries (|x| ~ 4 here), hence the absolute part.
def _tol(dtype, cp, grad):
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    bound = ((2 * cp + 1) if grad else 3) * 2.0 ** -8
    return dict(atol=4 * bound, rtol=bound)


def _case(name, rank, cp, method, group, dtype=torch.float32):
    kv_heads, kw, make_mask = CASES[name]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, n, S, E, generator=g).to(dtype).float().requires_grad_() for n in (H, kv_heads, kv_heads))
    dout = torch.randn(B, H, S, E, generator=g).to(dtype).float()
    mask = make_mask(g) if make_mask else None
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype).float()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    ref.backward(dout)
    pieces = [shard(t.detach(), 2, cp, rank).to(dtype).requires_grad_() for t in (q, k, v)]
    local_mask = None if mask is None else (mask if mask.shape[-2] == 1 else shard(mask, 2, cp, rank))
    if local_mask is not None and local_mask.dtype != torch.bool:
        local_mask = local_mask.to(dtype)
    out = context_attention(*pieces, attn_mask=local_mask, group=group, method=method, **kw)
    assert out.dtype == dtype
    out.backward(shard(dout, 2, cp, rank).to(dtype))
    torch.testing.assert_close(gather(out.detach(), 2, group).float(), ref.detach(), **_tol(dtype, cp, False))
    for piece, full in zip(pieces, (q, k, v)):
        torch.testing.assert_close(piece.grad.float(), shard(full.grad, 2, cp, rank), **_tol(dtype, cp, True),
                                   msg=lambda m: f"{name} {method} cp{cp} {dtype}: {m}")


def _bytes(rank, cp, method, group):
    """Wire bytes per layer: forward (cp-1)·kv; backward (cp-1)·kv (all-gather) or (2cp-1)·kv (ring)."""
    q, k, v = (torch.randn(B, n, S // cp, E, requires_grad=True) for n in (H, 2, 2))
    kv = (k.numel() + v.numel()) * 4
    counter = CommCounter()
    with count_comm(counter):
        out = context_attention(q, k, v, is_causal=True, enable_gqa=True, group=group, method=method)
        forward = counter.wire_bytes
        out.sum().backward()
    backward = counter.wire_bytes - forward
    assert forward == (cp - 1) * kv, (method, forward, kv)
    assert backward == ((cp - 1) * kv if method == "allgather" else (2 * cp - 1) * kv), (method, backward, kv)


def _worker(rank, cp, port):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", rank=rank, world_size=cp, init_method=f"tcp://127.0.0.1:{port}")
    try:
        group = dist.new_group(list(range(cp)))
        for method in ("allgather", "ring"):
            for name in CASES:
                _case(name, rank, cp, method, group)
                _case(name, rank, cp, method, group, torch.bfloat16)
            _bytes(rank, cp, method, group)
        # the present kernel, where the fused one does not serve the inputs ([Note: the fused kernels])
        attention.lse_attention_supported = lambda q, k, mask: False
        for name in CASES:
            _case(name, rank, cp, "ring", group)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("cp", [2, 4])
def test_context_attention_equals_sdpa_on_the_whole_sequence(cp):
    start_ranks(_worker, (cp, free_port()), nprocs=cp)
