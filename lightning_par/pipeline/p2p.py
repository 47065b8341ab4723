"""Point-to-point transfer of activations between neighbouring stages.

An activation travels as a small int64 header (dtype code, rank, shape) followed by the data, so the
receiver needs no prior knowledge of shapes (the last micro-batch may be smaller, autocast may change
dtypes); see [Note: speculative receive] for how the data's receive is still posted ahead of its send. Gradients travel back without a header: their shape and dtype are the sent activation's.
Sends are asynchronous (``isend``; the caller waits on the handles at the end of the step), receives
block, bounded by the process group's timeout. Activations and gradients travel in separate process
groups (``group``): on NCCL each group is its own communicator and stream, so a pending send in one
direction cannot hold up a receive in the other (a cycle GPipe and 1F1B would otherwise form when a
send only completes once the peer receives). Every schedule here sends and receives in the same
order on each channel (checked in the unit tests), so matching does not rely on tags, which NCCL ignores.
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
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1], header[2] = _DTYPES.index(tensor.dtype), tensor.dim(), int(refill)
    header[3:3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


# [Note: speculative receive] A receive posted before its send lets the transfer run while the receiver
# computes; one posted after it waits for a round trip through the sender's progress thread (gloo hands
# over an unannounced message only once the receiver asks for it), and on a busy CPU that cost 2-3 ms per
# micro-batch on 1F1B's critical path. A stage therefore posts, with the next header's receive, a receive
# for the next activation's data shaped like the one just received (the micro-batches of a step almost
# always agree), and when a step begins, one for its first activation shaped like the previous step's
# first. The sender knows what was posted (the previous activation it sent on the channel): when the
# new activation differs in shape or dtype (a smaller last micro-batch, autocast), its header says
# "refill", a filler of the old shape satisfies the posted receive, and the data follows with the shape
# the header gives. Both sides apply the rule to the same micro-batches, so sends and receives still
# match in order on the channel.


def send_activation(tensor: torch.Tensor, dst: int, works: list, tag: int = 0, group=None,
                    posted_like: tuple | None = None) -> None:
    """Send ``tensor`` with its header; ``posted_like``: ``(shape, dtype)`` of the data receive the peer has
    already posted for it (see [Note: speculative receive]), or ``None`` when it posted none."""
    data = tensor.detach().contiguous()
    refill = posted_like is not None and posted_like != (tuple(data.shape), data.dtype)
    header = header_of(data, refill).to(data.device)
    works.append((dist.isend(header, dst, group=group, tag=tag), header))
    if refill:
        filler = torch.zeros(posted_like[0], dtype=posted_like[1], device=data.device)
        works.append((dist.isend(filler, dst, group=group, tag=tag), filler))
    works.append((dist.isend(data, dst, group=group, tag=tag), data))  # keep the buffers alive until the wait


def post_recv_activation(src: int, device: torch.device, tag: int = 0, group=None, like: tuple | None = None):
    """Start receiving the next activation now: its header, and with ``like`` (``(shape, dtype)`` of the
    previous activation from ``src``) its data, speculatively shaped so. Pass the result to
    :func:`recv_activation`."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    posted = [dist.irecv(header, src, group=group, tag=tag), header, None, None]
    if like is not None:
        buf = torch.empty(like[0], dtype=like[1], device=device)
        posted[2:] = dist.irecv(buf, src, group=group, tag=tag), buf
    return tuple(posted)


def recv_activation(src: int, device: torch.device, tag: int = 0, group=None, posted=None) -> torch.Tensor:
    """Receive one activation (header, then data); ``posted``: what :func:`post_recv_activation` started."""
    if posted is None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, src, group=group, tag=tag)
    else:
        work, header, data_work, data = posted
        work.wait()
        if data_work is not None:
            data_work.wait()
            if not int(header[2]):
                return data
    header = header.cpu()
    shape = header[3:3 + int(header[1])].tolist()
    buf = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
    dist.recv(buf, src, group=group, tag=tag)
    return buf


def send_grad(grad: torch.Tensor, dst: int, works: list, tag: int = 0, group=None) -> None:
    data = grad.detach().contiguous()
    works.append((dist.isend(data, dst, group=group, tag=tag), data))


def recv_grad(like: torch.Tensor, src: int, tag: int = 0, group=None) -> torch.Tensor:
    buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    dist.recv(buf, src, group=group, tag=tag)
    return buf


def post_recv_grad(like: torch.Tensor, src: int, tag: int = 0, group=None):
    """Start receiving the gradient of ``like`` now; returns ``(work, buffer)``: wait on the work, then read."""
    buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return dist.irecv(buf, src, group=group, tag=tag), buf


def wait_all(works: list) -> None:
    for work, _ in works:
        work.wait()
    works.clear()
