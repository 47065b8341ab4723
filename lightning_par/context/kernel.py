"""Attention of a rank's queries against one block of keys/values, with its log-sum-exp, and its backward: the
fallback where the backend's fused kernel does not serve the inputs ([Note: the fused kernels] in
:mod:`lightning_par.context.attention`).

[Note: a kernel of our own]
Attention across a context-parallel group computes each rank's queries against keys/values that arrive in pieces,
and merges partial outputs by their log-sum-exp; its backward needs that log-sum-exp too. Torch's public
``scaled_dot_product_attention`` returns neither, and torch's context parallel dispatches only the CUDA flash /
efficient / cuDNN kernels (the CPU kernel is not in its dispatch). So the block is the math formulation written out
(``softmax(q kᵀ · scale + bias) v``), in float32 whatever the inputs' dtype, and its backward is the flash-attention
backward (probabilities recomputed from the saved log-sum-exp, never kept between forward and backward). Positions
are global: the bias of a block comes from the queries' and keys' positions in the whole sequence (causal) and
from the user's mask, whose key columns are taken at the keys' positions. A row with no key to attend to gets
log-sum-exp ``-inf`` and output 0, and merges away. The queries run in chunks of :data:`ROWS` rows, as a flash
kernel's blocks do, each of at most :data:`SCORES` scores (batch × heads × rows × keys): those of one chunk are the
only ``L × Lk`` temporaries, so the kernel's transient memory does not grow with the square of the local length
(measured at a sequence of 512 over two ranks: the step's peak was 0.99 × one device's without chunks, 0.69 × with
chunks of 2^18 scores, 0.60 × with 2^16).
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")
SCORES = 1 << 16  # float32 scores per chunk (256 KiB): the query rows of a chunk (see the module docstring)


def block_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
               mask: torch.Tensor | None) -> torch.Tensor | None:
    """The additive float32 bias of queries at ``q_pos`` against keys at ``k_pos``: ``-inf`` where the causal mask
    (key after query) or a boolean ``mask`` (False) forbids, plus a float ``mask``'s values. ``mask``: the user's
    mask with its key dimension (last) already at ``k_pos`` and its query dimension (−2) at ``q_pos`` or 1."""
    bias = None
    if causal:
        bias = torch.zeros((len(q_pos), len(k_pos)), dtype=torch.float32, device=q_pos.device)
        bias.masked_fill_(k_pos[None, :] > q_pos[:, None], NEG_INF)
    if mask is not None:
        if mask.dtype == torch.bool:
            extra = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, NEG_INF)
        else:
            extra = mask.float()
        bias = extra if bias is None else bias + extra
    return bias


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def _reduce(dkv: torch.Tensor, groups: int) -> torch.Tensor:
    return dkv if groups == 1 else dkv.unflatten(-3, (dkv.shape[-3] // groups, groups)).sum(-3)


def _scores(q, k, scale, bias):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return s if bias is None else s + bias


def _probs(s, lse):
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe.unsqueeze(-1))


def _chunks(q, k, rows):
    """Query row ranges of at most :data:`SCORES` scores each (``rows``: a fixed number of rows instead)."""
    length = q.shape[-2]
    if rows is None:
        rows = max(1, SCORES // max(1, q[..., 0, 0].numel() * k.shape[-2]))
    return [(lo, min(lo + rows, length)) for lo in range(0, length, rows)]


def _rows(bias, lo: int, hi: int):
    """The bias of query rows ``lo:hi`` (a bias broadcast over the queries as it is)."""
    return bias if bias is None or bias.shape[-2] == 1 else bias[..., lo:hi, :]


def block_forward(q, k, v, scale: float, bias, groups: int = 1, rows: int | None = None):
    """Output (float32) and log-sum-exp of queries ``q`` [..., H, Lq, E] against ``k``/``v`` [..., H/groups, Lk, E]."""
    k, v = _expand(k, groups).float(), _expand(v, groups).float()
    outs, lses = [], []
    for lo, hi in _chunks(q, k, rows):
        s = _scores(q[..., lo:hi, :], k, scale, _rows(bias, lo, hi))
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(_probs(s, lse), v))
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def merge(out, lse, out_b, lse_b):
    """The attention over the union of two disjoint key sets from the two partial results (float32)."""
    if out is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w, w_b = torch.exp(lse - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    return out * w + out_b * w_b, new


def block_backward(q, k, v, scale: float, bias, out, lse, dout, groups: int = 1, rows: int | None = None):
    """Gradients (float32) of ``q``, ``k``, ``v`` for one key block, given the *final* output and log-sum-exp of
    the queries over all keys ([Note: a kernel of our own])."""
    ke, ve = _expand(k, groups).float(), _expand(v, groups).float()
    dqs, dk, dv = [], None, None
    for lo, hi in _chunks(q, k, rows):
        qc, doc = q[..., lo:hi, :].float(), dout[..., lo:hi, :].float()
        p = _probs(_scores(qc, ke, scale, _rows(bias, lo, hi)), lse[..., lo:hi])
        dv_c = torch.matmul(p.transpose(-1, -2), doc)
        delta = (doc * out[..., lo:hi, :].float()).sum(-1, keepdim=True)
        ds = p * (torch.matmul(doc, ve.transpose(-1, -2)) - delta)
        dqs.append(torch.matmul(ds, ke) * scale)
        dk_c = torch.matmul(ds.transpose(-1, -2), qc) * scale
        dk, dv = (dk_c, dv_c) if dk is None else (dk + dk_c, dv + dv_c)
    return torch.cat(dqs, -2), _reduce(dk, groups), _reduce(dv, groups)


__all__ = ["block_backward", "block_bias", "block_forward", "merge"]
