"""Bad input under pipeline parallelism fails clearly on every rank (no hang), a rank that dies
mid-step makes the survivors fail within the collective timeout, and ranks launched outside Lightning
(as under its default popen launcher, where rank 0 is the user's own process) reuse one Trainer."""
import multiprocessing
import os
import time

import lightning.pytorch as pl
import pytest
from torch.multiprocessing.spawn import ProcessRaisedException
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, free_port, seeded, trainer_kwargs
from models import ManualGPT, corpus, tiny_gpt
from lightning_par.models import GPT
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy

DATA = corpus(train_sequences=32)


def fit(module, loader, **strategy_kw):
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, start_method="fork", timeout=60, **strategy_kw)
    pl.Trainer(**trainer_kwargs(strategy=strategy, devices=2, max_steps=2)).fit(module, loader)


@pytest.mark.timeout(TIMEOUT_S)
def test_microbatches_not_dividing_the_batch_fail_when_training_starts():
    with pytest.raises(ProcessRaisedException, match=r"ValueError: `microbatches=3` must divide the per-device batch size \(8\)"):
        fit(seeded(tiny_gpt), DataLoader(DATA.train_set, batch_size=8), microbatches=3)


@pytest.mark.timeout(TIMEOUT_S)
def test_manual_optimization_is_refused_at_setup():
    module = seeded(lambda: ManualGPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
    with pytest.raises(ProcessRaisedException, match="ValueError: PipelineParallelStrategy supports automatic optimization only"):
        fit(module, DataLoader(DATA.train_set, batch_size=8))


class DyingGPT(GPT):
    """The last stage's process dies in the middle of the second step."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 1:
            os._exit(3)
        return super().training_step(batch, batch_idx)


def _rank_main(rank, port, timeout):
    # an externally launched rank (as under torchrun): Lightning starts no processes of its own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank))
    module = seeded(lambda: DyingGPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, start_method="popen",
                                        timeout=timeout)
    pl.Trainer(**trainer_kwargs(strategy=strategy, devices=2, max_steps=4)).fit(
        module, DataLoader(DATA.train_set, batch_size=8))


@pytest.mark.timeout(TIMEOUT_S)
def test_a_dead_rank_makes_the_other_fail_within_the_timeout():
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, port, 15)) for r in range(2)]
    start = time.monotonic()
    for p in procs:
        p.start()
    procs[0].join(timeout=150)
    elapsed = time.monotonic() - start
    alive = procs[0].is_alive()
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    assert not alive, "the surviving rank hung"
    assert procs[1].exitcode == 3
    assert procs[0].exitcode not in (0, None)
    assert elapsed < 120


def _fit_then_evaluate(rank, port, out_dir):
    # externally launched ranks (as under the default popen launcher, rank 0 is the user's process): the
    # same Trainer fits, validates and tests the module it has split into stages
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank))
    module = seeded(tiny_gpt)
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, start_method="popen", timeout=60)
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=2, max_steps=2, limit_val_batches=1.0))
    trainer.fit(module, DataLoader(DATA.train_set, batch_size=4))
    val = DataLoader(DATA.val_set, batch_size=4)
    results = [trainer.validate(module, val, verbose=False), trainer.test(module, val, verbose=False)]
    with pytest.raises(RuntimeError, match="already split into pipeline stages by another Trainer"):
        pl.Trainer(**trainer_kwargs(strategy=PipelineParallelStrategy(pipeline_parallel_size=2, start_method="popen"),
                                    devices=2)).validate(module, val, verbose=False)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.timeout(TIMEOUT_S)
def test_one_trainer_fits_then_validates_and_tests_in_process(tmp_path):
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_fit_then_evaluate, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=200)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] == ranks[1]
    (val,), (test,) = ranks[0]
    assert set(val) == {"val_loss"} and set(test) == {"test_loss"}
    assert val["val_loss"] == pytest.approx(test["test_loss"], abs=1e-6)  # same data, same weights
