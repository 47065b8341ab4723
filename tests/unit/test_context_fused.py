"""The backend's fused attention kernel on one block pair (lightning_par.context.attention, [Note: the fused
kernels]) against the present kernel (lightning_par.context.kernel) and one device's SDPA: output, log-sum-exp and
the q/k/v gradients; causal, bidirectional, masked (boolean, additive, a row with no key) and grouped-query; float32
and bfloat16."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_par._compat import lse_attention_supported
from lightning_par.context.attention import _block_backward, _block_forward, _pair
from lightning_par.context.kernel import NEG_INF, block_backward, block_bias, block_forward

B, H, S, E = 2, 4, 12, 8
# bfloat16 keeps 8 significant bits: a value rounded once is within 2^-8 of it (relative). The fused kernel rounds its
# output (and its block gradients) to bfloat16 once, and its probabilities once more before the product with the
# values, so its results are within 2 x 2^-8 of the float32 kernel's on the same bfloat16 inputs, relative to their
# size; the absolute part covers entries near zero at the scale of the largest (|x| ~ 4 here).
BF16_TOL = dict(atol=4 * 2 * 2.0 ** -8, rtol=2 * 2.0 ** -8)
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(kind, dtype):
    g = torch.Generator().manual_seed(3)
    kv = 2 if kind == "gqa" else H
    q, k, v = (torch.randn(B, n, S, E, generator=g).to(dtype) for n in (H, kv, kv))
    mask = None
    if kind == "bool":  # the first row sees no key: its log-sum-exp is -inf and its output 0
        allowed = torch.rand(B, 1, S, S, generator=g) > 0.4
        allowed[..., 0, :] = False
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, NEG_INF)
    elif kind == "additive":
        mask = torch.randn(B, H, S, S, generator=g).to(dtype)
    return q, k, v, mask, kind in ("causal", "gqa"), H // kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["causal", "full", "bool", "additive", "gqa"])
def test_the_fused_kernel_equals_the_present_one(kind, dtype):
    q, k, v, mask, causal, groups = _inputs(kind, dtype)
    assert lse_attention_supported(q, k, mask)  # the fused kernel serves these inputs on CPU
    scale = 1 / math.sqrt(E)
    out, lse = _block_forward(q, k, v, mask, causal, scale, groups)
    pos = torch.arange(S)
    bias = block_bias(pos, pos, causal, None if mask is None else mask.float())
    ref_out, ref_lse = block_forward(q.float(), k.float(), v.float(), scale, bias, groups)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    grads = _block_backward(dout, q, k, v, out.to(dtype), lse, mask, causal, scale, groups)
    ref = block_backward(q.float(), k.float(), v.float(), scale, bias, ref_out, ref_lse, dout.float(), groups)
    for name, mine, theirs in zip("qkv", grads, ref):
        torch.testing.assert_close(mine.float(), theirs, **tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("kind", ["causal", "full", "additive", "gqa"])
def test_the_fused_kernel_equals_sdpa_on_one_device(kind):
    q, k, v, mask, causal, groups = _inputs(kind, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=groups > 1)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    out, lse = _block_forward(q.detach(), k.detach(), v.detach(), mask, causal, 1 / math.sqrt(E), groups)
    torch.testing.assert_close(out, ref.detach(), **FP32_TOL)
    grads = _block_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, mask, causal, 1 / math.sqrt(E), groups)
    for mine, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(mine, t.grad, **FP32_TOL)


def test_every_block_pair_of_the_load_balanced_layout_is_causal_whole_or_skipped():
    """Rank r holds chunks r and 2cp-1-r; against source s's keys its queries see: (s == r) its own keys causally,
    (s < r) the source's first chunk whole, (s > r) nothing from its first chunk, all of the source from its second."""
    every = slice(None)
    assert _pair(1, 1, True, 8) == (every, every, True)
    assert _pair(1, 0, True, 8) == (every, slice(0, 4), False)
    assert _pair(0, 1, True, 8) == (slice(4, None), every, False)
    assert _pair(0, 1, False, 8) == (every, every, False)
    # checked against the positions themselves at cp 4
    from lightning_par.context.sharding import local_positions
    for r in range(4):
        for s in range(4):
            qp, kp = local_positions(64, 4, r), local_positions(64, 4, s)
            qs, ks, causal = _pair(r, s, True, 16)
            allowed = kp[None, :] <= qp[:, None]
            inside = torch.zeros_like(allowed)
            inside[qs, ks] = torch.ones(16, 16, dtype=torch.bool).tril() if causal else True
            assert torch.equal(allowed, inside), (r, s)
