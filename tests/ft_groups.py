"""Replica groups of a fault-tolerance launch forked from the pytest process, as torchrun would run them.

[Note: replica groups by fork]
A torchft launch is a lighthouse and one torchrun per replica group: its agent and a worker per rank, each a new
interpreter (~5 CPU-s here, importing Lightning), and one more per rank of each restart, most of such a test's cost.
What the tests of torchft's side (heal, quorum, a stage's state, DiLoCo's outer state) look at depends on what each
rank computes, not on which launcher started it. :func:`fork_group` plays torchrun's part for one group:

- an agent forked from this process, in a session of its own (``_ft_job.wait_all`` ends it whole with ``killpg``),
  forks the group's ranks with the environment torchrun gives its workers
  (:func:`harness._as_torchrun_rank`; a new rendezvous port per attempt) and ``TORCHELASTIC_RESTART_COUNT``;
- as torchrun's agent (``--max-restarts``), when a rank fails it stops the others (SIGTERM, then SIGKILL after
  ``GRACE_S``) and starts the whole group again while restarts are left, ``RESTART_DELAY_S`` later (what a
  torchrun restart takes); it exits 0 once every rank of an attempt has, and 1 otherwise;
- the ranks run :func:`lightning_par.recipes._ft_job.main`, as a torchrun's workers do, their output in the log
  ``torchrun`` would write (``_ft_job.log_tail`` reads it).

The lighthouse stays a process of its own (torchft's binary), and the launch as users make it, with torchrun, is the
fault_tolerance recipe's, which its quick test checks record by record (tests/dist/test_recipes.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import traceback
from pathlib import Path
from typing import Callable

from harness import _as_torchrun_rank, free_port, output_to

GRACE_S = 30.0  # torchrun's agent waits as long for a stopped worker before its SIGKILL
# A restarted torchrun worker trains again seconds after its predecessor died (a new rendezvous, a new interpreter
# importing Lightning); a forked one would in a fraction of a second, before the lighthouse's heartbeat timeout (2 s
# in these launches) has even dropped it, and the survivor would never train alone. The agent waits as long.
RESTART_DELAY_S = 5.0
POLL_S = 0.05


class ForkedGroup:
    """The agent of one forked group, as much of a ``subprocess.Popen`` as ``_ft_job``'s launcher helpers use."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"replica group agent {self.pid}", timeout)
            time.sleep(POLL_S)
        return self.returncode


def fork_group(out: Path, job_args: list[str], *, group_id: int, num_groups: int, lighthouse: str,
               max_restarts: int, nproc: int = 1, attempt: int = 0) -> ForkedGroup:
    """Replica group ``group_id`` of ``_ft_job.main`` on ``nproc`` ranks, as ``_ft_job.start_group`` launches it
    with torchrun ([Note: replica groups by fork]); ``attempt``: the how-manyth launch of the same run."""
    from lightning_par.recipes import _ft_job as job

    env = dict(REPLICA_GROUP_ID=str(group_id), NUM_REPLICA_GROUPS=str(num_groups), TORCHFT_LIGHTHOUSE=lighthouse,
               **{job.ATTEMPT_ENV: str(attempt)})
    argv = ["--out", str(out), *job_args]
    return fork_agent(lambda: job.main(argv), nproc=nproc, max_restarts=max_restarts, env=env,
                      log=str(out / f"torchrun-g{group_id}.log"))


def fork_agent(target: Callable[[], object], *, nproc: int, max_restarts: int, env: dict, log: str,
               restart_delay_s: float = RESTART_DELAY_S) -> ForkedGroup:
    """An agent forked from this process that runs ``target()`` on ``nproc`` ranks with ``env`` and torchrun's
    environment, restarting them as torchrun's ``--max-restarts`` does (``restart_delay_s`` after a failure), all
    output appended to ``log``."""
    import gc

    gc.collect()  # as harness.start_ranks: no destroyed process group of an earlier test left to a child
    pid = os.fork()
    if pid:
        return ForkedGroup(pid)
    code = 1
    try:
        os.setsid()
        os.environ.update(env, TORCHELASTIC_MAX_RESTARTS=str(max_restarts), PYTHONUNBUFFERED="1")
        output_to(log)
        code = _agent(target, nproc, max_restarts, log, restart_delay_s)
    except BaseException:  # noqa: BLE001 -- the agent's own failure goes to its log and its exit code
        traceback.print_exc()
    finally:
        os._exit(code)


def _agent(target: Callable[[], object], nproc: int, max_restarts: int, log: str, restart_delay_s: float) -> int:
    for restart in range(max_restarts + 1):
        if restart:
            time.sleep(restart_delay_s)
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart)
        port, ranks = free_port(), []
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                _rank(rank, target, nproc, port, log)
            ranks.append(pid)
        codes = _monitor(ranks)
        print(f"fork agent: attempt {restart} ended with exit codes {codes}", flush=True)
        if all(c == 0 for c in codes):
            return 0
    return 1


def _rank(rank: int, target, nproc: int, port: int, log: str) -> None:
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _as_torchrun_rank(rank, target, nproc, port, log)
        code = 0
    except BaseException:  # noqa: BLE001 -- as a torchrun worker's: the traceback in the log, a failed exit
        traceback.print_exc()
    finally:
        os._exit(code)


def _monitor(ranks: list[int]) -> list[int]:
    """Wait for the ranks; once one fails, stop the others as torchrun's agent does. Their exit codes."""
    codes: dict[int, int] = {}
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, 0)
        if pid not in ranks:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:
            _stop([p for p in ranks if p not in codes], codes)
    return [codes[p] for p in ranks]


def _stop(pids: list[int], codes: dict[int, int]) -> None:
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, None)):
        for p in pids:
            if p not in codes:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while any(p not in codes for p in pids) and (deadline is None or time.monotonic() < deadline):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid in pids:
                codes[pid] = os.waitstatus_to_exitcode(status)
            elif not pid:
                time.sleep(POLL_S)
