"""The pipeline strategy's runs of the user's step at setup: one micro-batch of the first batch of the trainer
function's loader, for the trace ([Note: block flow] in :mod:`lightning_par.pipeline.flow`, [Note: the ends a
stage needs] in :mod:`lightning_par.pipeline.ends`) and for ``balance="time"``
(:mod:`lightning_par.pipeline.profile`)."""
from __future__ import annotations

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par.pipeline.ends import record_uses, trace_device
from lightning_par.pipeline.microbatch import first_batch, split_batch
from lightning_par.pipeline.profile import mean_over_ranks, profile_step
from lightning_par.pipeline.routing import LogCapture
from lightning_par.pipeline.runner import loss_of, rng_fork


def profile_blocks(strategy, lm, container):
    """Every rank times the user's step on one micro-batch of its first training batch (see
    [Note: profiling the unchanged step] in pipeline/profile.py), all at once, so the timings see the
    contention of the real run (CPU ranks share cores and memory bandwidth, which slows a large head
    more than the blocks); every rank then uses the mean over ranks, so all choose the same split."""
    if lm.trainer.state.fn != TrainerFn.FITTING:
        rank_zero_warn("balance='time' profiles a training batch; outside fit the split follows 'params'.")
        return None
    if trace_device(lm).type == "meta":
        raise ValueError("balance='time' times the whole module on every rank, but it was built on the meta "
                         "device (no memory for its weights); use balance='params' or a list of blocks per stage.")

    def measure():
        with rng_fork(strategy.root_device, True):
            step = sample_step(strategy, lm)
            result = profile_step(container, lambda: loss_of(step()), strategy.root_device, repeats=8)
        for p in lm.parameters():
            p.grad = None
        return result
    return mean_over_ranks(measure)


def sample_step(strategy, lm, record=None):
    """The user's step (of this trainer function) on one micro-batch of its first batch, or None, on the
    module's device (meta for a meta-built one); with ``record`` (the blocks), recording its parameter uses."""
    t, plugin = lm.trainer, strategy.precision_plugin
    loop, hook, context = {TrainerFn.FITTING: (t.fit_loop, "training_step", plugin.train_step_context),
                           TrainerFn.VALIDATING: (t.validate_loop, "validation_step", plugin.val_step_context),
                           TrainerFn.TESTING: (t.test_loop, "test_step", plugin.test_step_context),
                           TrainerFn.PREDICTING: (t.predict_loop, "predict_step", plugin.predict_step_context),
                           }[t.state.fn]
    batch = first_batch(loop._data_source.dataloader() if loop._data_source.is_defined() else None)
    if batch is None:
        return None
    mb = split_batch(strategy.batch_to_device(batch, trace_device(lm)), strategy._num_microbatches())[0]

    def step():
        with LogCapture(lm), context():
            return getattr(lm, hook)(mb, 0)
    return step if record is None else record_uses(lm, record, {id(p) for p in record.parameters()}, step)
