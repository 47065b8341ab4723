"""Ranks a test starts itself, by fork (``torch.multiprocessing``), and ranks forked with the environment torchrun
gives its workers: the launching half of the test harness (:mod:`harness` re-exports these)."""
from __future__ import annotations

import os
import sys
from typing import Callable

import torch

from lightning_par.recipes.ports import free_port


def start_ranks(fn, args, nprocs: int):
    """``torch.multiprocessing.start_processes`` by fork, after collecting this process's garbage: a process
    group an earlier test destroyed may still be held by a reference cycle, and its destructor hangs a forked
    child ([Note: collect before fork] in lightning_par/strategies/_materialize.py), and freezing what survives
    until the ranks are back ([Note: freeze before fork] there)."""
    import gc

    import torch.multiprocessing as mp

    gc.collect()
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    try:
        return mp.start_processes(fn, args=args, nprocs=nprocs, start_method="fork")
    finally:
        if ours:
            gc.unfreeze()


# [Note: a reference run by fork, as torchrun's ranks]
# A reference run that a test compares a torchrun job against (an uninterrupted run, a plain-DDP job) needs no
# torchrun of its own: its result depends on what each rank computes, not on which launcher started it. Forked
# from the pytest process with torchrun's environment (TORCHELASTIC_RUN_ID makes Lightning take the ranks as
# launched), it runs the same entry point in-process and skips the interpreters a torchrun costs: its agent and
# one per rank (~5 CPU-s each here, importing Lightning), most of such a test's cost.
def _as_torchrun_rank(rank: int, target: Callable[[], object], nprocs: int, port: int, log_path: str) -> None:
    os.environ.update(TORCHELASTIC_RUN_ID="fork", RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      ROLE_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      ROLE_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1
    output_to(log_path)  # the rank's output in a log, as a torchrun's (pytest's capture aside)
    target()


def output_to(log_path: str, mode: str = "a") -> None:
    """This (forked) process's stdout and stderr, Python's and the file descriptors, into ``log_path``."""
    log = open(log_path, mode, buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log


def fork_as_torchrun(target: Callable[[], object], nprocs: int, log_path: str) -> None:
    """Run ``target()`` on ``nprocs`` ranks forked from this process, each with the environment torchrun gives
    its workers, their output appended to ``log_path``; raises if a rank fails ([Note: a reference run by fork,
    as torchrun's ranks])."""
    start_ranks(_as_torchrun_rank, (target, nprocs, free_port(), log_path), nprocs)
