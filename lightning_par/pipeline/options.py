"""Checks of the pipeline options, raised before any process starts (the strategy's constructor) or, for
what needs the world size, before the process group exists."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from lightning_par.pipeline.partition import BALANCES
from lightning_par.pipeline.schedules import SCHEDULES


def check_options(*, microbatches: Optional[int], schedule: str, stages_per_rank: int,
                  balance: Union[str, Sequence[int]], strict_batch_semantics: bool = False) -> None:
    """A ``ValueError`` naming the value and the fix for a bad pipeline option."""
    if not isinstance(strict_batch_semantics, bool):
        raise ValueError(f"`strict_batch_semantics={strict_batch_semantics!r}` must be True (refuse a loss that "
                         f"micro-batching changes) or False (warn).")
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                     or microbatches < 1):
        raise ValueError(f"`microbatches={microbatches!r}` must be a positive integer or None (2 × pipeline size).")
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule={schedule!r}` is not a pipeline schedule; choose one of {SCHEDULES}.")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"`stages_per_rank={stages_per_rank!r}` must be a positive integer.")
    if schedule == "interleaved_1f1b" and stages_per_rank < 2:
        raise ValueError(
            f"`schedule='interleaved_1f1b'` needs `stages_per_rank` >= 2 (got {stages_per_rank}): it interleaves "
            f"several virtual stages per rank. Use stages_per_rank=2 or schedule='1f1b'."
        )
    if schedule != "interleaved_1f1b" and stages_per_rank != 1:
        raise ValueError(
            f"`stages_per_rank={stages_per_rank}` needs `schedule='interleaved_1f1b'`; `{schedule}` runs one stage "
            f"per rank."
        )
    if isinstance(balance, str):
        if balance not in BALANCES:
            raise ValueError(f"`balance={balance!r}` must be one of {BALANCES} or a list of blocks per stage.")
    elif not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in balance):
        raise ValueError(f"`balance={list(balance)!r}` must list positive block counts, one per stage.")


def check_blocks(blocks: Optional[str]) -> None:
    """``blocks``: None (found) or the dotted name of the block stack (the pipeline's, FSDP's units, recompute's)."""
    if blocks is not None and (not isinstance(blocks, str) or not blocks):
        raise ValueError(f"`blocks={blocks!r}` must be the dotted name of the block container, e.g. 'model.layers'.")


def check_layout(*, schedule: str, microbatches: Optional[int], pipeline_parallel_size: int) -> None:
    """What the options need of the pipeline size, once it is known."""
    if schedule == "interleaved_1f1b" and microbatches is not None and microbatches % pipeline_parallel_size:
        raise ValueError(
            f"`schedule='interleaved_1f1b'` sends micro-batches through each chunk in groups of "
            f"pipeline_parallel_size ({pipeline_parallel_size}); `microbatches={microbatches}` must be a multiple "
            f"of it."
        )
