"""Per-expert ``nn.ModuleList`` experts served across ranks by recording and replaying their parent's forward.

[Note: record and replay of a per-expert loop]
A parent that loops over ``self.experts[i](tokens_i)`` (older transformers' Mixtral, most hand-written MoE code)
calls each expert as soon as it has picked its tokens, and uses the result at once (``* routing_weight``,
``index_add_``). Its forward is run twice per call:

1. *record*: the forward runs with every expert replaced by a recorder that keeps (i, tokens_i) and returns
   zeros of the expert's output shape; the random state is restored afterwards, so that pass 2 draws the same
   numbers (router jitter, dropout) as the one pass of one device.
2. the recorded rows go to their experts' ranks (:class:`~lightning_par.experts.dispatch.Route`, all-to-all), each
   rank runs its own experts on what it received, and the rows come back.
3. *replay*: the forward runs again and the recorder hands expert i's output for call n back in call order; its
   result is the layer's output. A replay that asks for other experts or other row counts than the record (Python
   that depends on something besides the routing) is refused naming the module and ``experts=``.

Autograd: the expert outputs are functions of pass 1's tokens (gradients reach the hidden states, and the router
where the tokens were scaled by it, through them); pass 2's own use of the routing weights gives the router its
gradient as on one device. The router and the code around the loop run twice: a router is a small matmul.
"""
from __future__ import annotations

import types
from typing import Optional

import torch
from torch import nn

from lightning_par.experts.dispatch import Route

_RECORD, _REPLAY, _OFF = "record", "replay", "off"


class _Stub(nn.Module):
    """An expert held by another rank: no parameters, answers the loop through the session."""

    def __init__(self, index: int, session: "_Session"):
        super().__init__()
        self.index = index
        self.__dict__["_session"] = session  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._session.call(self.index, x)


class _Session:
    def __init__(self, name: str, out_features: Optional[int]):
        self.name, self.out_features = name, out_features
        self.mode = _OFF
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.outputs: list[torch.Tensor] = []

    def call(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.mode == _RECORD:
            self.calls.append((index, x))
            width = self.out_features if self.out_features is not None else x.shape[-1]
            return x.new_zeros(tuple(x.shape[:-1]) + (width,))
        if self.mode == _REPLAY:
            n = len(self.outputs)
            if not self.calls or self.calls[0][0] != index or self.calls[0][1].shape[:-1] != x.shape[:-1]:
                raise RuntimeError(
                    f"The experts of `{self.name}` were called differently when its forward ran again (call {n}: "
                    f"expert {index} on {tuple(x.shape)}): expert parallelism replays a per-expert loop and needs "
                    f"the same calls in the same order from the same routing. Leave this layer out of `experts=` "
                    f"or run it without expert_parallel_size.")
            self.calls.pop(0)
            out = self.outputs.pop(0)
            return out.reshape(tuple(x.shape[:-1]) + (out.shape[-1],))
        raise RuntimeError(f"An expert of `{self.name}` was called outside its MoE layer's forward; under expert "
                           f"parallelism a rank holds only its own experts.")


def serve_list(container, group, ep: int, rank: int, timeout=None) -> "ListExperts":
    """Keep this rank's E/ep experts of ``container`` (a ``list`` :class:`ExpertContainer`) and serve the rest
    through its parent ([Note: record and replay of a per-expert loop])."""
    return ListExperts(container, group, ep, rank, timeout)


class ListExperts:
    def __init__(self, container, group, ep: int, rank: int, timeout=None):
        from lightning_par.experts.discovery import mlp_names

        experts: nn.ModuleList = container.module
        parent = container.parent
        if parent is None:
            raise ValueError(f"`{container.name}` has no parent module whose forward routes tokens to it.")
        e = len(experts)
        local = e // ep
        names = mlp_names(experts[0])
        out = getattr(experts[0], names[2]).out_features if names else None
        self.in_features = getattr(experts[0], names[0]).in_features if names else None
        self.session = session = _Session(container.name, out)
        self.container, self.parent, self.group, self.ep, self.timeout = container, parent, group, ep, timeout
        self.num_experts, self.lo, self.local = e, rank * local, local
        self.mine = [experts[i] for i in range(self.lo, self.lo + local)]
        for i in range(e):
            if self.lo <= i < self.lo + local:
                experts[i].forward = types.MethodType(lambda _m, x, i=i: session.call(i, x), experts[i])
            else:
                experts[i] = _Stub(i, session)
        parent.forward = types.MethodType(self._forward, parent)

    def _forward(self, parent, *args, **kwargs):
        s = self.session
        s.mode, s.calls = _RECORD, []
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        try:
            with torch.random.fork_rng(devices=devices):
                type(parent).forward(parent, *args, **kwargs)
            calls = list(s.calls)
            s.outputs = self._exchange(calls)
            s.mode = _REPLAY
            out = type(parent).forward(parent, *args, **kwargs)
            if s.calls:
                raise RuntimeError(f"The experts of `{s.name}` were called fewer times when its forward ran again "
                                   f"({len(s.calls)} calls left): expert parallelism needs the same calls from "
                                   f"the same routing. Leave this layer out of `experts=`.")
            return out
        finally:
            s.mode, s.calls, s.outputs = _OFF, [], []

    def _exchange(self, calls: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        if calls:
            rows = torch.cat([x.reshape(-1, x.shape[-1]) for _, x in calls])
            ids = torch.cat([torch.full((x.reshape(-1, x.shape[-1]).shape[0],), i, dtype=torch.int64)
                             for i, x in calls])
        else:  # a rank that routed nothing through this layer still takes part in the exchange
            if self.in_features is None:
                raise RuntimeError(f"`{self.session.name}`'s forward called no expert on this rank, and its experts' "
                                   f"width is unknown (no gate/up/down linears): give it tokens or leave it out of "
                                   f"`experts=`.")
            rows, ids = torch.zeros(0, self.in_features), torch.zeros(0, dtype=torch.int64)
        route = Route(ids, self.num_experts, self.group, self.ep, self.timeout)
        received = route.send_rows(rows[route.pairs])
        out = received.new_zeros((received.shape[0], self.session.out_features or received.shape[-1]))
        for j, expert in enumerate(self.mine):
            idx = torch.nonzero(route.local_ids == j).reshape(-1)
            if idx.numel():
                out = out.index_copy(0, idx, type(expert).forward(expert, received[idx]).to(out.dtype))
        back = route.return_rows(out)
        rows_out = torch.empty_like(back).index_copy(0, route.pairs, back)
        sizes = [x.reshape(-1, x.shape[-1]).shape[0] for _, x in calls]
        return list(torch.split(rows_out, sizes))

    def remove(self) -> None:
        self.parent.__dict__.pop("forward", None)
        for m in self.mine:
            m.__dict__.pop("forward", None)
