"""A parallel layout the advisor estimates (:class:`Layout`), its estimate (:class:`Estimate`), and the values
they take (precisions, optimizers, schedules, activation checkpointing modes). Re-exported by
:mod:`lightning_par.advisor.memory`."""
from __future__ import annotations

from dataclasses import dataclass

from lightning_par.advisor.experts import check_layout as check_experts_layout

# bytes per element of (parameters, gradients, each optimizer state) for Lightning's precision flags
PRECISION_BYTES = {
    "32-true": (4, 4, 4), "32": (4, 4, 4),
    "bf16-mixed": (4, 4, 4), "16-mixed": (4, 4, 4),
    "bf16-true": (2, 2, 2), "16-true": (2, 2, 2),
    "64-true": (8, 8, 8),
}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "rmsprop": 1, "adagrad": 1}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
CHECKPOINTING = (None, "selective", 2, "full")  # the modes the advisor proposes (any k >= 1 is estimated)


def check_checkpointing(mode) -> None:
    """``None | "full" | "selective" | k >= 1``, as the strategies take ``activation_checkpointing``."""
    if mode is None or mode in ("full", "selective"):
        return
    if isinstance(mode, bool) or not isinstance(mode, int) or mode < 1:
        raise ValueError(f"activation_checkpointing={mode!r} must be None, 'full', 'selective' or an int k >= 1 "
                         f"(every k-th block).")


def checkpointed(mode, index: int) -> bool:
    """Whether block ``index`` of its stack is checkpointed under ``mode`` (every k-th: ``index % k == 0``)."""
    if mode is None:
        return False
    if isinstance(mode, int) and not isinstance(mode, bool):
        return index % mode == 0
    return True


@dataclass(frozen=True)
class Layout:
    """A parallel layout: sizes (dp × pp × cp × tp devices), ZeRO stage and pipeline schedule."""

    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    zero_stage: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: str | int | None = None
    context_parallel_size: int = 1
    comm_hook: str | None = None  # "fp16" / "bf16": the replicas' all-reduce in 16 bits (PowerSGD: not modeled)
    expert_parallel_size: int = 1  # routed experts divided over ep ranks borrowed from dp × cp
    context_parallel_method: str = "ring"  # "ring" | "allgather" | "ulysses" (docs/context-parallel.md)

    def __post_init__(self):
        check_checkpointing(self.activation_checkpointing)
        if self.context_parallel_size < 1:
            raise ValueError(f"context_parallel_size={self.context_parallel_size} must be a positive integer.")
        if self.context_parallel_method not in ("ring", "allgather", "ulysses"):
            raise ValueError(f"context_parallel_method={self.context_parallel_method!r} must be 'ring', 'allgather' "
                             f"or 'ulysses'.")
        check_experts_layout(self)

    @property
    def devices(self) -> int:
        return (self.data_parallel_size * self.pipeline_parallel_size * self.context_parallel_size
                * self.tensor_parallel_size)

    @property
    def name(self) -> str:
        parts = []
        if self.pipeline_parallel_size > 1:
            parts.append(f"PP{self.pipeline_parallel_size}({self.schedule}, m={self.microbatches})")
        if self.context_parallel_size > 1:
            method = self.context_parallel_method
            parts.append(f"CP{self.context_parallel_size}" + ("" if method == "ring" else f" {method}"))
        if self.tensor_parallel_size > 1:
            parts.append(f"TP{self.tensor_parallel_size}" + ("+SP" if self.sequence_parallel else ""))
        if self.data_parallel_size > 1 or not parts:
            parts.append(f"DP{self.data_parallel_size}" if self.data_parallel_size > 1 else "single")
        if self.expert_parallel_size > 1:
            parts.append(f"EP{self.expert_parallel_size}")
        if self.zero_stage:
            parts.append(f"ZeRO-{self.zero_stage}")
        if self.comm_hook:
            parts.append(self.comm_hook)
        ac = self.activation_checkpointing
        if ac is not None:
            parts.append(f"AC {ac}" if isinstance(ac, str) else f"AC every {ac}")
        return " × ".join(parts)


@dataclass(frozen=True)
class Estimate:
    """Bytes per device (the busiest rank) and bytes each rank sends per optimizer step."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    comm_bytes: int
    all_gathers: int = 0  # FSDP's all-gathers per step (one per unit gathered: ZeRO-2 / 3)
    pipeline_bytes: int = 0  # a pipeline stage's runtime ([Note: what a pipeline stage holds beyond the model])
    context_bytes: int = 0  # the ring's working set beyond the peak of the saved activations ([Note: the advisor
    # under context parallelism])
    backward_bytes: int = 0  # of activation_bytes, what backward holds beyond the tensors saved at the forward's
    # end: the loss's gradient or a recompute's ([Note: a checkpointed backward's gradients]); a saved-tensor meter
    # (ParallelMetrics) does not see it

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes
                + self.pipeline_bytes + self.context_bytes)
