"""Which layouts context parallelism composes with today: the check a strategy makes before any process starts.

    >>> check_context_layout(2, pipeline_parallel_size=1, tensor_parallel_size=1, zero_stage=1)
    >>> check_context_layout(2, pipeline_parallel_size=2, tensor_parallel_size=1)
    Traceback (most recent call last):
    ...
    ValueError: `context_parallel_size=2` with `pipeline_parallel_size=2` is not supported yet: context parallelism \
runs with data parallelism (dp × cp, one pipeline stage, tensor_parallel_size=1). Use pipeline_parallel_size=1, or \
context_parallel_size=1 (docs/limitations.md).
"""
from __future__ import annotations

from typing import Optional


def check_context_layout(context_parallel_size: int, *, pipeline_parallel_size: int, tensor_parallel_size: int,
                         zero_stage: int = 0, fault_tolerance: Optional[str] = None) -> None:
    """``ValueError`` naming the option that context parallelism does not compose with yet (nothing at cp = 1)."""
    cp = context_parallel_size
    if cp == 1:
        return
    for name, value, ok in (("pipeline_parallel_size", pipeline_parallel_size, pipeline_parallel_size == 1),
                            ("tensor_parallel_size", tensor_parallel_size, tensor_parallel_size == 1),
                            ("zero_stage", zero_stage, zero_stage <= 1),
                            ("fault_tolerance", fault_tolerance, fault_tolerance is None)):
        if not ok:
            fix = {"zero_stage": "zero_stage=0 or 1", "fault_tolerance": "fault_tolerance=None"}.get(name, f"{name}=1")
            raise ValueError(
                f"`context_parallel_size={cp}` with `{name}={value!r}` is not supported yet: context parallelism runs "
                f"with data parallelism (dp × cp, one pipeline stage, tensor_parallel_size=1). Use {fix}, or "
                f"context_parallel_size=1 (docs/limitations.md).")


__all__ = ["check_context_layout"]
