"""Point-to-point transfer of activations between neighbouring stages.

An activation travels as a small int64 header (dtype code, rank, shape) followed by the data, so the
receiver needs no prior knowledge of shapes (the last micro-batch may be smaller, autocast may change
dtypes). Gradients travel back without a header: their shape and dtype are the sent activation's.
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
_HEADER = 2 + _MAX_DIMS


def header_of(tensor: torch.Tensor) -> torch.Tensor:
    """The header that announces ``tensor``.

    Example::

        >>> header_of(torch.zeros(2, 3)).tolist()[:4]
        [0, 2, 2, 3]
    """
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ValueError(
            f"A block output of shape {tuple(tensor.shape)} and dtype {tensor.dtype} cannot cross a pipeline "
            f"stage boundary: at most {_MAX_DIMS} dimensions and one of {_DTYPES}."
        )
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def send_activation(tensor: torch.Tensor, dst: int, works: list, tag: int = 0, group=None) -> None:
    data = tensor.detach().contiguous()
    header = header_of(data).to(data.device)
    works.append((dist.isend(header, dst, group=group, tag=tag), header))
    works.append((dist.isend(data, dst, group=group, tag=tag), data))  # keep the buffers alive until the wait


def post_recv_header(src: int, device: torch.device, tag: int = 0, group=None):
    """Start receiving the header of the next activation now; pass the result to :func:`recv_activation`."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    return dist.irecv(header, src, group=group, tag=tag), header


def recv_activation(src: int, device: torch.device, tag: int = 0, group=None, posted=None) -> torch.Tensor:
    """Receive one activation (header, then data); ``posted``: the header's receive, already started."""
    if posted is None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, src, group=group, tag=tag)
    else:
        work, header = posted
        work.wait()
    header = header.cpu()
    shape = header[2:2 + int(header[1])].tolist()
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
