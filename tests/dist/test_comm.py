"""The communication counter on real gloo ranks: what each op sends, by the textbook algorithms."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import TIMEOUT_S, free_port, start_ranks
from lightning_par.comm import CommCounter, count_comm


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    counter = CommCounter()
    with count_comm(counter):
        dist.all_reduce(torch.ones(10))                      # 40 B payload: 2(N-1)/N × 40 = 40 B sent
        dist.broadcast(torch.ones(5), src=1)                 # 20 B: only the root sends
        out = [torch.empty(3) for _ in range(2)]
        dist.all_gather(out, torch.ones(3))                  # 12 B input: (N-1) × 12 = 12 B sent
    torch.save({"calls": dict(counter.calls), "wire": dict(counter.wire), "payload": dict(counter.payload)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_counted_bytes_follow_the_algorithms(tmp_path):
    start_ranks(_worker, (free_port(), str(tmp_path)), 2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for rec in (r0, r1):
        assert rec["calls"] == {"all_reduce": 1, "broadcast": 1, "all_gather": 1}
        assert rec["wire"]["all_reduce"] == 40 and rec["wire"]["all_gather"] == 12
        assert rec["payload"]["broadcast"] == 20
    assert (r0["wire"]["broadcast"], r1["wire"]["broadcast"]) == (0, 20)
