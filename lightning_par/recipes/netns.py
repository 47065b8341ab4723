"""Two "nodes" on one Linux machine: two network namespaces joined by a veth pair, torchrun in each.

    with TwoNodeLink() as link:                  # needs root (CAP_NET_ADMIN) and iproute2's `ip` and `tc`
        link.shape("20mbit")                     # tbf on both veth ends; link.shape(None) unshapes
        logs = link.torchrun(["-m", "lightning_par.recipes._node_job", "--layout", "dp", ...], timeout=300)
        link.qdisc(0)                            # `tc qdisc show` of node 0's veth end

Node ``i`` lives in its own namespace with only ``lo`` and one veth end (10.77.0.1 and 10.77.0.2), so
everything the two torchrun launches send each other crosses the veth and nothing else: the
rendezvous (``--rdzv-backend c10d`` on node 0's address), the workers' TCP store and gloo
(``GLOO_SOCKET_IFNAME`` = the node's veth end). The namespaces are new and private to one
:class:`TwoNodeLink`, so these addresses meet nothing else on the machine.

[Note: names, cleanup and bounded waits]
Names carry the creating process's id and a counter (``lp<pid>n<k>a``; an interface name has at most
15 characters), so concurrent runs never share a namespace. Leaving the context (normally, on an error,
on pytest-timeout's signal) kills every process still inside the namespaces (``ip netns pids``: only
processes this object started live there) and deletes both namespaces, which destroys the veth pair.
A namespace left by a process that died without cleaning up (SIGKILL) names a dead pid: the next
:class:`TwoNodeLink` deletes it. Every subprocess runs with a timeout; torchrun's rendezvous has its
own join timeout so a node whose peer never comes fails by itself.

[Note: shaping with tc]
``shape(rate)`` installs a token bucket (``tbf``) as the root qdisc of both veth ends: each direction
is limited to ``rate``. The bucket (``burst``) holds 1 ms of traffic at ``rate``, at least 16 KiB: a
bucket as large as a step's traffic lets that traffic through at memory speed whenever the compute
between two steps refills it, hiding the rate from small per-step messages; the timer is
high-resolution, so a small bucket still reaches ``rate``, and tbf cuts larger GSO packets into
segments that fit. The queue (``limit``) is large enough that TCP's own pacing, not tail drops,
keeps the link busy; drops would add retransmitted bytes and make the byte counts depend on timing, so
``tc -s qdisc show`` is kept with every measurement (:func:`qdisc_drops` reads it). A delay needs
``netem`` (``sch_netem``), which some kernels lack: ``shape_interface(..., delay_ms=d)`` adds it under the
tbf only where :func:`netem_available` and says in its result whether it was applied. The shaping can be
set from outside (``tc -n <namespace>``) or by a job inside the namespace (plain ``tc``, as root there):
the network recipe's job reshapes its own veth end between runs, so one torchrun launch measures every
rate.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ADDRESSES = ("10.77.0.1", "10.77.0.2")
NETNS_ENV = "LIGHTNING_PAR_NETNS"  # set by TwoNodeLink.torchrun: the veth end (= namespace) a job may shape
BURST_MIN = 16 * 1024  # bytes; tbf's bucket (see the Note on shaping)
PREFIX = "lp"
_counter = itertools.count()


class NetnsUnavailable(RuntimeError):
    """Network namespaces, veth pairs or tc cannot be used here (not root, no CAP_NET_ADMIN, no iproute2)."""


@dataclass(frozen=True)
class Node:
    namespace: str
    ifname: str
    addr: str

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _run(argv: list[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res


def _need_tools() -> None:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"{' and '.join(missing)} not found: install iproute2 (`apt-get install -y iproute2`).")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(namespace: str) -> None:
    res = _run(["ip", "netns", "pids", namespace], check=False)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    _run(["ip", "netns", "del", namespace], check=False)


def sweep_stale() -> list[str]:
    """Delete namespaces of this module whose creating process is gone (see the module's Note)."""
    res = _run(["ip", "netns", "list"], check=False)
    gone = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)n\d+[ab]", name)
        if m and not _pid_alive(int(m.group(1))):
            _delete(name)
            gone.append(name)
    return gone


class TwoNodeLink:
    """Two namespaces joined by a veth pair (see the module's Notes); a context manager."""

    def __init__(self):
        k = next(_counter)
        base = f"{PREFIX}{os.getpid()}n{k}"
        self.nodes = (Node(base + "a", base + "a", ADDRESSES[0]), Node(base + "b", base + "b", ADDRESSES[1]))
        self._made: list[str] = []
        self.launches = 0

    # -- lifetime -------------------------------------------------------------------------------
    def __enter__(self) -> "TwoNodeLink":
        _need_tools()
        sweep_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        a, b = self.nodes
        for node in self.nodes:
            res = _run(["ip", "netns", "add", node.namespace], check=False)
            if res.returncode:
                raise NetnsUnavailable(
                    f"`ip netns add {node.namespace}` failed: {res.stderr.strip()}. Network namespaces need root "
                    f"(CAP_NET_ADMIN and CAP_SYS_ADMIN); run the test or recipe as root, e.g. in a container started "
                    f"with --cap-add NET_ADMIN --cap-add SYS_ADMIN or --privileged.")
            self._made.append(node.namespace)
        _run(["ip", "link", "add", a.ifname, "netns", a.namespace, "type", "veth",
              "peer", "name", b.ifname, "netns", b.namespace])
        for node in self.nodes:
            # IPv6 off: its neighbour discovery would add packets of its own to the byte counts
            _run(node.cmd("sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6"), check=False)
            _run(["ip", "-n", node.namespace, "addr", "add", f"{node.addr}/24", "dev", node.ifname])
            _run(["ip", "-n", node.namespace, "link", "set", node.ifname, "up"])
            _run(["ip", "-n", node.namespace, "link", "set", "lo", "up"])

    def close(self) -> None:
        while self._made:
            _delete(self._made.pop())

    # -- the link ---------------------------------------------------------------------------------
    def counters(self) -> list[dict[str, int]]:
        """Per node: bytes and packets its veth end sent and received so far (the kernel's counters)."""
        out = []
        for node in self.nodes:
            stats = {}
            for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
                res = _run(node.cmd("cat", f"/sys/class/net/{node.ifname}/statistics/{key}"))
                stats[key] = int(res.stdout)
            out.append(stats)
        return out

    def qdisc(self, i: int, stats: bool = False) -> str:
        """``tc qdisc show`` of node ``i``'s veth end (with ``-s``: bytes sent, drops)."""
        return qdisc_show(self.nodes[i].ifname, stats, tc=("tc", "-n", self.nodes[i].namespace))

    def drops(self) -> list[int]:
        """Packets each veth end's qdiscs dropped so far."""
        return [qdisc_drops(self.qdisc(i, stats=True)) for i in range(2)]

    def netem_available(self) -> bool:
        """Whether this kernel has netem (tried on node 0's veth end: call it while the link is unshaped)."""
        node = self.nodes[0]
        return netem_available(node.ifname, tc=("tc", "-n", node.namespace))

    def shape(self, rate: str | None, delay_ms: float = 0.0) -> dict:
        """Shape both veth ends (see :func:`shape_interface`); returns what was applied at node 0."""
        return [shape_interface(n.ifname, rate, delay_ms, tc=("tc", "-n", n.namespace)) for n in self.nodes][0]

    # -- launching --------------------------------------------------------------------------------
    def torchrun(self, job: list[str], *, log_dir: Path, timeout: float, env: dict[str, str] | None = None,
                 nproc_per_node: int = 1) -> list[str]:
        """``torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d ... <job>`` once per namespace; wait for
        both (at most ``timeout`` s, then kill both); return their logs, or raise with their tails."""
        self.launches += 1
        port = 29400 + self.launches  # a fresh port per launch: no TIME_WAIT socket in the way
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        procs, logs = [], []
        try:
            for i, node in enumerate(self.nodes):
                node_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": node.ifname,
                            "NCCL_SOCKET_IFNAME": node.ifname, NETNS_ENV: node.ifname}
                argv = node.cmd(
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRESSES[0]}:{port}",
                    "--rdzv-id", f"{node.namespace[:-1]}-{self.launches}",
                    "--rdzv-conf", f"is_host={int(i == 0)},join_timeout={int(timeout)},read_timeout=60",
                    "--local-addr", node.addr, *job)
                logs.append(log_dir / f"node{i}.log")
                with open(logs[-1], "w") as fh:
                    procs.append(subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=node_env,
                                                  start_new_session=True))
            codes = _wait_all(procs, timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)  # the process group we started it in
                    except ProcessLookupError:
                        pass
                    p.wait(timeout=30)
            for node in self.nodes:
                _kill_inside(node.namespace)
        texts = [log.read_text(errors="replace") for log in logs]
        if codes is None or any(c != 0 for c in codes):
            what = f"timed out after {timeout:.0f} s" if codes is None else f"exited with {codes}"
            tails = "\n".join(f"--- node {i} ({log}) ---\n{t[-3000:]}" for i, (log, t) in enumerate(zip(logs, texts)))
            raise RuntimeError(f"two-node torchrun {what}:\n{tails}")
        return texts


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None] | None:
    """Exit codes of all ``procs``; as soon as one fails the others are not waited for (their code is None: the
    caller kills them), and None when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return codes
        time.sleep(0.2)
    return None


def qdisc_show(ifname: str, stats: bool = False, tc: tuple[str, ...] = ("tc",)) -> str:
    return _run([*tc, *(["-s"] if stats else []), "qdisc", "show", "dev", ifname]).stdout


def qdisc_drops(text: str) -> int:
    """Packets dropped, summed over the qdiscs of a ``tc -s qdisc show`` output."""
    return sum(int(x) for x in re.findall(r"dropped (\d+)", text))


def netem_available(ifname: str, tc: tuple[str, ...] = ("tc",)) -> bool:
    """Whether this kernel has netem: tried as ``ifname``'s root qdisc, then removed (the default returns).
    ``ifname`` must have the default root qdisc (an installed one makes the trial fail)."""
    res = _run([*tc, "qdisc", "add", "dev", ifname, "root", "handle", "9:", "netem", "delay", "1ms"], check=False)
    if res.returncode:
        return False
    _run([*tc, "qdisc", "del", "dev", ifname, "root"])
    return True


def shape_interface(ifname: str, rate: str | None, delay_ms: float = 0.0, *, tc: tuple[str, ...] = ("tc",),
                    limit: str = "16mb") -> dict:
    """Limit what ``ifname`` sends to ``rate`` (tc syntax, "100mbit"; None: no limit) with a tbf root qdisc and,
    where netem exists, delay every packet by ``delay_ms`` (see the module's Note). ``tc`` is the command
    prefix: ``("tc",)`` inside the interface's namespace, ``("tc", "-n", namespace)`` from outside.
    Returns what was applied."""
    if rate is not None:
        rate_bits_per_s(rate)  # refuse a malformed rate before touching the qdisc
    _run([*tc, "qdisc", "del", "dev", ifname, "root"], check=False)  # back to the default qdisc
    netem = bool(delay_ms) and netem_available(ifname, tc)
    if rate is not None:
        burst = max(BURST_MIN, int(rate_bits_per_s(rate) / 8 / 1000))  # see the Note on shaping
        _run([*tc, "qdisc", "add", "dev", ifname, "root", "handle", "1:", "tbf", "rate", rate, "burst", str(burst),
              "limit", limit])
    if netem:
        parent = ["parent", "1:1"] if rate is not None else ["root"]
        _run([*tc, "qdisc", "add", "dev", ifname, *parent, "handle", "10:", "netem", "delay", f"{delay_ms}ms"])
    return {"rate": rate, "delay_requested_ms": delay_ms, "delay_applied": netem,
            "qdisc": qdisc_show(ifname, tc=tc).strip()}


def rate_bits_per_s(rate: str) -> float:
    """tc's rate syntax ("100mbit", "20Mbit", "1gbit", "500kbit") in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r} must be a number followed by kbit, mbit or gbit (tc syntax), e.g. '100mbit'.")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
