"""The schedule interpreter: one step's F / B / W actions run on this rank's stage, the user's own step
called once per micro-batch and chunk, and the last stage's result handed to the router.

[Note: schedule inside training_step] Lightning's automatic optimization calls ``zero_grad`` between
``strategy.training_step`` and ``strategy.backward``. A 1F1B stage must interleave backwards with
forwards, so the whole schedule runs in ``training_step``: the gradients of the step are taken aside
(the ones accumulated before are put back untouched) and added in ``backward``, after Lightning's
``zero_grad``. ``training_step`` returns the true batch loss on every rank (sent from the last
stage) so the progress bar and callbacks agree; ``backward`` ignores the tensor it is given.

[Note: own schedule runner] torch.distributed.pipelining drives each stage as a module whose forward it
calls with the received activation. Here the user's own ``training_step`` drives the stage (it computes
masks, rotary tables and the loss, and logs), and the stage is entered and left through block hooks in
the middle of that code, so a stage is not a callable submodule that a ``PipelineStage`` could wrap
without rewriting the user's forward. The orders are short pure functions in ``schedules.py`` (GPipe,
1F1B, interleaved 1F1B after Megatron, a ZB-H1-style zero bubble), checked for completeness and
deadlock freedom by a simulator in the unit tests; only zero bubble's split backward reuses torch's
private helpers (``split_backward.py``). Transfers carry a tag per (direction, virtual stage,
micro-batch), so out-of-order arrivals between two ranks (interleaving) cannot be confused on gloo.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, ContextManager, Optional

import torch

from lightning_par.pipeline.microbatch import batch_size, split_batch
from lightning_par.pipeline.routing import LogCapture, ResultRouter, concat_outputs, map_tensors
from lightning_par.pipeline.schedules import (interleaved_actions, looped_gpipe_actions, stage_actions,
                                              zero_bubble_actions)
from lightning_par.pipeline.stage import StageRuntime

Step = Callable[[Any], Any]  # the user's step on one micro-batch


def schedule_actions(schedule: str, *, stage: int, num_stages: int, chunks: int,
                     microbatches: int) -> list[tuple[str, int, int]]:
    """One rank's (kind, chunk, micro-batch) actions for one step.

    Example::

        >>> schedule_actions("gpipe", stage=0, num_stages=2, chunks=1, microbatches=2)
        [('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('B', 0, 1)]
    """
    if schedule == "interleaved_1f1b":
        if microbatches % num_stages == 0:
            return interleaved_actions(rank=stage, ranks=num_stages, chunks=chunks, microbatches=microbatches)
        return looped_gpipe_actions(chunks=chunks, microbatches=microbatches)  # a partial batch
    if schedule == "zero_bubble":
        order = zero_bubble_actions(stage=stage, num_stages=num_stages, microbatches=microbatches)
    else:
        order = stage_actions(schedule, stage=stage, num_stages=num_stages, microbatches=microbatches)
    return [(k, 0, i) for k, i in order]


class ScheduleRunner:
    """Runs this rank's stage (``runtime``) through one training or evaluation step of ``microbatches``
    micro-batches in the order of ``schedule``; results go through ``router``."""

    def __init__(self, runtime: StageRuntime, router: ResultRouter, *, schedule: str, stage: int,
                 num_stages: int, microbatches: int, shards: Any = None):
        self.runtime, self.router = runtime, router
        self.shards = shards  # zero_stage 2 / 3: the stage's FSDP units (lightning_par.dp.fsdp.StageShards)
        self.schedule, self.stage, self.num_stages, self.microbatches = schedule, stage, num_stages, microbatches
        self.last_step_stats: dict[str, float] = {}  # seconds of the last training step's schedule (benchmarks)

    def actions(self, microbatches: int) -> list[tuple[str, int, int]]:
        return schedule_actions(self.schedule, stage=self.stage, num_stages=self.num_stages,
                                chunks=len(self.runtime.chunks), microbatches=microbatches)

    def train(self, module: torch.nn.Module, batch: Any, step: Step, *, context: Callable[[], ContextManager],
              params: list[torch.nn.Parameter], accumulate: int, seed_step: int,
              scaler: Any = None) -> tuple[Any, list[Optional[torch.Tensor]]]:
        """Every micro-batch's forward and backward (see [Note: schedule inside training_step]); returns the
        routed result and this step's gradients of ``params``, whose earlier gradients are left in place.
        ``scaler`` (16-mixed) scales the loss: one loss scale for every micro-batch."""
        rt = self.runtime
        mbs = split_batch(batch, self.microbatches)
        sizes = [batch_size(mb) for mb in mbs]
        coefs = [n / sum(sizes) / accumulate for n in sizes]
        # the gradients accumulated before stay aside; without accumulation Lightning zeroes them right after this
        # step anyway, so they are freed now instead of being held beside the new ones through the schedule
        stash = [p.grad if accumulate > 1 else None for p in params]
        for p in params:
            p.grad = None
        rt.seeded = module.training
        rt.step = seed_step
        outputs: dict[int, Any] = {}
        capture = LogCapture(module)
        rt.wait_s = rt.busy_s = 0.0
        actions = self.actions(len(mbs))
        rt.begin_step(actions)
        if self.shards is not None:
            self.shards.begin_step()  # each unit gathered once for all micro-batches
            rt.weights = self.shards.trainable()  # the whole parameters this step's graph uses (zero bubble's W)
        deferred: list[tuple[int, int]] = []  # zero bubble: (chunk, micro-batch) whose B ran and whose W has not
        payload = None  # the last stage's (result, logs), sent once its last backward has run
        self.router.post()
        start = time.perf_counter()
        with rng_fork(rt.device, rt.seeded), capture:
            for kind, c, i in actions:
                capture.microbatch = i
                last = rt.is_last and c == len(rt.chunks) - 1  # the chunk that computes the loss
                if kind == "F":
                    with context():
                        out = rt.forward(i, lambda: step(mbs[i]), chunk=c)
                    if last:
                        outputs[i] = out
                elif kind == "W":
                    if (c, i) in deferred:  # not run early to fill a wait, nor fused with its B
                        deferred.remove((c, i))
                        rt.backward_weight(i, chunk=c)
                else:
                    loss = loss_of(outputs[i]) * coefs[i] if last else None
                    if loss is not None and scaler is not None:
                        loss = scaler.scale(loss)
                    if self.schedule != "zero_bubble" or rt.is_last:
                        rt.backward(i, loss, chunk=c)  # zero bubble's last stage: B and W in one pass
                    else:
                        while deferred and not rt.gradient_arrived(i, chunk=c):  # [Note: filling waits]
                            early_c, early_i = deferred.pop(0)
                            rt.backward_weight(early_i, chunk=early_c)
                        rt.backward_input(i, loss, chunk=c)
                        deferred.append((c, i))
                    if last:
                        outputs[i] = map_tensors(outputs[i], torch.Tensor.detach)
                        if i == len(mbs) - 1:  # every forward has run; sent after the last gradient went upstream
                            payload = self.router.send([outputs[j] for j in range(len(mbs))], sizes, capture)
            rt.finish()
            if self.shards is not None:
                self.shards.end_step()  # the step's gradients reduce-scattered into the shards
        self.last_step_stats = {"schedule_s": time.perf_counter() - start, "busy_s": rt.busy_s, "wait_s": rt.wait_s,
                                "microbatches": len(mbs)}
        grads = [p.grad for p in params]
        for p, g in zip(params, stash):
            p.grad = g
        return self.router.route(payload, module), grads

    def evaluate(self, module: torch.nn.Module, batch: Any, step: Step, *, context: Callable[[], ContextManager],
                 predict: bool = False) -> Any:
        """Forward-only: every micro-batch through every chunk in order; predictions are concatenated and
        broadcast from the last stage, anything else combined and routed as in training."""
        rt = self.runtime
        mbs = split_batch(batch, self.microbatches)
        sizes = [batch_size(mb) for mb in mbs]
        rt.seeded = False
        rt.begin_step([("F", c, i) for i in range(len(mbs)) for c in range(len(rt.chunks))])
        if self.shards is not None:
            self.shards.gather()
        outputs = []
        capture = LogCapture(module)
        if not predict:
            self.router.post()
        with capture:
            for i, mb in enumerate(mbs):
                capture.microbatch = i
                for c in range(len(rt.chunks)):
                    with context():
                        out = rt.forward(i, lambda: step(mb), chunk=c)
                outputs.append(out)
            rt.finish()
        if self.shards is not None:
            self.shards.reshard()
        if predict:
            return self.router.broadcast_from_last(concat_outputs(outputs) if rt.is_last else None)
        return self.router.route(self.router.send(outputs, sizes, capture) if rt.is_last else None, module)


def loss_of(output: Any) -> torch.Tensor:
    """The loss tensor of what the user's step returned for one micro-batch."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "Under pipeline parallelism `training_step` must return the loss tensor (or a dict with 'loss') for "
            f"every micro-batch; got {type(output).__name__}. Skipping a batch by returning None is not supported."
        )
    return loss


def base_seed() -> int:
    """The seed of ``seed_everything`` (Lightning keeps it in ``PL_GLOBAL_SEED``), 0 without one."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class rng_fork:
    """Save the RNG state before a seeded pipeline step and restore it after (the user's stream stays put)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled

    def __enter__(self):
        if self.enabled:
            self.cpu = torch.get_rng_state()
            self.cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def __exit__(self, *exc):
        if self.enabled:
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
