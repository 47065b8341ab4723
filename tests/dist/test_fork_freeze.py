"""A fork launch freezes the caller's objects for its ranks and gives them back ([Note: freeze before fork] in
lightning_par/strategies/_materialize.py): each rank starts with the caller's surviving objects frozen, and the
caller finds the collector as it left it, whether or not it had frozen objects of its own."""
import gc
import json
import os

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, seeded
from models import corpus, tiny_gpt
from lightning_par import DataParallelStrategy

DATA = corpus(train_sequences=16)


class FrozenInRank(pl.Callback):
    """Writes how many objects the collector holds frozen in this rank at the start of fit."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_fit_start(self, trainer, pl_module):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"frozen{trainer.global_rank}.json"), "w") as f:
            json.dump(gc.get_freeze_count(), f)


def fit_two_ranks(out):
    fit_and_record(seeded(tiny_gpt), DataLoader(DATA.train_set, batch_size=4), str(out),
                   strategy=DataParallelStrategy(start_method="fork"), devices=2, max_steps=1,
                   callbacks=[FrozenInRank(str(out))])
    return [json.loads((out / f"frozen{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(TIMEOUT_S)
def test_ranks_start_with_the_callers_objects_frozen_and_the_caller_gets_them_back(tmp_path):
    gc.unfreeze()  # the session froze its own (tests/conftest.py): this caller has none frozen
    try:
        in_ranks = fit_two_ranks(tmp_path / "a")
        assert gc.get_freeze_count() == 0  # unfrozen again once the ranks are back
        assert all(n > 10_000 for n in in_ranks), in_ranks  # torch, Lightning, this test's module...
    finally:
        marker = [[]]  # a container the collector tracks, frozen with the rest
        gc.collect()
        gc.freeze()
    mine = gc.get_freeze_count()
    fit_two_ranks(tmp_path / "b")
    # a caller's own frozen objects stay frozen (gc.get_objects lists only unfrozen ones) and none are added
    # (some may have been freed by their reference counts meanwhile)
    assert not any(o is marker for o in gc.get_objects())
    assert 0 < gc.get_freeze_count() <= mine
