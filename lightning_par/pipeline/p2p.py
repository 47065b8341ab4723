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

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS


def header_of(tensor: torch.Tensor, refill: bool = False) -> torch.Tensor:
    """The header that announces ``tensor``: dtype code, number of dimensions, the refill flag (see
    [Note: speculative receive]), the shape.

    Example::

        >>> header_of(torch.zeros(2, 3)).tolist()[:5]
        [0, 2, 0, 2, 3]
    """
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
_HEADER_BYTES = _HEADER * 8


def _frame_bytes(like: tuple) -> int:
    return _HEADER_BYTES + torch.Size(like[0]).numel() * like[1].itemsize


def _announced(header: torch.Tensor) -> tuple[list[int], torch.dtype, bool]:
    """(shape, dtype, refill) that a received header announces."""
    header = header.view(torch.int64).cpu().tolist()
    return header[3:3 + header[1]], _DTYPES[header[0]], bool(header[2])


def send_activation(tensor: torch.Tensor, dst: int, works: list, tag: int = 0, group=None,
                    posted_like: tuple | None = None) -> None:
    """Send ``tensor``; ``posted_like``: ``(shape, dtype)`` of the frame the peer has already posted for it
    (see [Note: speculative receive]), or ``None`` when it posted only a header's receive."""
    data = tensor.detach().contiguous()
    header = header_of(data).to(data.device)
    if posted_like is None:
        works.append((dist.isend(header, dst, group=group, tag=tag), header))
        works.append((dist.isend(data, dst, group=group, tag=tag), data))  # keep the buffers alive until the wait
        return
    if posted_like != (tuple(data.shape), data.dtype):  # the posted frame announces a refill, then the real one
        refill = torch.zeros(_frame_bytes(posted_like), dtype=torch.uint8, device=data.device)
        refill[:_HEADER_BYTES] = header_of(data, refill=True).view(torch.uint8)
        works.append((dist.isend(refill, dst, group=group, tag=tag), refill))
    frame = torch.cat([header.view(torch.uint8), data.reshape(-1).view(torch.uint8)])
    works.append((dist.isend(frame, dst, group=group, tag=tag), frame))


def post_recv_activation(src: int, device: torch.device, tag: int = 0, group=None, like: tuple | None = None):
    """Start receiving the next activation now: with ``like`` (``(shape, dtype)`` of the previous activation
    from ``src``) a whole frame shaped so, otherwise its header. Pass the result to :func:`recv_activation`."""
    nbytes = _frame_bytes(like) if like is not None else _HEADER_BYTES
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return dist.irecv(buf, src, group=group, tag=tag), buf, like is not None


def recv_activation(src: int, device: torch.device, tag: int = 0, group=None, posted=None) -> torch.Tensor:
    """Receive one activation; ``posted``: what :func:`post_recv_activation` started (or ``None``)."""
    if posted is None:
        posted = post_recv_activation(src, device, tag=tag, group=group)
    work, buf, framed = posted
    work.wait()
    shape, dtype, refill = _announced(buf[:_HEADER_BYTES])
    if framed and not refill:
        return buf[_HEADER_BYTES:].view(dtype).view(shape)
    if framed:  # the posted frame only announced the real one
        buf = torch.empty(_frame_bytes((shape, dtype)), dtype=torch.uint8, device=device)
        dist.recv(buf, src, group=group, tag=tag)
        return buf[_HEADER_BYTES:].view(dtype).view(shape)
    data = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(data, src, group=group, tag=tag)
    return data


def send_grad(grad: torch.Tensor, dst: int, works: list, tag: int = 0, group=None) -> None:
    data = grad.detach().contiguous()
    works.append((dist.isend(data, dst, group=group, tag=tag), data))


def recv_grad(like: torch.Tensor, src: int, tag: int = 0, group=None) -> torch.Tensor:
    work, buf = post_recv_grad(like, src, tag=tag, group=group)
    work.wait()
    return buf


def post_recv_grad(like: torch.Tensor, src: int, tag: int = 0, group=None):
    """Start receiving the gradient of ``like`` now; returns ``(work, buffer)``: wait on the work, then read."""
    buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return dist.irecv(buf, src, group=group, tag=tag), buf


def wait_all(works: list) -> None:
    for work, _ in works:
        work.wait()
    works.clear()
