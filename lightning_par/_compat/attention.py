"""Private torch and transformers APIs of context parallelism: the backend's attention kernels that return their
log-sum-exp, and Hugging Face's attention interface (part of :mod:`lightning_par._compat`, which re-exports them)."""
from __future__ import annotations

from typing import Optional

import torch


# -- context parallel: the backend's fused attention kernels that return their log-sum-exp ---------------------
# torch's public SDPA returns no log-sum-exp; these private aten ops do (torch's own context parallel merges their
# outputs the same way). Inputs [B, H, L, E] (k/v may have fewer heads on CPU), ``mask``: None or an additive mask
# of q's dtype broadcastable to [B, H, Lq, Lk]; ``is_causal`` with Lq == Lk. Outputs: (out in q's dtype,
# log-sum-exp float32 [B, H, Lq]); the backward takes the *final* out and log-sum-exp of the rows.
def lse_attention_supported(q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether :func:`lse_attention` serves these inputs (else the caller's own kernel)."""
    if q.dim() != 4 or (mask is not None and mask.dim() > 4):
        return False
    if q.device.type == "cpu":
        return q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if q.device.type == "cuda":
        return q.dtype in (torch.float32, torch.bfloat16, torch.float16) and q.shape[-1] <= 256
    return False


def _cuda_kv(q, k, v):
    """CUDA's flash / efficient kernels take as many k/v heads as query heads."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _cuda_flash(q, mask) -> bool:
    return mask is None and q.dtype in (torch.float16, torch.bfloat16)


def _cuda_bias(mask, q, k):
    """The efficient kernel's bias: [B, H, Lq, Lk] with its rows' stride a multiple of 16 (as torch's SDPA pads)."""
    if mask is None:
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    pad = -k.shape[2] % 16
    bias = mask.new_empty((*shape[:-1], shape[-1] + pad))[..., :shape[-1]]
    bias.copy_(mask.expand(shape))
    return bias


def lse_attention(q, k, v, *, is_causal: bool, scale: float, mask=None):
    """(output, float32 log-sum-exp) of one block of attention by the backend's fused kernel."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask,
                                                                    scale=scale)
        return out, lse.float()
    k, v = _cuda_kv(q, k, v)
    if _cuda_flash(q, mask):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, _cuda_bias(mask, q, k), True, 0.0,
                                                                is_causal, scale=scale)[:2]
    return out, lse[..., :q.shape[2]].float()  # the efficient kernel pads its log-sum-exp's rows to 32


def lse_attention_backward(dout, q, k, v, out, lse, *, is_causal: bool, scale: float, mask=None):
    """(dq, dk, dv) of one block, given the rows' final ``out`` and ``lse`` (float32, no -inf)."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)[:3]
    kv_heads = k.shape[1]
    ke, ve = _cuda_kv(q, k, v)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # unused at dropout 0
    if _cuda_flash(q, mask):
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, is_causal, seed, seed,
            scale=scale)[:3]
    else:
        padded = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32)).contiguous()
        dq, dk, dv = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, _cuda_bias(mask, q, ke), out, padded, seed, seed, 0.0, [True, True, True, False],
            is_causal, scale=scale)[:3]
    if dk.shape[1] != kv_heads:
        groups = dk.shape[1] // kv_heads
        dk = dk.unflatten(1, (kv_heads, groups)).sum(2)
        dv = dv.unflatten(1, (kv_heads, groups)).sum(2)
    return dq, dk, dv


# -- context parallel (Ulysses): Hugging Face's attention interface --------------------------------------------
# A Hugging Face attention module calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
# eager_attention_forward)``; Ulysses registers one function of its own there and names it in the config while a
# block runs (transformers' documented way to plug an attention in), then calls the module's own implementation.
def hf_register_attention(name: str, fn) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)


def hf_set_attention_implementation(config, name: str) -> None:
    config._attn_implementation = name


def hf_attention_function(module, implementation: str):
    """The function a Hugging Face attention ``module`` calls for ``implementation`` (its modeling file's
    ``eager_attention_forward`` for "eager": soft-capping, sinks and dropout as the family writes them)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if implementation == "eager":
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)
