"""Bounded waits that say what they waited for.

[Note: every wait bounded] Every process group of the package is created with the strategy's ``timeout``
(Lightning's world group, ``dist.new_group(..., timeout=)`` for the pipeline's groups,
:meth:`lightning_par.topology.Topology.build_mesh` for the mesh axes), and gloo bounds each collective and
each point-to-point receive by its group's timeout; a peer that died closes its sockets, which fails the
wait at once. What the backend then raises names neither the operation nor the peer ("Timed out waiting
5000ms for recv operation to complete"), so the waits of the package run inside :func:`named_wait`,
which re-raises such a failure as a :class:`CommunicationError` naming the operation, the peer where one
is known, and the likely cause. Failures that are not communication failures pass through untouched.

[Note: what counts as a lost peer]
Only what a lost peer causes: a ``torch.distributed.DistBackendError`` (NCCL's and the c10d backends' report
of a failed or timed-out operation, unless it reports an invalid usage or argument), or an error whose text
is a transport's report of a wait that timed out or of a connection the peer closed (gloo raises a plain
``RuntimeError`` for these in torch 2.13: "Timed out waiting 5000ms for recv operation", "Application
timeout caused pair closure", "Connection reset by peer"; the TCP store "wait timeout after 5000ms"). The
name of a backend in a message says nothing about a peer: an invalid use of a collective (a wrong dtype, a
bad rank) mentions "ProcessGroupGloo" or "NCCL" too, and passes through as what it is.

Example::

    >>> try:
    ...     with named_wait("pipeline receive of an activation from rank 1", peer=1):
    ...         raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete")
    ... except CommunicationError as e:
    ...     print(e)
    pipeline receive of an activation from rank 1 did not complete: Timed out waiting 5000ms for recv operation to complete. Rank 1 stopped answering within the collective timeout (stopped, hung or overloaded) or died; its own log says why.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist

# the transports' words for a wait that timed out or a peer that closed its connection ([Note: what counts as a
# lost peer]); a user's own error inside a step does not say them
_LOST_PEER = re.compile(r"Timed out waiting|Application timeout caused pair closure|wait timeout after|"
                        r"Socket Timeout|collective operation timeout|Connection (closed|reset) by peer|"
                        r"Write error .*Broken pipe", re.IGNORECASE)
# NCCL's ncclInvalidUsage / ncclInvalidArgument arrive as DistBackendError too: a mistake, not a lost peer
_MISUSE = re.compile(r"invalid (usage|argument)", re.IGNORECASE)


class CommunicationError(RuntimeError):
    """A collective or point-to-point transfer that failed: its peer stopped answering or died."""


def is_communication_failure(error: BaseException) -> bool:
    """Whether ``error`` is a lost peer's mark: a ``DistBackendError``, or a transport's report of a timeout or a
    closed connection ([Note: what counts as a lost peer])."""
    if isinstance(error, CommunicationError):
        return False  # named already
    backend_error = getattr(dist, "DistBackendError", ())  # absent where torch has no distributed
    text = str(error)
    if not isinstance(error, RuntimeError) or _MISUSE.search(text):
        return False
    return isinstance(error, backend_error) or bool(_LOST_PEER.search(text))


def _backend_text(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[path/file.cc:78] " prefix


@contextmanager
def named_wait(op: str, *, peer: Optional[int] = None):
    """Run a wait; a communication failure inside it becomes a :class:`CommunicationError` naming ``op``
    (which names the peer, if any) and blaming ``peer`` (a global rank; ``None``: a collective's group)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised as it is unless a communication failure
        if not is_communication_failure(error):
            raise
        who = f"Rank {peer}" if peer is not None else "A rank of the group"
        raise CommunicationError(
            f"{op} did not complete: {_backend_text(error)}. {who} stopped answering within the "
            f"collective timeout (stopped, hung or overloaded) or died; its own log says why."
        ) from error
