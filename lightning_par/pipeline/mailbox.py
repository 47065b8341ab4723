"""The last stage's step result (its return value and captured logs) delivered to the other ranks of its
pipeline without a synchronising collective.

[Note: result mailbox] Only the last stage computes the loss and what the user logs; every rank must
return and log the same (see [Note: log routing]). A ``broadcast_object_list`` after the schedule costs two
blocking broadcasts and a pickle on the critical path of every step (about 1.7 ms of a 125 ms step on two
CPU ranks). Instead each receiver posts, when its step starts, the receive of one message;
the last stage sends it (length + pickled payload) once its last backward has sent its gradient
upstream (sending earlier would delay that gradient, which the other stages wait for), while the others
still have backwards to run, and the receivers only read it when their schedule ends. The message is
sized by the previous step's payload (both sides know its length), so it costs what the payload does (a
loss and a few logged scalars: about 200 bytes; scalar tensors travel as numbers, not as pickled tensor
storages); a payload that outgrows it (a first validation step, large predictions) follows in a second
message of its exact length. Messages travel in a process group of their own, so they never interleave
with activations or gradients.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from lightning_par.waits import named_wait

MIN_CAPACITY = 256  # bytes of the pre-posted message before any payload has been seen (a loss and a log fit)
_LEN = 8  # the payload's length, little-endian int64, leads the message


def capacity_after(length: int) -> int:
    """The message size for the step after one whose payload had ``length`` bytes: the next power of two
    that holds it and its length field.

    Example::

        >>> capacity_after(150), capacity_after(300)
        (256, 512)
    """
    return max(MIN_CAPACITY, 1 << (length + _LEN - 1).bit_length())


def _scalar(value, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


class _CompactPickler(pickle.Pickler):
    """Pickles a 0-dim CPU tensor as its number and dtype (~20 bytes instead of ~300 for its storage)."""

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.dim() == 0 and obj.device.type == "cpu" and not obj.requires_grad:
            return _scalar, (obj.item(), obj.dtype)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _CompactPickler(buf).dump(obj)
    return buf.getvalue()


class ResultMailbox:
    """Point-to-point delivery of one picklable object per step from ``ranks[-1]`` to the other ``ranks``.

    Receivers call :meth:`post` early and :meth:`receive` late; the sender calls :meth:`send` when the
    object is ready and :meth:`finish` before the next step.
    """

    def __init__(self, *, ranks: list[int], me: int, group, device: torch.device):
        self.sender, self.me, self.group, self.device = ranks[-1], me, group, device
        self.receivers = [r for r in ranks if r != self.sender]
        self._posted: tuple | None = None
        self._works: list = []
        self.capacity = MIN_CAPACITY  # this step's message size, the same on every rank (capacity_after)

    @property
    def is_sender(self) -> bool:
        return self.me == self.sender

    def post(self) -> None:
        """Receivers: start receiving this step's message (idempotent until it is received)."""
        if self.is_sender or self._posted is not None:
            return
        buf = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        self._posted = (dist.irecv(buf, self.sender, group=self.group), buf)

    def send(self, obj: Any) -> None:
        """The sender: send ``obj`` to every receiver (asynchronously; :meth:`finish` waits)."""
        data = torch.frombuffer(bytearray(dumps(obj)), dtype=torch.uint8)
        n = data.numel()
        msg = torch.zeros(self.capacity, dtype=torch.uint8)
        msg[:_LEN] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
        fits = n <= self.capacity - _LEN
        self.capacity = capacity_after(n)
        if fits:
            msg[_LEN:_LEN + n] = data
        msg, data = msg.to(self.device), data.to(self.device)
        for r in self.receivers:
            self._works.append((dist.isend(msg, r, group=self.group), msg))
            if not fits:
                self._works.append((dist.isend(data, r, group=self.group), data))

    def receive(self) -> Any:
        """Receivers: this step's object (posts the receive first if :meth:`post` was not called)."""
        self.post()
        work, buf = self._posted
        self._posted = None
        with named_wait(f"pipeline receive of the step's result from the last stage (rank {self.sender})",
                        peer=self.sender):  # [Note: every wait bounded] in lightning_par/waits.py
            work.wait()
            buf = buf.cpu()
            n = int(buf[:_LEN].view(torch.int64)[0])
            if n <= self.capacity - _LEN:
                data = buf[_LEN:_LEN + n]
            else:
                data = torch.empty(n, dtype=torch.uint8, device=self.device)
                dist.recv(data, self.sender, group=self.group)
                data = data.cpu()
        self.capacity = capacity_after(n)
        return pickle.loads(data.numpy().tobytes())

    def finish(self) -> None:
        """The sender: wait until every receiver has taken this step's message."""
        with named_wait(f"pipeline send of the step's result to ranks {self.receivers}"):
            for work, _ in self._works:
                work.wait()
        self._works.clear()
