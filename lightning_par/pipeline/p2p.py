"""Point-to-point transfer of activations between neighbouring stages.

An activation is announced by a small int64 header (dtype code, number of dimensions, a refill flag,
shape), so the receiver needs no prior knowledge of shapes (the last micro-batch may be smaller, autocast
may change dtypes); see [Note: speculative receive] for how its receive is still posted ahead of the
send. Gradients travel back without a header: their shape and dtype are the sent activation's. Sends are
asynchronous (``isend``; the caller waits on the handles at the end of the step), receives are bounded
by the process group's timeout. Every schedule here sends and receives in the same order on each
channel (checked in the unit tests), so matching does not rely on tags, which NCCL ignores.

[Note: one direction per group] On NCCL the point-to-point operations between two ranks of one process
group share a communicator and a stream and run in the order they were issued, so a receive posted
ahead from a peer would hold up a later send to that same peer until the receive completes; with both
ranks doing so the pipeline stops. Each process group therefore carries one kind of transfer in one
direction between any two ranks: activations to a higher rank, gradients to a lower one, and, where
interleaved chunks wrap around the ring, activations to a lower and gradients to a higher rank in two
more groups.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_par.waits import named_wait

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS


_NONE = len(_DTYPES)  # the dtype code of an absent (``None``) entry of a bundle


def header_of(tensor: torch.Tensor | None, refill: bool = False) -> torch.Tensor:
    """The header that announces ``tensor`` (``None``: an absent entry of a bundle): dtype code, number of
    dimensions, the refill flag (see [Note: speculative receive]), the shape.

    Example::

        >>> header_of(torch.zeros(2, 3)).tolist()[:5]
        [0, 2, 0, 2, 3]
    """
    if tensor is None:
        return torch.tensor([_NONE, 0, int(refill)] + [0] * _MAX_DIMS, dtype=torch.int64)
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ValueError(
            f"A block output of shape {tuple(tensor.shape)} and dtype {tensor.dtype} cannot cross a pipeline "
            f"stage boundary: at most {_MAX_DIMS} dimensions and one of {_DTYPES}."
        )
    shape = list(tensor.shape)
    return torch.tensor([_DTYPES.index(tensor.dtype), len(shape), int(refill)] + shape + [0] * (_MAX_DIMS - len(shape)),
                        dtype=torch.int64)


# [Note: speculative receive] A receive posted before its send lets the transfer run while the receiver
# computes; one posted after it waits for a round trip through the sender's progress thread (gloo hands
# over an unannounced message only once the receiver asks for it), and on a busy CPU that cost 2-3 ms per
# micro-batch on 1F1B's critical path. So a stage posts the receive of its next activation as soon as it
# has taken the current one ([Note: receive plan] in stage.py), as one *frame* (header bytes, then data
# bytes) shaped like the activation just received: the micro-batches of a step almost always agree (the
# first of a step is guessed from the previous step's first). The sender knows what was posted (the
# previous activation it sent on the channel) and sends the frame. When the new activation differs in
# shape or dtype (a smaller last micro-batch, autocast), the posted frame carries only a header that says
# "refill" and the new shape, and a frame of that shape follows. Both sides apply the rule to the same
# transfers, so sends and receives still match in order on the channel. With nothing posted (the very
# first transfer) the header travels alone, then the data.
#
# [Note: bundles] What crosses a boundary may be several tensors: the hidden state and the block outputs
# later blocks take ([Note: block flow] in flow.py), some possibly ``None``. A bundle of n entries travels
# as one frame: n headers, then each entry's bytes, each but the last padded to 8 bytes so every entry's
# view of the buffer is aligned for its dtype. Its gradients travel back as one message too (the floating
# entries' bytes, laid out the same way, without headers: the sender knows their shapes). A bundle of one
# is exactly the single activation's frame. ``like`` for a bundle: one ``(shape, dtype)`` or ``None`` per entry.
_HEADER_BYTES = _HEADER * 8


def _nbytes(like: tuple | None) -> int:
    return 0 if like is None else torch.Size(like[0]).numel() * like[1].itemsize


def _offsets(likes, start: int) -> tuple[list[int], int]:
    """Where each entry's bytes start (after ``start`` bytes), and the total size."""
    offsets, at = [], start
    for k, like in enumerate(likes):
        offsets.append(at)
        at += _nbytes(like) if k == len(likes) - 1 else -(-_nbytes(like) // 8) * 8
    return offsets, at


def _frame_bytes(likes) -> int:
    return _offsets(likes, len(likes) * _HEADER_BYTES)[1]


def like_of(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype)


def _pack(parts: list, likes, start: int) -> list[torch.Tensor]:
    """``parts`` (uint8 views, ``None`` for an absent entry) interleaved with the padding of :func:`_offsets`."""
    pieces, device = [], next(p.device for p in parts if p is not None)
    offsets, total = _offsets(likes, start)
    ends = offsets[1:] + [total]
    for part, like, at, end in zip(parts, likes, offsets, ends):
        if part is not None:
            pieces.append(part)
        if end - at > _nbytes(like):
            pieces.append(torch.zeros(end - at - _nbytes(like), dtype=torch.uint8, device=device))
    return pieces


def _unpack(buf: torch.Tensor, likes, start: int) -> list[torch.Tensor | None]:
    offsets, _ = _offsets(likes, start)
    return [None if like is None else buf[at:at + _nbytes(like)].view(like[1]).view(like[0])
            for like, at in zip(likes, offsets)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _announced(header: torch.Tensor, count: int = 1) -> tuple[list, bool]:
    """(the ``like`` of each of ``count`` entries, refill) that received headers announce."""
    rows = header.view(torch.int64).cpu().view(count, _HEADER).tolist()
    likes = [None if r[0] == _NONE else (tuple(r[3:3 + r[1]]), _DTYPES[r[0]]) for r in rows]
    return likes, bool(rows[0][2])


def send_bundle(tensors: list, dst: int, works: list, tag: int = 0, group=None,
                posted_like: tuple | None = None) -> None:
    """Send ``tensors`` (entries may be ``None``) as one bundle ([Note: bundles]); ``posted_like``: the ``like``
    of the frame the peer has already posted for it (see [Note: speculative receive]), or ``None`` when it
    posted only the headers' receive."""
    data = [None if t is None else t.detach().contiguous() for t in tensors]
    device = next(d.device for d in data if d is not None)
    headers = torch.cat([header_of(d) for d in data]).to(device)
    if posted_like is None:
        works.append((dist.isend(headers, dst, group=group, tag=tag), headers))
        for d in data:  # keep the buffers alive until the wait
            if d is not None:
                works.append((dist.isend(d, dst, group=group, tag=tag), d))
        return
    likes = tuple(like_of(d) for d in data)
    if tuple(posted_like) != likes:  # the posted frame announces a refill, then the real one
        refill = torch.zeros(_frame_bytes(posted_like), dtype=torch.uint8, device=device)
        announce = torch.cat([header_of(d, refill=k == 0) for k, d in enumerate(data)])
        refill[:announce.numel() * 8] = announce.view(torch.uint8)
        works.append((dist.isend(refill, dst, group=group, tag=tag), refill))
    frame = torch.cat([headers.view(torch.uint8)] + _pack([None if d is None else _bytes(d) for d in data], likes,
                                                          len(data) * _HEADER_BYTES))
    works.append((dist.isend(frame, dst, group=group, tag=tag), frame))


def post_recv_bundle(src: int, device: torch.device, count: int = 1, tag: int = 0, group=None,
                     like: tuple | None = None):
    """Start receiving the next bundle of ``count`` entries now: with ``like`` (that of the previous bundle
    from ``src``) a whole frame shaped so, otherwise its headers. Pass the result to :func:`recv_bundle`."""
    nbytes = _frame_bytes(like) if like is not None else count * _HEADER_BYTES
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return dist.irecv(buf, src, group=group, tag=tag), buf, count, like is not None


def recv_bundle(src: int, device: torch.device, count: int = 1, tag: int = 0, group=None,
                posted=None) -> list[torch.Tensor | None]:
    """Receive one bundle; ``posted``: what :func:`post_recv_bundle` started (or ``None``)."""
    if posted is None:
        posted = post_recv_bundle(src, device, count, tag=tag, group=group)
    work, buf, count, framed = posted
    with named_wait(f"pipeline receive of an activation from rank {src}", peer=src):  # [Note: every wait bounded]
        work.wait()
        return _received(buf, src, device, count, tag, group, framed)


def _received(buf, src: int, device, count: int, tag: int, group, framed: bool) -> list[torch.Tensor | None]:
    """The bundle whose headers (``framed``: and data) arrived in ``buf``; what did not is received now."""
    start = count * _HEADER_BYTES
    likes, refill = _announced(buf[:start], count)
    if framed and not refill:
        return _unpack(buf, likes, start)
    if framed:  # the posted frame only announced the real one
        buf = torch.empty(_frame_bytes(likes), dtype=torch.uint8, device=device)
        dist.recv(buf, src, group=group, tag=tag)
        return _unpack(buf, likes, start)
    out = []
    for like in likes:
        out.append(None if like is None else torch.empty(like[0], dtype=like[1], device=device))
        if like is not None:
            dist.recv(out[-1], src, group=group, tag=tag)
    return out


def send_activation(tensor: torch.Tensor, dst: int, works: list, tag: int = 0, group=None,
                    posted_like: tuple | None = None) -> None:
    """Send one activation (a bundle of one); ``posted_like``: ``(shape, dtype)`` of the frame posted for it."""
    send_bundle([tensor], dst, works, tag=tag, group=group, posted_like=None if posted_like is None else (posted_like,))


def post_recv_activation(src: int, device: torch.device, tag: int = 0, group=None, like: tuple | None = None):
    """:func:`post_recv_bundle` for one activation, ``like`` its ``(shape, dtype)``."""
    return post_recv_bundle(src, device, 1, tag=tag, group=group,
                            like=None if like is None else ((tuple(like[0]), like[1]),))


def recv_activation(src: int, device: torch.device, tag: int = 0, group=None, posted=None) -> torch.Tensor:
    """Receive one activation; ``posted``: what :func:`post_recv_activation` started (or ``None``)."""
    return recv_bundle(src, device, 1, tag=tag, group=group, posted=posted)[0]


def send_grads(grads: list[torch.Tensor], dst: int, works: list, tag: int = 0, group=None) -> None:
    """Send the gradients of a bundle's floating entries as one message ([Note: bundles])."""
    data = [g.detach().contiguous() for g in grads]
    if len(data) > 1:
        data = [torch.cat(_pack([_bytes(d) for d in data], [like_of(d) for d in data], 0))]
    works.append((dist.isend(data[0], dst, group=group, tag=tag), data[0]))


def post_recv_grads(likes: list[torch.Tensor], src: int, tag: int = 0, group=None):
    """Start receiving the gradients of ``likes`` (the sent floating entries) now; returns ``(work, grads)``:
    wait on the work, then read the grads."""
    if len(likes) == 1:
        buf = torch.empty(likes[0].shape, dtype=likes[0].dtype, device=likes[0].device)
        return dist.irecv(buf, src, group=group, tag=tag), [buf]
    shapes = [like_of(t) for t in likes]
    buf = torch.empty(_offsets(shapes, 0)[1], dtype=torch.uint8, device=likes[0].device)
    return dist.irecv(buf, src, group=group, tag=tag), _unpack(buf, shapes, 0)


def recv_grads(likes: list[torch.Tensor], src: int, tag: int = 0, group=None) -> list[torch.Tensor]:
    work, grads = post_recv_grads(likes, src, tag=tag, group=group)
    wait_grads(work, src)
    return grads


def wait_grads(work, src: int) -> None:
    with named_wait(f"pipeline receive of a gradient from rank {src}", peer=src):
        work.wait()


def wait_all(works: list) -> None:
    with named_wait("pipeline sends of this step (activations, gradients)"):
        for work, _ in works:
            work.wait()
    works.clear()


class ReceivePlan:
    """[Note: receive plan] The receives of one step on one channel, in the order the schedule takes them,
    with at most one posted ahead. A receive posted before its send lets the transfer overlap compute (see
    [Note: speculative receive]); posting in the order of use keeps receives matched to sends on NCCL,
    which matches by order, not by tag: every schedule here sends and receives in the same order on each
    channel (``channel_orders``, unit-tested), for interleaved chunks too, whose backwards do not follow
    their forwards."""

    def __init__(self):
        self.keys: list = []
        self.next = 0
        self._posted: tuple | None = None  # (key, what the post returned)

    def begin(self, keys: list) -> None:
        self.keys, self.next, self._posted = list(keys), 0, None

    def due(self):
        """The next key to post, or ``None`` (one is posted already, or none is left)."""
        return self.keys[self.next] if self._posted is None and self.next < len(self.keys) else None

    def posted(self, key, handle) -> None:
        self._posted, self.next = (key, handle), self.next + 1

    def peek(self):
        """``(key, handle)`` of the posted receive, or ``None``."""
        return self._posted

    def take(self, key):
        """The posted receive of ``key``, or ``None`` when it is not the one posted."""
        if self._posted is not None and self._posted[0] == key:
            handle, self._posted = self._posted[1], None
            return handle
        return None

    def left(self) -> list:
        return self.keys[self.next - (self._posted is not None):]
