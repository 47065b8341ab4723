"""Megatron-style tensor parallelism (DTensor) for an unchanged LightningModule, with data-parallel replicas.

    Trainer(devices=4, strategy=TensorParallelStrategy(tensor_parallel_size=2))   # tp=2 × dp=2

A preset of :class:`~lightning_par.strategies.hybrid_parallel.HybridParallelStrategy` with one pipeline
stage (the hooks of :mod:`~lightning_par.strategies._spmd_engine`): at setup the module is parallelized by
a plan found by inspecting it (:mod:`lightning_par.tensor.plan`; rank 0 prints the plan); gradients are
averaged over the data-parallel replicas after the last backward of each optimizer step, before clipping;
with replicas every rank returns and logs the mean over them.

[Note: a DDPStrategy base, not ModelParallelStrategy]
Lightning's ``ModelParallelStrategy`` only has the popen launcher, demands ``configure_model`` and
refuses ``16-mixed`` for its subclasses. ``DDPStrategy`` brings the popen / spawn / fork launchers,
process-group setup with a timeout, barrier / broadcast / reduce; the core never wraps the module in
``DistributedDataParallel`` (gradients of a tensor-parallel model are averaged over the ``dp`` mesh axis
by :func:`lightning_par.tensor.mixed.average_grads` instead), so DDP's hooks stay inert.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Literal, Mapping, Optional, Union

from lightning_par.strategies.hybrid_parallel import HybridParallelStrategy

Size = Union[int, Literal["auto"]]


class TensorParallelStrategy(HybridParallelStrategy):
    """Tensor parallel over ``tensor_parallel_size`` ranks × ``data_parallel_size`` replicas.

    Args:
        tensor_parallel_size: ranks that split each layer (``"auto"``: every device not given to data parallel).
        data_parallel_size: replicas (``"auto"``: world size / tensor_parallel_size).
        plan: ``"auto"`` or ``{module_glob: "colwise" | "rowwise" | "sequence" | "replicate"}`` overriding it.
        sequence_parallel: split the residual stream, norms and dropout inside the block stack along the
            sequence (all-gather / reduce-scatter instead of all-reduce); see [Note: sequence parallel span].
        loss_parallel: the output head writes vocabulary-sharded logits (the tied / matching embedding becomes
            vocabulary-parallel) and the user's ``F.cross_entropy`` runs on the shards inside
            ``torch.distributed.tensor.parallel.loss_parallel()``; see [Note: loss parallel].
        activation_checkpointing: ``None``, ``"full"``, an int k (every k-th block) or ``"selective"``: the blocks
            recompute their forward in backward, sharded (:mod:`lightning_par.memory.checkpointing`).
        zero_stage: 0-3 over the data-parallel replicas ([Note: ZeRO on the core's data axis] in dp/zero.py).
        weights: a weights file or directory read into each rank's shards at setup (see docs/meta-build-and-weights.md);
            ``weights_prefix``: what the module's names have before the file's (``"net."``).
        nonfinite: ``"error"`` (stop at a NaN / inf loss or gradient, naming it) or ``"skip"`` (skip that step
            on every rank); see [Note: non-finite values] in :mod:`lightning_par.nonfinite`.
        fault_tolerance: ``None`` or ``"torchft"`` (``min_replicas``, ``ft_timeout``): each torchrun job is one
            replica group of ``tensor_parallel_size`` ranks, the replicas are the live groups (see the core).
        save_distributed_checkpoint: write ``torch.distributed.checkpoint`` directories instead of one file.
        async_save: write checkpoints in the background (see :mod:`lightning_par.strategies._checkpoint`).
        start_method: ``"popen"`` (as DDPStrategy), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        timeout: collective timeout in seconds (or a ``timedelta``).
    """

    strategy_name = "tensor_parallel"
    strategy_description = "lightning_par tensor parallel (DTensor, auto Megatron plan)"
    _model_axis = "tp"

    def __init__(
        self,
        *,
        tensor_parallel_size: Size = "auto",
        data_parallel_size: Size = "auto",
        plan: Union[str, Mapping[str, str]] = "auto",
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
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
        timeout: Union[float, int, timedelta] = 1800.0,
        process_group_backend: Optional[str] = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size, pipeline_parallel_size=1, tensor_parallel_size=tensor_parallel_size,
            zero_stage=zero_stage, plan=plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
            activation_checkpointing=activation_checkpointing,
            nonfinite=nonfinite, fault_tolerance=fault_tolerance, min_replicas=min_replicas, ft_timeout=ft_timeout,
            weights=weights, weights_prefix=weights_prefix, async_save=async_save,
            save_distributed_checkpoint=save_distributed_checkpoint, start_method=start_method,
            timeout=timeout,
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
        )


__all__ = ["TensorParallelStrategy"]
