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

from lightning_par.options import CoreOptions, takes_options
from lightning_par.strategies.hybrid_parallel import HybridParallelStrategy


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
        blocks: ``None`` (found) or the dotted name of the block stack that ``activation_checkpointing`` recomputes.
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

    # the core with one stage ([Note: flat keywords, grouped options] in lightning_par.options)
    __init__ = takes_options(CoreOptions, fixed={"pipeline_parallel_size": 1, "context_parallel_size": 1,
                                                     "context_parallel_method": "ring"},
                             defaults={"tensor_parallel_size": "auto"}, without=("pipeline",))

__all__ = ["TensorParallelStrategy"]
