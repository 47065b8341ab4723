"""Load-balanced sharding of a sequence over a context-parallel group, and gathering it back.

[Note: load-balanced causal sharding]
Under causal attention, query ``t`` attends to ``t + 1`` keys: cutting the sequence into ``cp`` consecutive pieces
gives the last rank ``2cp - 1`` times the attention work of the first. As torch's context parallel does, the
sequence is cut into ``2·cp`` chunks and rank ``i`` holds chunks ``i`` and ``2·cp − 1 − i`` (in that order): every
rank then holds the same number of query/key pairs under the causal mask. The same layout serves bidirectional
attention (its work is balanced anyway), so one layout holds for every block.

    >>> local_positions(8, 2, 0).tolist(), local_positions(8, 2, 1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    >>> x = torch.arange(8.0)
    >>> shard(x, 0, 2, 1).tolist()
    [2.0, 3.0, 4.0, 5.0]
    >>> group_positions(8, 2).tolist()          # the order of the ranks' pieces, concatenated
    [0, 1, 6, 7, 2, 3, 4, 5]
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def check_divisible(seq_len: int, cp: int, what: str = "the sequence") -> None:
    """``ValueError`` unless ``2·cp`` divides ``seq_len`` ([Note: load-balanced causal sharding])."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"Context parallelism splits {what} of length {seq_len} into 2 × context_parallel_size = {2 * cp} "
            f"chunks (two per rank, for causal load balance), and {2 * cp} does not divide {seq_len}. Pad or cut the "
            f"sequences to a multiple of {2 * cp}, or choose a context_parallel_size c with 2c dividing {seq_len}.")


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions (of ``0..seq_len-1``) that ``rank`` of ``cp`` holds: chunks ``rank`` and ``2cp-1-rank``."""
    check_divisible(seq_len, cp)
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def group_positions(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """The positions of the ranks' local pieces concatenated in rank order (what an all-gather returns)."""
    return torch.cat([local_positions(seq_len, cp, r, device) for r in range(cp)])


def shard(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """``rank``'s piece of ``x`` along ``dim`` (differentiable: the gradient lands on the positions taken)."""
    return x.index_select(dim, local_positions(x.shape[dim], cp, rank, x.device))


class _Gather(torch.autograd.Function):
    """All-gather of the local pieces along ``dim``, put back in sequence order. Backward hands each rank the
    gradient of its own positions, times ``grad_scale`` ([Note: gradients under context parallelism])."""

    @staticmethod
    def forward(ctx, x, dim, group, grad_scale):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.dim, ctx.cp, ctx.rank, ctx.grad_scale = dim, cp, rank, grad_scale
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((cp * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_single(out, moved, group=group)
        seq = out.shape[0]
        order = torch.empty(seq, dtype=torch.long, device=x.device)
        order[group_positions(seq, cp, x.device)] = torch.arange(seq, device=x.device)
        return out.index_select(0, order).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        local = grad.index_select(ctx.dim, local_positions(grad.shape[ctx.dim], ctx.cp, ctx.rank, grad.device))
        return local * ctx.grad_scale if ctx.grad_scale != 1 else local, None, None, None


def gather(x: torch.Tensor, dim: int, group, grad_scale: float = 1.0) -> torch.Tensor:
    """The whole sequence from every rank's :func:`shard` of it, in order, on every rank of ``group``.

    [Note: gradients under context parallelism]
    After the gather every rank of the group computes the same thing (same batch, same weights), so the gradient
    reaching the gathered tensor is the same on every rank and its backward needs no communication: each rank keeps
    its own positions' part. A parameter used after the gather (the head) then gets its whole gradient on every rank,
    a parameter inside or before the sharded region its rank's share. With ``grad_scale = cp`` the shares are scaled
    by ``cp``, so that the *mean* over the group of every gradient (what a data-parallel all-reduce over the ranks of
    the group computes) equals one process's gradient, for both kinds and for a weight used by both (a head tied to
    the embedding)."""
    return _Gather.apply(x, dim, group, grad_scale)


__all__ = ["check_divisible", "gather", "group_positions", "local_positions", "shard"]
