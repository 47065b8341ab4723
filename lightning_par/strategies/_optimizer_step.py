"""The strategies' one ``optimizer_step``: every wrapping of Lightning's step in one method, in a written order."""
from __future__ import annotations

from typing import Any, Callable

from lightning_par.strategies._nonfinite import SkipStep
from lightning_par.waits import named_wait


class OptimizerStep:
    """Mixed into a strategy before its Lightning base (no other base overrides ``optimizer_step``).

    The order, from the outside in:

    1. ``_finish_gradients(closure)``: the closure (forward and backward) followed by what settles the gradients
       (the core's engine: tensor-parallel partial sums, the replicas' average; nothing under DDP, whose
       reduction runs inside backward).
    2. Fault tolerance (``fault_tolerance="torchft"``, ``self._replica``): the closure runs until the step commits
       on the live quorum (a lost peer retries the batch: [Note: one step, committed exactly once] in
       :mod:`lightning_par.dp.ft`); Lightning's step then receives the committed result.
    3. The non-finite check at the end of the closure ([Note: checking inside the closure] in
       :mod:`lightning_par.strategies._nonfinite`): an error leaves the weights as they were; a skip leaves
       ``optimizer.step`` by :class:`SkipStep`, caught here (the step returns None).
    4. Lightning's step (the precision plugin: clipping, ``on_before_optimizer_step``, the update) inside a named
       wait ([Note: every wait bounded] in :mod:`lightning_par.waits`).
    5. ``_after_optimizer_step()``, in the same wait, for a step taken or skipped: what follows every optimizer step
       (``sync="local_sgd" | "diloco"`` on the data axis counts it and syncs the replicas when due:
       [Note: periodic sync on the data axis] in :mod:`lightning_par.strategies._periodic_sync`).
    """

    _replica = None  # fault tolerance: this rank's replica (lightning_par.dp.ft.Replica), once joined
    _step_hooks: tuple = ()  # tensor.mixed.StepByKind of this run's optimizers (the core sets its own list)

    def _finish_gradients(self, closure: Callable) -> Callable:
        return closure

    def _after_optimizer_step(self) -> None:
        pass

    def _per_step_commit(self) -> bool:
        """Fault tolerance: whether every step asks a quorum and commits (local SGD / DiLoCo: only their syncs)."""
        return True

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        closure = self._finish_gradients(closure)  # 1.
        if self._replica is not None and self._per_step_commit():  # 2. (local SGD / DiLoCo commit their syncs only)
            committed = self._replica.finish_step(closure)
            closure = lambda: committed  # noqa: E731

        def checked_closure():  # 3.
            result = closure()
            self._check_finite(optimizer, result)
            return result

        with named_wait(self._wait_name("optimizer_step")):
            try:  # 4.
                result = super().optimizer_step(optimizer, checked_closure, model, **kwargs)
            except SkipStep:
                for hooks in self._step_hooks:  # the skipped step ran no post-hook: the user's param groups come back
                    hooks.restore()
                result = None
            self._after_optimizer_step()  # 5.
        return result
