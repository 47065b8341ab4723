"""Pipeline parallelism for an unchanged LightningModule (``Trainer(strategy=PipelineParallelStrategy(...))``).

A preset of :class:`~lightning_par.strategies.hybrid_parallel.HybridParallelStrategy` with one
tensor-parallel rank per stage: the stage runtime, the schedules, shared parameters, result routing and
checkpoints are the core's (see its module docstring for the hooks).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence, Union

from lightning_par.strategies.hybrid_parallel import HybridParallelStrategy


class PipelineParallelStrategy(HybridParallelStrategy):
    """Split the model's repeated blocks into ``pipeline_parallel_size`` stages, ``data_parallel_size``
    replicas of the pipeline; micro-batches flow through the stages in a ``gpipe``, ``1f1b``,
    ``interleaved_1f1b`` (``stages_per_rank`` ≥ 2 chunks per rank) or ``zero_bubble`` order.
    ``pipeline_parallel_size="auto"`` takes every device not given to ``data_parallel_size``. A loss that couples
    the samples of a batch (contrastive, batch statistics) warns at setup, or with ``strict_batch_semantics=True``
    is refused ([Note: losses that couple samples] in :mod:`lightning_par.pipeline.coupling`).
    ``activation_checkpointing`` (``None``, ``"full"``, k, ``"selective"``): each stage's blocks recompute their forward
    in backward (:mod:`lightning_par.memory.checkpointing`).
    ``fault_tolerance="torchft"`` (``min_replicas``, ``ft_timeout``): each torchrun job is one replica group holding
    the whole pipeline, the replicas are the live groups (see the core, HybridParallelStrategy)."""

    strategy_name = "pipeline_parallel"
    strategy_description = "lightning_par pipeline parallel (unchanged module; GPipe, 1F1B, interleaved, zero bubble)"
    _model_axis = "pp"

    def __init__(
        self,
        *,
        pipeline_parallel_size: Union[int, str] = "auto",
        data_parallel_size: Union[int, str] = "auto",
        microbatches: Optional[int] = None,
        schedule: str = "1f1b",
        stages_per_rank: int = 1,
        blocks: Optional[str] = None,
        balance: Union[str, Sequence[int]] = "params",
        strict_batch_semantics: bool = False,
        activation_checkpointing: Union[int, str, None] = None,
        zero_stage: int = 0,
        weights: Optional[str] = None,
        weights_prefix: str = "",
        nonfinite: str = "error",
        fault_tolerance: Optional[str] = None,
        min_replicas: int = 1,
        ft_timeout: float = 60.0,
        save_distributed_checkpoint: bool = False,
        async_save: bool = False,
        start_method: str = "popen",
        timeout: Union[float, timedelta] = 1800.0,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: Optional[str] = None,
    ):
        super().__init__(
            data_parallel_size=data_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            tensor_parallel_size=1, zero_stage=zero_stage, microbatches=microbatches, schedule=schedule,
            stages_per_rank=stages_per_rank, blocks=blocks, balance=balance,
            strict_batch_semantics=strict_batch_semantics,
            activation_checkpointing=activation_checkpointing,
            nonfinite=nonfinite, fault_tolerance=fault_tolerance, min_replicas=min_replicas, ft_timeout=ft_timeout,
            weights=weights, weights_prefix=weights_prefix, async_save=async_save,
            save_distributed_checkpoint=save_distributed_checkpoint, start_method=start_method,
            timeout=timeout,
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
        )


__all__ = ["PipelineParallelStrategy"]
