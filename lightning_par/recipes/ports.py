"""The TCP ports our launches pick for themselves (rendezvous endpoints, the torchft lighthouse, the ranks a test or a
benchmark forks), shared by the recipes' launchers, the benchmarks and the tests."""
from __future__ import annotations

import random
import socket


# [Note: a free port below the ephemeral range]
# A port picked by binding port 0 is an ephemeral one: the range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999
# by default) from which the kernel also takes the local port of every outgoing connection. Between the pick and the
# listener's bind (seconds of imports, for a torchrun agent or a restarted rank), another process's connection (the
# other test worker's gloo pairs, a TCP store client) can take it: the bind fails, and torch's c10d rendezvous then
# waits as a client of a store that is not there (seen: a checkpoint restart's relaunch timed out so, under load).
# Only an explicit bind takes a port below that range, as torchrun's default 29500 is, so the pick is made there.
def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, below the kernel's ephemeral range ([Note: a free port below the ephemeral
    range]); an ephemeral one where no port is free below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; elsewhere the same bound, or the ephemeral fallback below
    below = range(10000, low)  # empty where the ephemeral range starts lower
    for port in random.Random().sample(below, k=min(64, len(below))):  # seeded by the OS: callers pick apart
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
