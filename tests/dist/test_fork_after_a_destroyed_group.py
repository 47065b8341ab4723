"""A fork launch after this process made and destroyed a process group ([Note: collect before fork] in
lightning_par/strategies/_materialize.py): an earlier one-device fit leaves its world group's object in a
reference cycle; a forked rank whose cyclic collector frees it waited forever in the backend's destructor."""
import gc

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from harness import fit_and_record, free_port, seeded
from models import GPT_SIZES, corpus
from lightning_par import DataParallelStrategy, TensorParallelStrategy
from lightning_par.models import GPT

DATA = corpus(train_sequences=16)


class CollectingGPT(GPT):
    """The reference GPT whose step runs the cyclic collector, as any allocation in a rank may."""

    def training_step(self, batch, batch_idx):
        gc.collect()
        return super().training_step(batch, batch_idx)


class _Cycle:
    pass


def _destroyed_group_held_by_a_cycle() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    held = _Cycle()
    held.me, held.group = held, dist.new_group([0])
    dist.all_reduce(torch.ones(1), group=held.group)
    dist.destroy_process_group()


@pytest.mark.timeout(90)  # a fit of two ranks takes seconds; without the collection before the fork it never ends
@pytest.mark.parametrize("strategy", [lambda: DataParallelStrategy(start_method="fork", timeout=60),
                                      lambda: TensorParallelStrategy(tensor_parallel_size=2, start_method="fork",
                                                                     timeout=60)], ids=["dp", "tp"])
def test_ranks_forked_after_a_destroyed_group_train(tmp_path, strategy):
    gc.disable()  # the cycle survives until the launch, as it does whenever the collector has not run yet
    try:
        _destroyed_group_held_by_a_cycle()
        recs = fit_and_record(seeded(lambda: CollectingGPT(**GPT_SIZES)), DataLoader(DATA.train_set, batch_size=4),
                              str(tmp_path), strategy=strategy(), devices=2, max_steps=2)
    finally:
        gc.enable()
    assert len(recs) == 2 and all(len(r["losses"]) == 2 for r in recs)
