"""Pipeline parallelism for an unchanged LightningModule: find the block stack, split it into stages,
run micro-batches through the stages by intercepting the blocks, in a GPipe or 1F1B order."""
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.pipeline.partition import partition_blocks, stage_bounds
from lightning_par.pipeline.schedules import SCHEDULES, bubble_fraction, stage_actions

__all__ = ["SCHEDULES", "bubble_fraction", "find_blocks", "partition_blocks", "stage_actions", "stage_bounds"]
