"""What installing a pipeline stage needs of Lightning: the user's step on one micro-batch of the first batch
of the running trainer function (for the setup trace and for ``balance="time"``), run the way Lightning
would run it (its precision context, ``self.log`` captured)."""
from __future__ import annotations

from typing import Callable, Optional

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par.pipeline.microbatch import first_batch, split_batch
from lightning_par.pipeline.profile import mean_over_ranks, profile_step
from lightning_par.pipeline.routing import LogCapture
from lightning_par.pipeline.runner import loss_of, rng_fork


def sample_step(strategy, lm, microbatches: int) -> Optional[Callable]:
    """The user's step (of this trainer function) on one micro-batch of its first batch, or None."""
    t, plugin = lm.trainer, strategy.precision_plugin
    loop, hook, context = {TrainerFn.FITTING: (t.fit_loop, "training_step", plugin.train_step_context),
                           TrainerFn.VALIDATING: (t.validate_loop, "validation_step", plugin.val_step_context),
                           TrainerFn.TESTING: (t.test_loop, "test_step", plugin.test_step_context),
                           TrainerFn.PREDICTING: (t.predict_loop, "predict_step", plugin.predict_step_context),
                           }[t.state.fn]
    batch = first_batch(loop._data_source.dataloader() if loop._data_source.is_defined() else None)
    if batch is None:
        return None
    mb = split_batch(strategy.batch_to_device(batch), microbatches)[0]

    def step():
        with LogCapture(lm), context():
            return getattr(lm, hook)(mb, 0)
    return step


def profile_blocks(strategy, lm, container, microbatches: int):
    """Every rank times the user's step on one micro-batch of its first training batch (see
    [Note: profiling the unchanged step] in pipeline/profile.py), all at once, so the timings see the
    contention of the real run (CPU ranks share cores and memory bandwidth, which slows a large head
    more than the blocks); every rank then uses the mean over ranks, so all choose the same split."""
    if lm.trainer.state.fn != TrainerFn.FITTING:
        rank_zero_warn("balance='time' profiles a training batch; outside fit the split follows 'params'.")
        return None

    def measure():
        with rng_fork(strategy.root_device, True):
            step = sample_step(strategy, lm, microbatches)
            result = profile_step(container, lambda: loss_of(step()), strategy.root_device, repeats=8)
        for p in lm.parameters():
            p.grad = None
        return result
    return mean_over_ranks(measure)
