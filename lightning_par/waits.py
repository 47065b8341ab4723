"""Bounded waits that say what they waited for.

[Note: every wait bounded] Every process group of the package is created with the strategy's ``timeout``
(Lightning's world group, ``dist.new_group(..., timeout=)`` for the pipeline's groups,
:meth:`lightning_par.topology.Topology.build_mesh` for the mesh axes), and gloo bounds each collective and
each point-to-point receive by its group's timeout; a peer that died closes its sockets, which fails the
wait at once. What the backend then raises names neither the operation nor the peer ("Timed out waiting
5000ms for recv operation to complete"), so the waits of the package run inside :func:`named_wait`,
which re-raises such a failure as a :class:`CommunicationError` naming the operation, the peer where one
is known, and the likely cause. Failures that are not communication failures pass through untouched.

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

# what gloo, NCCL and the TCP store say when a peer is gone; a user's own error inside a step rarely says it
_FAILURES = re.compile(r"Timed out waiting|Connection (closed|reset) by peer|Broken pipe|ProcessGroupGloo|NCCL|"
                       r"watchdog|Socket Timeout", re.IGNORECASE)


class CommunicationError(RuntimeError):
    """A collective or point-to-point transfer that failed: its peer stopped answering or died."""


def is_communication_failure(error: BaseException) -> bool:
    """Whether ``error`` is a backend's report of a timeout or a lost connection (gloo / NCCL / the store)."""
    if isinstance(error, CommunicationError):
        return False  # named already
    name = type(error).__name__
    return name in ("DistBackendError", "DistNetworkError", "DistStoreError") or (
        isinstance(error, RuntimeError) and bool(_FAILURES.search(str(error))))


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
