"""The strategies' ``nonfinite`` argument: a mixin that checks the step's loss and gradients once the closure
(forward, backward, the strategy's reductions) has run (called by
:class:`~lightning_par.strategies._optimizer_step.OptimizerStep`), see [Note: non-finite
values] in :mod:`lightning_par.nonfinite`."""
from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par.nonfinite import NonFiniteError, agree, find_nonfinite, message


class SkipStep(BaseException):
    """Leaves ``optimizer.step`` from inside its closure, before any update (a BaseException, so that no
    ``except Exception`` of a user's ``optimizer_step`` override swallows it)."""


class NonFiniteChecks:
    """Mixed into a Lightning strategy: ``nonfinite="error" | "skip"``.

    [Note: checking inside the closure] Every torch optimizer, the ``GradScaler`` path of ``16-mixed`` and
    ``ZeroRedundancyOptimizer`` call the closure before they change anything, so the check runs at the end
    of the closure: an error leaves the weights as they were, and a skip leaves ``optimizer.step`` by an
    exception caught by ``OptimizerStep``. An optimizer that calls the closure again after updating (LBFGS) has
    every call checked; a skip there keeps the updates of the step's earlier calls.
    """

    _nonfinite = "error"

    def _set_nonfinite(self, nonfinite: str) -> None:
        self._nonfinite = nonfinite  # checked by StepOptions
        self.skipped_steps: list[int] = []  # global steps skipped by nonfinite="skip"

    def _check_finite(self, optimizer, loss) -> None:
        lm = self.lightning_module
        topology = getattr(self, "_topology", None)
        stage, stages = (topology.coordinates(self.global_rank)["pp"], topology.pipeline_parallel_size) \
            if topology is not None else (0, 1)
        scaler = getattr(self.precision_plugin, "scaler", None)  # 16-mixed: the scaler skips inf gradients itself
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        grads = [] if scaler is not None else [(n, p.grad) for n, p in lm.named_parameters() if id(p) in stepped]
        found = find_nonfinite(loss if stage == stages - 1 else None, grads)  # the loss of the last stage
        findings = agree(found, where=f"rank {self.global_rank} (pipeline stage {stage} of {stages})",
                         device=self.root_device)
        if not findings:
            return
        step, epoch = lm.trainer.global_step, lm.trainer.current_epoch
        text = message(findings, step=step, epoch=epoch, mode=self._nonfinite)
        if self._nonfinite == "error":
            raise NonFiniteError(text)
        self.skipped_steps.append(step)
        rank_zero_warn(text)
        raise SkipStep
