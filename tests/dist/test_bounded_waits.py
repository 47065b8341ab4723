"""Every wait is bounded: two ranks launched from outside Lightning (as torchrun launches them, each its
own process with its own environment, tests/dist/faulty_rank.py, forked from this one), one of which stops
answering (SIGSTOP) or dies (SIGKILL) at the start of a training step. The other must exit non-zero in time,
and name the operation it waited for."""
import os
import signal
import sys
import time

import pytest

from harness import free_port

pytestmark = pytest.mark.e2e  # launches processes (pyproject's markers)

STEP = 3


class Rank:
    """One rank forked from this process (it has imported torch and Lightning already: a new interpreter would
    spend ~7 s importing them), running tests/dist/faulty_rank.py's ``main`` with its own environment, as torchrun
    starts a rank; stdout and stderr go to ``log``. ``poll`` / ``wait`` / ``pid`` as a ``subprocess.Popen``'s
    (a signal's death is ``-signum``)."""

    def __init__(self, argv: list[str], log_path):
        import multiprocessing

        self._proc = multiprocessing.get_context("fork").Process(target=self._run, args=(argv, str(log_path)))
        self._proc.start()
        self.pid = self._proc.pid

    @staticmethod
    def _run(argv, log_path):
        log = open(log_path, "w")
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
        import faulty_rank

        faulty_rank.main(argv)

    def poll(self):
        return self._proc.exitcode

    def wait(self):
        self._proc.join()
        return self._proc.exitcode


def launch(tmp_path, strategy: str, fault: str, rank: int, timeout: float, world: int = 2):
    port = free_port()
    return [Rank(["--strategy", strategy, "--fault", fault, "--rank", str(rank), "--step", str(STEP),
                  "--timeout", str(timeout), "--port", str(port), "--out", str(tmp_path), "--me", str(me),
                  "--world", str(world)], tmp_path / f"log{me}") for me in range(world)]


def wait_for_exit(proc, deadline: float):
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    return proc.poll(), time.time()


def fault_time(tmp_path, procs, limit: float = 150.0) -> float:
    marker, start = tmp_path / "fault", time.time()
    while not marker.exists() or not marker.read_text():
        assert time.time() - start < limit, "the faulty rank never reached its step: " + (tmp_path / "log0").read_text()[-3000:]
        assert all(p.poll() is None for p in procs), "a rank ended before the fault: " + \
            (tmp_path / "log0").read_text()[-3000:] + (tmp_path / "log1").read_text()[-3000:]
        time.sleep(0.1)
    return float(marker.read_text())


NAMED = {"dp": "DDP's gradient all-reduce (backward) on rank 0 of 2 did not complete: Timed out waiting",
         "pp": "from rank 1 did not complete: Timed out waiting",  # a pipeline receive, from the stopped stage
         "tp": "the tensor-parallel forward collectives (DTensor all-reduce / all-gather) on rank 0 of 2 did not "
               "complete: Timed out waiting"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["dp", "pp", "tp"])
def test_a_stopped_rank_makes_the_other_fail_in_time_naming_the_wait(tmp_path, strategy):
    timeout = 5.0
    procs = launch(tmp_path, strategy, "stop", rank=1, timeout=timeout)
    try:
        at = fault_time(tmp_path, procs)
        rc, ended = wait_for_exit(procs[0], at + timeout + 30)
        log = (tmp_path / "log0").read_text()
        assert rc not in (None, 0), f"rank 0 still running {time.time() - at:.0f} s after rank 1 stopped"
        assert ended - at <= timeout + 10, f"rank 0 failed {ended - at:.1f} s after rank 1 stopped (timeout {timeout})"
        assert "CommunicationError: " in log and NAMED[strategy] in log, log[-3000:]
        if strategy == "pp":
            assert "pipeline receive of " in log
        assert "Rank 1 stopped answering" in log or "A rank of the group stopped answering" in log
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy,rank", [("dp", 0), ("dp", 1), ("pp", 0), ("pp", 1), ("tp", 0), ("tp", 1)])
def test_a_killed_rank_ends_every_rank_non_zero_within_the_timeout(tmp_path, strategy, rank):
    timeout = 10.0
    procs = launch(tmp_path, strategy, "kill", rank=rank, timeout=timeout)
    try:
        at = fault_time(tmp_path, procs)
        other = procs[1 - rank]
        rc, ended = wait_for_exit(other, at + timeout + 30)
        assert procs[rank].wait() == -signal.SIGKILL
        assert rc not in (None, 0), f"rank {1 - rank} still running {time.time() - at:.0f} s after rank {rank} died"
        assert ended - at <= timeout, f"rank {1 - rank} ended {ended - at:.1f} s after rank {rank} died"
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.timeout(300)
def test_a_killed_rank_of_a_pp2_tp2_hybrid_ends_every_rank_non_zero_within_the_timeout(tmp_path):
    """4 ranks (pp, tp) = (0,0) (0,1) (1,0) (1,1): the last stage's second tensor-parallel rank dies; its
    tensor-parallel peer, the other stage (waiting on point-to-point transfers) and their peers all end."""
    timeout, rank = 10.0, 3
    procs = launch(tmp_path, "hybrid", "kill", rank=rank, timeout=timeout, world=4)
    try:
        at = fault_time(tmp_path, procs, limit=240.0)
        assert procs[rank].wait() == -signal.SIGKILL
        for r, proc in enumerate(procs):
            if r == rank:
                continue
            rc, ended = wait_for_exit(proc, at + timeout + 30)
            assert rc not in (None, 0), f"rank {r} still running {time.time() - at:.0f} s after rank {rank} died"
            assert ended - at <= timeout, f"rank {r} ended {ended - at:.1f} s after rank {rank} died"
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
