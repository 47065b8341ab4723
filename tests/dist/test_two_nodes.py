"""Two nodes for real: two network namespaces joined by a veth pair, ``torchrun --nnodes 2 --rdzv-backend c10d``
in each (one rank per node, gloo bound to the veth), against one device on the same global batches.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2, as CI has (``.ci/run`` installs iproute2): without
them these tests fail with the reason (``NetnsUnavailable``), they are never skipped.
"""
import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from harness import TIMEOUT_S
from lightning_par.recipes import netns
from lightning_par.recipes._node_job import case_dir, load_records
from lightning_par.recipes.netns import TwoNodeLink
from lightning_par.recipes.network import global_losses, job_args

pytestmark = pytest.mark.e2e  # launches processes (pyproject's markers)
FRAME_HEADER_BYTES = 14 + 20 + 20 + 12  # Ethernet, IPv4, TCP, TCP timestamps option: the most a veth frame adds

# 4 blocks of width 16: 2 per pipeline stage; 8 sequences × 16 tokens per step, 4 steps of AdamW
CFG = SimpleNamespace(steps=4, global_batch=8, microbatches=4, timeout_s=120, delay_ms=0,
                      model={"vocab_size": 32, "block_size": 16, "n_layer": 4, "n_head": 2, "n_embd": 16})


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def pids_inside(namespace: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                          timeout=30).stdout.split()


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_dp_and_pp_across_two_nodes_equal_one_device(tmp_path):
    subprocess.run([sys.executable, *job_args(CFG, tmp_path, ["single"])], check=True, timeout=TIMEOUT_S / 3,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    ref = load_records(case_dir(tmp_path, "single"))[0]
    with TwoNodeLink() as link:
        before = link.counters()
        link.torchrun(job_args(CFG, tmp_path, ["dp", "pp"], ["unshaped"]), log_dir=tmp_path / "logs",
                      timeout=TIMEOUT_S * 2 / 3 - 10)
        after = link.counters()
    gradient_bytes = 4 * sum(p.numel() for p in ref["params"].values())
    own_netns = os.stat("/proc/self/ns/net").st_ino
    for layout in ("dp", "pp"):
        recs = load_records(case_dir(tmp_path, layout))
        assert [r["rank"] for r in recs] == [0, 1] and all(r["world_size"] == 2 for r in recs)
        # one rank per node, each in its own namespace (neither is this process's)
        assert len({r["netns"] for r in recs}) == 2 and own_netns not in {r["netns"] for r in recs}
        assert {r["node"] for r in recs} == {0, 1}
        # the global batch's loss at every step, and every parameter each rank owns, equal one device's
        torch.testing.assert_close(torch.tensor(global_losses(recs, layout)), torch.tensor(ref["losses"]),
                                   atol=1e-5, rtol=1e-5)
        for rec in recs:
            if layout == "pp":
                torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), atol=1e-5,
                                           rtol=1e-5)
            assert rec["params"], f"{layout} rank {rec['rank']} owns no parameter"
            for name, p in rec["params"].items():
                torch.testing.assert_close(p, ref["params"][name], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{layout} rank {rec['rank']} {name}: {m}")
        owned = [set(r["params"]) for r in recs]
        if layout == "dp":
            assert owned[0] == owned[1] == set(ref["params"])
        else:  # the two stages split the blocks between them and together hold every parameter
            assert owned[0] | owned[1] == set(ref["params"])
            assert any(n.startswith("blocks.0.") for n in owned[0]) and not any(n.startswith("blocks.0.")
                                                                                for n in owned[1])
        # the traffic crossed the veth: each step, DP sends every gradient byte once (ring, N=2), and PP the
        # 8 × 16 × 16 fp32 boundary activations forward (stage 0) or their gradients back (stage 1)
        least = gradient_bytes if layout == "dp" else 8 * 16 * 16 * 4
        for rec in recs:
            assert min(rec["tx_bytes"]) >= least, (layout, rec["rank"], rec["tx_bytes"], least)
            counted = json.loads((case_dir(tmp_path, layout) / "metrics.json").read_text())[rec["rank"]]["comm_bytes"]
            # beyond the payload, every frame carries its headers (Ethernet 14 + IPv4 20 + TCP 20 + timestamps
            # 12 bytes), and a loaded machine sends more, smaller frames and more bare ACKs: the bound counts them
            headers = FRAME_HEADER_BYTES * rec["tx_packets"][1]
            assert counted <= rec["tx_bytes"][1] < 1.1 * counted + 4096 + headers, (
                layout, counted, rec["tx_bytes"], rec["tx_packets"])
    # the ranks' per-step counters read the veth ends this process sees from outside
    sent = sum(sum(r["tx_bytes"]) for lay in ("dp", "pp") for r in load_records(case_dir(tmp_path, lay)))
    assert sum(a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)) >= sent > 0


def _transfer(link: TwoNodeLink, nbytes: int, port: int) -> float:
    """Send ``nbytes`` over TCP from node 0 to node 1; the seconds the sender took (its last byte acknowledged)."""
    server = ("import socket; s = socket.create_server(('{addr}', {port})); c, _ = s.accept(); n = 0\n"
              "while n < {n}:\n    b = c.recv(1 << 16)\n    n += len(b)\n    assert b\n"
              "c.sendall(b'k')").format(addr=netns.ADDRESSES[1], port=port, n=nbytes)
    client = ("import socket, time\nfor _ in range(200):\n    try:\n"
              "        c = socket.create_connection(('{addr}', {port}), timeout=60); break\n"
              "    except OSError:\n        time.sleep(0.05)\n"
              "t = time.perf_counter(); c.sendall(bytes({n})); c.recv(1); print(time.perf_counter() - t)"
              ).format(addr=netns.ADDRESSES[1], port=port, n=nbytes)
    srv = subprocess.Popen(link.nodes[1].cmd(sys.executable, "-c", server))
    try:
        out = subprocess.run(link.nodes[0].cmd(sys.executable, "-c", client), capture_output=True, text=True,
                             timeout=60, check=True).stdout
        srv.wait(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(timeout=30)
    assert srv.returncode == 0
    return float(out)


@pytest.mark.timeout(TIMEOUT_S)
def test_shaping_limits_the_link_and_the_counters_count_it():
    nbytes, rate = 2_000_000, 8e6  # 2 MB at 8 Mbit/s: 2 s on the wire
    with TwoNodeLink() as link:
        has_netem = link.netem_available()
        shaped = link.shape("8mbit", delay_ms=5)
        for i in (0, 1):
            assert "tbf 1: root" in link.qdisc(i) and "rate 8Mbit" in link.qdisc(i), link.qdisc(i)
        # a delay needs netem: applied exactly when the kernel has it, and the result says which
        assert shaped["delay_applied"] == ("netem" in link.qdisc(0)) == has_netem
        before = link.counters()
        seconds = _transfer(link, nbytes, 29001)
        after = link.counters()
        # the token bucket lets at most its burst through ahead of the rate
        assert seconds >= (nbytes - netns.BURST_MIN) * 8 / rate * 0.97, seconds
        assert after[0]["tx_bytes"] - before[0]["tx_bytes"] >= nbytes
        assert after[1]["rx_bytes"] - before[1]["rx_bytes"] == after[0]["tx_bytes"] - before[0]["tx_bytes"]
        assert sum(link.drops()) == 0
        link.shape(None)
        assert "tbf" not in link.qdisc(0) + link.qdisc(1)
        assert _transfer(link, nbytes, 29002) < seconds / 4


@pytest.mark.timeout(TIMEOUT_S)
def test_namespaces_are_removed_on_error_and_timeout(tmp_path):
    with pytest.raises(KeyError):
        with TwoNodeLink() as link:
            made = {n.namespace for n in link.nodes}
            assert made <= namespaces()
            raise KeyError("boom")
    assert not made & namespaces()
    with TwoNodeLink() as link:
        made = {n.namespace for n in link.nodes}
        with pytest.raises(RuntimeError, match="timed out after 3 s"):
            link.torchrun(["--no-python", "sleep", "600"], log_dir=tmp_path, timeout=3)
        assert all(not pids_inside(ns) for ns in made)  # torchrun and whatever it started were killed
    assert not made & namespaces()


@pytest.mark.timeout(TIMEOUT_S)
def test_namespace_of_a_dead_run_is_swept():
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=30)
    stale = f"{netns.PREFIX}{dead.pid}n0a"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=30)
    try:
        with TwoNodeLink():
            assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=30)


@pytest.mark.timeout(TIMEOUT_S)
def test_without_privileges_the_link_refuses_with_the_reason():
    """Root without CAP_NET_ADMIN / CAP_SYS_ADMIN (the bounding set drops them) cannot make namespaces."""
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('netns', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec)\n"
            "sys.modules['netns'] = m\n"
            "spec.loader.exec_module(m)\n"
            "try:\n    m.TwoNodeLink().__enter__()\nexcept m.NetnsUnavailable as e:\n    print(e); sys.exit(3)\n")
    res = subprocess.run(["setpriv", "--bounding-set", "-net_admin,-sys_admin", sys.executable, "-c", code,
                          netns.__file__], capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "ip netns add" in res.stdout and "CAP_NET_ADMIN" in res.stdout and "root" in res.stdout
