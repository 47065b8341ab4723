"""Tokens to their experts' ranks and back: all-to-all of variable split sizes, differentiable, with a timeout.

[Note: all-to-all on gloo]
``dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes)`` runs on gloo (CPU) with uneven
splits and empty ones (checked on torch 2.13: a rank sending 0 rows to a peer and 3 to another), and on NCCL. So
the dispatch needs no emulation from point-to-point sends. Each call is started ``async_op=True`` and waited with
the group's collective timeout, so a peer that never arrives fails the step instead of hanging it. The backward of
an all-to-all is the all-to-all with the splits swapped (:class:`_AllToAll`); every rank of the group runs it in
the same order, because every rank runs the same layers' backward in the same order.

[Note: the dispatch of one MoE layer]
The router runs as the module wrote it, on every token of this rank. Its choice, ``top_k_index [T, K]`` with
``top_k_weights [T, K]``, is flattened to T·K (token, expert) pairs and sorted by expert (stable, so a token's
pairs keep ascending expert order). Expert ``e`` lives on rank ``e // (E/ep)`` of the expert-parallel group, so
the sorted pairs are already grouped by destination. Step 1 exchanges the per-expert counts (E integers, equal
splits); step 2 sends each pair's hidden state and routing weight (variable splits). The receiving rank calls the
experts module's own forward, as its class wrote it (for transformers 5: through the experts interface, with the
implementation the config chose), on the pairs it received, as T' tokens with top-1 routing to its local expert
ids and the received weights: every row comes back as the module's weighted expert output for that pair. Step 3
returns the rows (the inverse all-to-all), and the pairs are summed into their tokens with ``index_add`` in the
sorted order, which is the order the one-device loop adds them in. Routing weights travel (rather than being
applied on return) so that a module that uses them inside its experts computation gets them there; their
gradient travels back by the same all-to-all's backward. Pairs whose expert index is outside ``[0, E)`` (a
sentinel for a dropped token) are not sent, as the one-device loop skips them.
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from lightning_par._compat import current_autograd_node

DEFAULT_TIMEOUT = timedelta(minutes=30)


def _wait(work, timeout: Optional[timedelta]) -> None:
    work.wait(timeout or DEFAULT_TIMEOUT)


class Traffic:
    """Bytes this rank's all-to-alls sent to other ranks (its own rows excluded), by what they carried."""

    def __init__(self):
        self.bytes: dict[str, int] = {}

    def add(self, what: str, n: int) -> None:
        self.bytes[what] = self.bytes.get(what, 0) + n


_TRAFFIC: list[Traffic] = []


@contextlib.contextmanager
def count_traffic():
    """``with count_traffic() as t:`` every all-to-all of the dispatch adds its bytes to ``t.bytes`` (benchmarks)."""
    t = Traffic()
    _TRAFFIC.append(t)
    try:
        yield t
    finally:
        _TRAFFIC.remove(t)


def _record(x: torch.Tensor, in_splits: list[int], group) -> None:
    if not _TRAFFIC:
        return
    me = dist.get_rank(group)
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    sent = sum(n for i, n in enumerate(in_splits) if i != me) * row
    what = ("backward " if current_autograd_node() is not None else "forward ") + (
        "rows" if x.dim() > 1 else ("counts" if x.dtype == torch.int64 else "weights"))
    for t in _TRAFFIC:
        t.add(what, sent)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
               timeout: Optional[timedelta] = None) -> torch.Tensor:
    """Rows of ``x`` (``in_splits[i]`` of them to rank i of ``group``) exchanged; ``out_splits[i]`` rows come from
    rank i. Not differentiable (see :func:`all_to_all_grad`)."""
    _record(x, in_splits, group)
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
    _wait(work, timeout)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, timeout):
        ctx.args = (out_splits, in_splits, group, timeout)
        return all_to_all(x, out_splits, in_splits, group, timeout)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, timeout = ctx.args
        return all_to_all(grad, in_splits, out_splits, group, timeout), None, None, None, None


def all_to_all_grad(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                    timeout: Optional[timedelta] = None) -> torch.Tensor:
    """:func:`all_to_all` whose backward sends the gradient rows back ([Note: all-to-all on gloo])."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, timeout)


class Route:
    """Where this rank's (token, expert) pairs go and where the received ones come from: one layer's
    step 1 of [Note: the dispatch of one MoE layer]."""

    def __init__(self, expert_ids: torch.Tensor, num_experts: int, group, ep: int,
                 timeout: Optional[timedelta] = None):
        local = num_experts // ep
        self.group, self.timeout, self.local = group, timeout, local
        valid = (expert_ids >= 0) & (expert_ids < num_experts)
        pairs = torch.nonzero(valid.reshape(-1)).reshape(-1)
        ids = expert_ids.reshape(-1)[pairs]
        order = torch.argsort(ids, stable=True)
        self.pairs = pairs[order]  # flat (token * K + k) index of each sent row, in send order
        counts = torch.bincount(ids, minlength=num_experts).to(torch.int64)
        received = all_to_all(counts, [local] * ep, [local] * ep, group, timeout)  # [ep * local]: per source
        self.send = counts.view(ep, local).sum(1).tolist()
        self.recv = received.view(ep, local).sum(1).tolist()
        # local expert id of every received row: sources in rank order, each sorted by expert
        self.local_ids = torch.repeat_interleave(torch.arange(local).repeat(ep), received)

    def send_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return all_to_all_grad(rows, self.recv, self.send, self.group, self.timeout)

    def return_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return all_to_all_grad(rows, self.send, self.recv, self.group, self.timeout)


def dispatch_fused(module, forward, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, *, num_experts: int, group, ep: int,
                   timeout: Optional[timedelta] = None) -> torch.Tensor:
    """``forward(module, hidden_states, top_k_index, top_k_weights)`` of a fused experts module whose tensors hold
    this rank's E/ep experts, served for all E ([Note: the dispatch of one MoE layer])."""
    tokens, k = top_k_index.shape
    route = Route(top_k_index, num_experts, group, ep, timeout)
    token_of = torch.div(route.pairs, k, rounding_mode="floor")
    x = route.send_rows(hidden_states[token_of])
    w = route.send_rows(top_k_weights.reshape(-1)[route.pairs])
    y = forward(module, x, route.local_ids.unsqueeze(1), w.unsqueeze(1))
    back = route.return_rows(y)
    out = torch.zeros((tokens,) + tuple(back.shape[1:]), dtype=back.dtype, device=back.device)
    return out.index_add(0, token_of, back).to(hidden_states.dtype)


# [Note: experts divided over the tensor-parallel group]
# Under tensor parallelism alone every rank of a tp group holds the same tokens (the MoE block sits outside the
# tensor plan's regions, on plain replicated tensors). So nothing needs to travel: rank r keeps experts [r E/tp,
# (r+1) E/tp), computes the (token, expert) pairs whose expert it holds, and the partial outputs are summed over the
# group (Megatron's row-parallel "g": all-reduce forward, identity backward). The hidden states and routing weights
# enter through Megatron's "f" (identity forward, all-reduce backward): each rank's gradient for them covers only its
# experts' pairs, and the sum over the group is the whole. The experts' own gradients are complete on their rank
# (it saw every token routed to them), so they are averaged over the data-parallel replicas like every plain
# parameter.
class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timeout):
        ctx.args = (group, timeout)
        return x

    @staticmethod
    def backward(ctx, grad):
        group, timeout = ctx.args
        grad = grad.contiguous().clone()
        _wait(dist.all_reduce(grad, group=group, async_op=True), timeout)
        return grad, None, None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timeout):
        x = x.contiguous().clone()
        _wait(dist.all_reduce(x, group=group, async_op=True), timeout)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def divided_fused(module, forward, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, *, num_experts: int, group, size: int, rank: int,
                  timeout: Optional[timedelta] = None) -> torch.Tensor:
    """``forward`` of a fused experts module holding experts ``[rank E/size, (rank+1) E/size)`` on tokens every rank
    of ``group`` holds alike ([Note: experts divided over the tensor-parallel group])."""
    tokens, k = top_k_index.shape
    local = num_experts // size
    lo = rank * local
    hidden_states = _CopyToGroup.apply(hidden_states, group, timeout)
    top_k_weights = _CopyToGroup.apply(top_k_weights, group, timeout)
    flat = top_k_index.reshape(-1)
    pairs = torch.nonzero((flat >= lo) & (flat < lo + local)).reshape(-1)
    ids = flat[pairs]
    order = torch.argsort(ids, stable=True)
    pairs, ids = pairs[order], ids[order]
    token_of = torch.div(pairs, k, rounding_mode="floor")
    y = forward(module, hidden_states[token_of], (ids - lo).unsqueeze(1),
                top_k_weights.reshape(-1)[pairs].unsqueeze(1))
    out = torch.zeros((tokens,) + tuple(y.shape[1:]), dtype=y.dtype, device=y.device).index_add(0, token_of, y)
    return _SumOverGroup.apply(out, group, timeout).to(hidden_states.dtype)
