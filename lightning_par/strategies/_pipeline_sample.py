"""The pipeline strategy's runs of the user's step at setup: one micro-batch of the first batch of the trainer
function's loader, for the trace ([Note: block flow] in :mod:`lightning_par.pipeline.flow`, [Note: the ends a
stage needs] in :mod:`lightning_par.pipeline.ends`), for ``balance="time"`` (:mod:`lightning_par.pipeline.profile`)
and for the check of a loss that couples samples ([Note: losses that couple samples] in
:mod:`lightning_par.pipeline.coupling`)."""
from __future__ import annotations

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_par._compat import loop_data_source
from lightning_par.materialize import has_meta
from lightning_par.pipeline.coupling import measure_coupling
from lightning_par.pipeline.ends import record_uses, trace_device
from lightning_par.pipeline.flow import kept_state
from lightning_par.pipeline.microbatch import first_batch, split_batch
from lightning_par.pipeline.profile import mean_over_ranks, profile_step
from lightning_par.pipeline.routing import LogCapture
from lightning_par.pipeline.runner import loss_of, rng_fork


def profile_blocks(strategy, lm, container, microbatches: int):
    """Every rank times the user's step on one micro-batch of its first training batch (see
    [Note: profiling the unchanged step] in pipeline/profile.py), all at once, so the timings see the
    contention of the real run (CPU ranks share cores and memory bandwidth, which slows a large head
    more than the blocks); every rank then uses the mean over ranks, so all choose the same split."""
    if lm.trainer.state.fn != TrainerFn.FITTING:
        rank_zero_warn("balance='time' profiles a training batch; outside fit the split follows 'params'.")
        return None
    if has_meta(lm):
        raise ValueError("balance='time' times the whole module on every rank, but it was built on the meta "
                         "device (no memory for its weights); use balance='params' or a list of blocks per stage.")

    def measure():
        with rng_fork(strategy.root_device, True):
            step = sample_step(strategy, lm, microbatches)
            result = profile_step(container, lambda: loss_of(step()), strategy.root_device, repeats=8)
        for p in lm.parameters():
            p.grad = None
        return result
    return mean_over_ranks(measure)


def sample_step(strategy, lm, microbatches: int, record=None):
    """The user's step (of this trainer function) on one micro-batch of its first batch, or None, on the
    module's device (the rank's for a meta-built one); with ``record`` (the blocks), recording its parameter uses."""
    t, plugin = lm.trainer, strategy.precision_plugin
    loop, hook, context = {TrainerFn.FITTING: (t.fit_loop, "training_step", plugin.train_step_context),
                           TrainerFn.VALIDATING: (t.validate_loop, "validation_step", plugin.val_step_context),
                           TrainerFn.TESTING: (t.test_loop, "test_step", plugin.test_step_context),
                           TrainerFn.PREDICTING: (t.predict_loop, "predict_step", plugin.predict_step_context),
                           }[t.state.fn]
    batch = first_batch(loop_data_source(loop).dataloader() if loop_data_source(loop).is_defined() else None)
    if batch is None:
        return None
    mb = split_batch(strategy.batch_to_device(batch, trace_device(lm, strategy.root_device)),
                     microbatches)[0]

    def on(microbatch):
        with LogCapture(lm) as capture, context():
            out = getattr(lm, hook)(microbatch, 0)
        step.logs = capture.combined([1])  # what the step logged, (name, value, kwargs)
        return out
    step = (lambda: on(mb)) if record is None else record_uses(lm, record, {id(p) for p in record.parameters()},
                                                               lambda: on(mb))
    step.on, step.microbatch, step.context, step.logs = on, mb, context, []
    return step


def check_batch_semantics(strategy, lm, step, microbatches: int, strict: bool) -> None:
    """Whether micro-batching changes the loss ([Note: losses that couple samples] in pipeline/coupling.py): global
    rank 0 measures on its traced micro-batch, every rank receives the result, rank 0 warns once, or under
    ``strict_batch_semantics`` every rank raises the same ``ValueError``."""
    if step is None or lm.trainer.state.fn != TrainerFn.FITTING or has_meta(lm) or microbatches < 2:
        return
    found, why = None, None
    if strategy.global_rank == 0:
        try:
            with rng_fork(strategy.root_device, True), kept_state(lm):
                found, why = measure_coupling(step.on, step.microbatch, loss_of=loss_of, reseed=torch.manual_seed,
                                              dtype=compute_dtype(step.context, strategy.root_device, lm))
        except Exception as error:  # the trace ran this step: a failure on a half is the halves' own
            why = f"a half of the micro-batch failed: {type(error).__name__}: {error}"
    found, why = strategy.broadcast((found, why), src=0)
    if why is not None:
        rank_zero_info(f"The check whether micro-batching changes the loss was skipped: {why} ([Note: losses that "
                       f"couple samples] in lightning_par/pipeline/coupling.py).")
    if found is not None and found.coupled:
        if strict:
            raise ValueError(found.message(strict=True))
        rank_zero_warn(found.message(strict=False))


def compute_dtype(context, device: torch.device, module) -> torch.dtype:
    """The dtype the step computes in: autocast's under the precision's ``context``, else the parameters'."""
    with context():
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
    p = next((p for p in module.parameters() if p.is_floating_point()), None)
    return p.dtype if p is not None else torch.get_default_dtype()
