"""Which layouts context parallelism composes with today: the check a strategy makes before any process starts.

    >>> check_context_layout(2, pipeline_parallel_size=1, zero_stage=1)
    >>> check_context_layout(2, pipeline_parallel_size=2)
    Traceback (most recent call last):
    ...
    ValueError: `context_parallel_size=2` with `pipeline_parallel_size=2` is not supported yet: context parallelism \
runs with one pipeline stage (dp × cp × tp). Use pipeline_parallel_size=1, or context_parallel_size=1 \
(docs/limitations.md).
"""
from __future__ import annotations

from typing import Optional


def check_context_layout(context_parallel_size: int, *, pipeline_parallel_size: int, zero_stage: int = 0,
                         fault_tolerance: Optional[str] = None, sequence_parallel: bool = False,
                         loss_parallel: bool = False) -> None:
    """``ValueError`` naming the option that context parallelism does not compose with yet (nothing at cp = 1)."""
    cp = context_parallel_size
    if cp == 1:
        return
    for name, value, ok, fix in (
            ("pipeline_parallel_size", pipeline_parallel_size, pipeline_parallel_size == 1, "pipeline_parallel_size=1"),
            ("zero_stage", zero_stage, zero_stage <= 1, "zero_stage=0 or 1"),
            ("fault_tolerance", fault_tolerance, fault_tolerance is None, "fault_tolerance=None"),
            ("sequence_parallel", sequence_parallel, not sequence_parallel, "sequence_parallel=False"),
            ("loss_parallel", loss_parallel, not loss_parallel, "loss_parallel=False")):
        if not ok:
            raise ValueError(
                f"`context_parallel_size={cp}` with `{name}={value!r}` is not supported yet: context parallelism runs "
                f"with one pipeline stage (dp × cp × tp). Use {fix}, or context_parallel_size=1 "
                f"(docs/limitations.md).")


__all__ = ["check_context_layout"]
