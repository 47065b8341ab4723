"""Counting the bytes a rank communicates: every ``torch.distributed`` op it dispatches, by kind.

[Note: how communication is counted]
``count_comm()`` is a ``TorchDispatchMode``. Every process-group call (``dist.all_reduce``, ``isend``,
DDP's C++ reducer, ZeroRedundancyOptimizer's broadcasts) dispatches a ``c10d::*`` op, and DTensor's
redistributions dispatch functional collectives (``_c10d_functional::*``) once DTensor has decomposed
(the mode returns ``NotImplemented`` for DTensor arguments, as torch's ``CommDebugMode`` does). The mode
is thread-local: on CPU the backward pass (and with it DDP's bucket all-reduces) runs on the calling
thread, so it is seen; on CUDA the autograd engine uses device threads — count there with
``CommDebugMode`` or profile. ``payload`` is the bytes handed to the op; ``wire`` is what one rank sends
under the textbook algorithm (ring all-reduce 2(N−1)/N × payload, all-gather (N−1) × input,
reduce-scatter (N−1)/N × input, broadcast/send = payload from the root or sender, nothing for a
receiver). A custom op of this package (context-parallel attention) is one op to a dispatch mode, its
collectives inside it: the mode enters it again to count them. Every op passes through Python while the mode
is on: count on a few steps, never on timed ones.
"""
from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from lightning_par._compat import current_autograd_node, local_tensor, resolve_process_group

# op name -> (kind, index of the argument with this rank's tensors)
_OPS = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0), "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0), "all_reduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 1), "_allgather_base_": ("all_gather", 1),
    "allgather_coalesced_": ("all_gather", 1), "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 0), "all_gather_into_tensor_out": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1), "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0), "reduce_": ("broadcast", 0),
    "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
}
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def wire_bytes(kind: str, payload: int, world: int) -> float:
    """Bytes one rank sends for an op of ``kind`` handing it ``payload`` bytes among ``world`` ranks."""
    if kind == "all_reduce":
        return 2 * (world - 1) / world * payload
    if kind == "all_gather":
        return (world - 1) * payload
    if kind in ("reduce_scatter", "all_to_all"):
        return (world - 1) / world * payload
    if kind == "recv":
        return 0.0
    return float(payload)


def local_nbytes(obj) -> int:
    """Bytes this rank stores for a tensor (a DTensor's local shard), or a list/tuple of them; 0 for None."""
    if isinstance(obj, torch.Tensor):
        t = local_tensor(obj)
        return t.numel() * t.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(local_nbytes(x) for x in obj)
    return 0


def _process_group(arg):
    """The ProcessGroup a c10d op received (the dispatcher hands it over boxed in a ScriptObject)."""
    import torch.distributed as dist

    if isinstance(arg, dist.ProcessGroup):
        return arg
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg)
        except (RuntimeError, TypeError):
            return None
    return None


def _group_size(func, args) -> int:
    """World size of the op's process group (from its ProcessGroup argument or group name)."""
    import torch.distributed as dist

    for a in args:
        if (pg := _process_group(a)) is not None:
            return pg.size()
        if isinstance(a, str):
            try:
                return resolve_process_group(a).size()
            except Exception:  # noqa: BLE001 - a str that names no group
                continue
        if isinstance(a, int) and func.__name__.startswith(("all_gather_into_tensor", "reduce_scatter_tensor")):
            return a
    return dist.get_world_size() if dist.is_initialized() else 1


def _sends(name: str, args) -> bool:
    """False when this rank is not the root of a c10d broadcast/reduce (it receives, sends nothing)."""
    if name in ("broadcast_", "reduce_") and len(args) > 2 and (pg := _process_group(args[1])) is not None:
        return pg.rank() == args[2]
    return True


@dataclass
class CommCounter:
    """Calls, payload bytes and wire bytes per op kind; ``steps`` counts the steps they were summed over."""

    calls: Counter = field(default_factory=Counter)
    payload: Counter = field(default_factory=Counter)
    wire: Counter = field(default_factory=Counter)
    seconds: float = 0.0  # wall time inside the ops' calls (their blocking part)
    steps: int = 0

    def add(self, kind: str, payload: int, world: int, backward: bool = False, sends: bool = True) -> None:
        """``sends=False``: this rank only receives (a broadcast from another root)."""
        key = f"{kind}[bwd]" if backward else kind
        self.calls[key] += 1
        self.payload[key] += payload
        self.wire[key] += wire_bytes(kind, payload, world) if sends else 0.0

    @property
    def wire_bytes(self) -> float:
        return float(sum(self.wire.values()))

    def per_step(self) -> dict:
        n = max(self.steps, 1)
        return {"calls": {k: v / n for k, v in self.calls.items()},
                "payload_bytes": {k: v / n for k, v in self.payload.items()},
                "wire_bytes": self.wire_bytes / n}

    def reset(self) -> None:
        self.calls.clear(), self.payload.clear(), self.wire.clear()
        self.seconds, self.steps = 0.0, 0


@contextmanager
def count_comm(counter: CommCounter | None = None):
    """Count every communication op dispatched on this thread while the block runs (see the Note above).

    Example::

        counter = CommCounter()
        with count_comm(counter):
            loss.backward()          # DDP's bucket all-reduces are counted here
        counter.calls["all_reduce[bwd]"]
    """
    from torch.distributed.tensor import DTensor

    from lightning_par._compat import torch_dispatch_mode

    TorchDispatchMode = torch_dispatch_mode()

    counter = counter if counter is not None else CommCounter()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            if func.namespace == "lightning_par":  # our custom ops hold collectives: count those inside
                from lightning_par.context.attention import IMPLEMENTATIONS

                if func in IMPLEMENTATIONS:
                    with self:
                        return IMPLEMENTATIONS[func](*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if func.namespace not in _NAMESPACES or name not in _OPS:
                return func(*args, **(kwargs or {}))
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            counter.seconds += time.perf_counter() - start
            kind, idx = _OPS[name]
            backward = current_autograd_node() is not None
            counter.add(kind, local_nbytes(args[idx]), _group_size(func, args), backward, _sends(name, args))
            return out

    with _Count():
        yield counter
