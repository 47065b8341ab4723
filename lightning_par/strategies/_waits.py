"""The strategies' hooks that communicate, run inside :func:`lightning_par.waits.named_wait`: a peer that
stops answering or dies fails the hook with the operation named ([Note: every wait bounded] in
:mod:`lightning_par.waits`). Waits named more precisely inside (the pipeline's transfers) keep their name."""
from __future__ import annotations

from typing import Any

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


class NamedWaits:
    """Mixed into a strategy before its Lightning base; see the module docstring (``optimizer_step``'s wait is
    :class:`~lightning_par.strategies._optimizer_step.OptimizerStep`'s)."""

    def _wait_name(self, hook: str) -> str:
        name = _BY_STRATEGY.get(getattr(self, "strategy_name", ""), {}).get(hook, _GENERIC[hook])
        return f"{name} on rank {self.global_rank} of {self.world_size}"

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with named_wait(self._wait_name("training_step")):
            return super().training_step(*args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        with named_wait(self._wait_name("backward")):
            return super().backward(*args, **kwargs)
