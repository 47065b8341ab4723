"""The mesh's axis groups give up within the strategy's timeout when a peer never joins (no hang)."""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness import TIMEOUT_S, free_port, start_ranks
from lightning_par.topology import Topology


def _worker(rank, port, out):
    timeout = timedelta(seconds=3)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout)
    mesh = Topology(tensor_parallel_size=2).build_mesh("cpu", timeout=timeout)
    if rank == 0:  # rank 1 never joins this all-reduce
        start = time.perf_counter()
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1), group=mesh.get_group("tp"))
        out.put(time.perf_counter() - start)
    else:
        time.sleep(8)


@pytest.mark.timeout(TIMEOUT_S)
def test_axis_group_collective_times_out_with_the_given_timeout():
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start_ranks(_worker, (free_port(), out), 2)
    assert 2.5 < out.get(timeout=30) < 7.5  # the 3 s given, not torch's 30-minute default
