"""Pipeline parallelism for an unchanged LightningModule (``Trainer(strategy=PipelineParallelStrategy(...))``).

A preset of :class:`~lightning_par.strategies.hybrid_parallel.HybridParallelStrategy` with one
tensor-parallel rank per stage: the stage runtime, the schedules, shared parameters, result routing and
checkpoints are the core's (see its module docstring for the hooks).
"""
from __future__ import annotations

from lightning_par.options import CoreOptions, takes_options
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

    # the core with one tensor-parallel rank per stage: [Note: flat keywords, grouped options] in lightning_par.options
    __init__ = takes_options(CoreOptions, fixed={"tensor_parallel_size": 1, "context_parallel_size": 1,
                                                     "context_parallel_method": "ring"},
                             defaults={"pipeline_parallel_size": "auto"}, without=("tensor",))

__all__ = ["PipelineParallelStrategy"]
