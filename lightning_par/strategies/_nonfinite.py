"""The strategy's step guard: ``nonfinite="error" | "skip"`` (the step's loss and gradients checked once the closure
has run, see [Note: non-finite values] in :mod:`lightning_par.nonfinite`) and the names of the waits of the hooks
that communicate ([Note: every wait bounded] in :mod:`lightning_par.waits`): a peer that stops answering or dies
fails the hook with the operation named. Waits named more precisely inside (the pipeline's transfers) keep theirs.

[Note: checking inside the closure]
Every torch optimizer, the ``GradScaler`` path of ``16-mixed`` and ``ZeroRedundancyOptimizer`` call the closure
before they change anything, so the check runs at the end of the closure: an error leaves the weights as they were,
and a skip leaves ``optimizer.step`` by :class:`SkipStep`, caught by the strategy's ``optimizer_step``. An optimizer
that calls the closure again after updating (LBFGS) has every call checked; a skip there keeps the updates of the
step's earlier calls.
"""
from __future__ import annotations

import contextlib

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par.nonfinite import NonFiniteError, agree, find_nonfinite, message
from lightning_par.waits import named_wait

_GENERIC = {"training_step": "the collectives of the forward pass (training_step)",
            "backward": "the collectives of the backward pass",
            "optimizer_step": "the collectives of the optimizer step (gradient reductions, the non-finite flag)"}
_BY_STRATEGY = {
    "data_parallel": {"backward": "DDP's gradient all-reduce (backward)",
                      "optimizer_step": "the collectives of the optimizer step (the non-finite flag; at a sync step "
                                        "of sync='local_sgd' / 'diloco' the replicas' parameter average)",
                      "training_step": "the forward pass's collectives (FSDP parameter all-gather, DDP buffer "
                                       "broadcast)"},
    "tensor_parallel": {"training_step": "the tensor-parallel forward collectives (DTensor all-reduce / all-gather)",
                        "backward": "the tensor-parallel backward collectives (DTensor all-reduce / reduce-scatter)"},
    "pipeline_parallel": {"backward": "the all-reduce of gradients shared between stages or replicas"},
}


class SkipStep(BaseException):
    """Leaves ``optimizer.step`` from inside its closure, before any update (a BaseException, so that no
    ``except Exception`` of a user's ``optimizer_step`` override swallows it)."""


class StepGuard:
    """Owned by the strategy (``strategy``: its public Lightning attributes, its ``topology`` once set up)."""

    def __init__(self, strategy, nonfinite: str) -> None:
        self.s = strategy
        self.nonfinite = nonfinite  # checked by StepOptions
        self.skipped_steps: list[int] = []  # global steps skipped by nonfinite="skip"

    def wait(self, hook: str) -> contextlib.AbstractContextManager:
        """The named wait of ``hook`` ("training_step", "backward", "optimizer_step") on this rank."""
        name = _BY_STRATEGY.get(self.s.strategy_name, {}).get(hook, _GENERIC[hook])
        return named_wait(f"{name} on rank {self.s.global_rank} of {self.s.world_size}")

    def check_finite(self, optimizer, loss, stage: int = 0, stages: int = 1) -> None:
        """The loss (of the last stage) and this rank's gradients in ``optimizer``, agreed over every rank: raises
        :class:`~lightning_par.nonfinite.NonFiniteError` or, under ``"skip"``, :class:`SkipStep`."""
        s = self.s
        lm = s.lightning_module
        scaler = getattr(s.precision_plugin, "scaler", None)  # 16-mixed: the scaler skips inf gradients itself
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        grads = [] if scaler is not None else [(n, p.grad) for n, p in lm.named_parameters() if id(p) in stepped]
        found = find_nonfinite(loss if stage == stages - 1 else None, grads)  # the loss of the last stage
        findings = agree(found, where=f"rank {s.global_rank} (pipeline stage {stage} of {stages})",
                         device=s.root_device)
        if not findings:
            return
        step, epoch = lm.trainer.global_step, lm.trainer.current_epoch
        text = message(findings, step=step, epoch=epoch, mode=self.nonfinite)
        if self.nonfinite == "error":
            raise NonFiniteError(text)
        self.skipped_steps.append(step)
        rank_zero_warn(text)
        raise SkipStep
