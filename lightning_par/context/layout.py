"""Which layouts context parallelism composes with today: the check a strategy makes before any process starts.

    >>> check_context_layout(2, pipeline_parallel_size=2, zero_stage=1)
    >>> check_context_layout(2, pipeline_parallel_size=2, schedule="interleaved_1f1b")
    Traceback (most recent call last):
    ...
    ValueError: `context_parallel_size=2` with `schedule='interleaved_1f1b'` is not supported yet: a pipeline \
under context parallelism runs one stage per rank (gpipe, 1f1b or zero_bubble). Use schedule='1f1b', 'gpipe' or \
'zero_bubble', or context_parallel_size=1 (docs/limitations.md).
"""
from __future__ import annotations

from typing import Optional

_PIPELINE = "a pipeline under context parallelism runs one stage per rank (gpipe, 1f1b or zero_bubble)"


def check_context_layout(context_parallel_size: int, *, pipeline_parallel_size: int, zero_stage: int = 0,
                         fault_tolerance: Optional[str] = None, sequence_parallel: bool = False,
                         loss_parallel: bool = False, schedule: str = "1f1b", stages_per_rank: int = 1) -> None:
    """``ValueError`` naming the option that context parallelism does not compose with yet (nothing at cp = 1)."""
    cp = context_parallel_size
    if cp == 1:
        return
    pipelined = pipeline_parallel_size > 1
    for name, value, ok, fix, why in (
            ("schedule", schedule, not pipelined or schedule != "interleaved_1f1b",
             "schedule='1f1b', 'gpipe' or 'zero_bubble'", _PIPELINE),
            ("stages_per_rank", stages_per_rank, not pipelined or stages_per_rank == 1, "stages_per_rank=1",
             _PIPELINE),
            ("zero_stage", zero_stage, zero_stage <= 1 or not pipelined, "zero_stage=0 or 1",
             "under a pipeline context parallelism runs with zero stages 0 and 1 (stages 2 / 3 with one pipeline "
             "stage)"),
            ("fault_tolerance", fault_tolerance, fault_tolerance is None, "fault_tolerance=None",
             "context parallelism runs without fault tolerance"),
            ("sequence_parallel", sequence_parallel, not sequence_parallel, "sequence_parallel=False",
             "context parallelism cuts the sequence itself"),
            ("loss_parallel", loss_parallel, not loss_parallel, "loss_parallel=False",
             "context parallelism gathers the hidden state before the head")):
        if not ok:
            raise ValueError(
                f"`context_parallel_size={cp}` with `{name}={value!r}` is not supported yet: {why}. Use {fix}, or "
                f"context_parallel_size=1 (docs/limitations.md).")


__all__ = ["check_context_layout"]
