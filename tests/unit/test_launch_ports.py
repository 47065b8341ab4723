"""The ports our launches pick for themselves: free, and below the kernel's ephemeral range ([Note: a free port below
the ephemeral range] in lightning_par/recipes/ports.py)."""
import os
import random
import socket

import pytest

from lightning_par.recipes.ports import free_port

RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


@pytest.mark.skipif(not os.path.exists(RANGE), reason="the ephemeral range is read from /proc (Linux)")
def test_a_picked_port_is_free_and_below_the_ephemeral_range():
    low = int(open(RANGE).read().split()[0])
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < low
        with socket.socket() as s:  # free: a listener can take it now
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]

        class FirstTheTakenPort:  # the draw offers the port in use first
            def sample(self, population, k):
                return [taken, *random.sample(population, k - 1)]

        monkeypatch.setattr(random, "Random", FirstTheTakenPort)
        port = free_port()
    assert port != taken
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
