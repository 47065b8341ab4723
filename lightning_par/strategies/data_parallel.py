"""Data parallelism: Lightning's ``DDPStrategy`` (torch DDP; gloo on CPU, NCCL on CUDA) plus gradient
compression hooks on every backend, ZeRO-1/2/3 sharding and learning-rate scaling.

    Trainer(accelerator="cpu", devices=2, strategy=DataParallelStrategy())
    Trainer(devices=4, strategy=DataParallelStrategy(comm_hook="bf16", zero_stage=1, lr_scaling="linear"))
    Trainer(devices=2, strategy=DataParallelStrategy(zero_stage=3))      # FSDP2 over the data-parallel ranks
    Trainer(devices=2, strategy="data_parallel")

With the defaults it *is* Lightning's DDP: same wrapper, same reduction, same logged values (bit for
bit); on a single process it iterates the user's loader as it is, as plain Lightning does ([Note: one
process keeps the user's loader] in :mod:`lightning_par.topology`). It is the hybrid core's pp = tp = 1 preset:
:class:`~lightning_par.HybridParallelStrategy` lays the ranks out on the ``dp`` axis and runs the replica engine
(:mod:`~lightning_par.strategies._replica_engine`: DDP at zero_stage 0 / 1, FSDP2 at 2 / 3, [Note: zero_stage 2
and 3 on the replica engine]); fault tolerance is the core's (:mod:`~lightning_par.strategies._fault_tolerance`).
The work of each addition lives in :mod:`lightning_par.dp`; this class only calls it from the right Lightning
hook. Launched by fork or spawn under stages 2 / 3, the caller's module receives the whole trained weights.
Loss reporting is DDP's: rank-local ([Note: loss reporting, one rule] in :mod:`lightning_par.strategies._engine`).
"""
from __future__ import annotations

import torch.distributed
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel

from lightning_par.dp import comm_hooks
from lightning_par.dp import lr_scaling as scaling
from lightning_par.options import DataParallelOptions, SyncOptions, takes_options
from lightning_par.strategies._engine import Groups
from lightning_par.strategies._replica_engine import ReplicaEngine
from lightning_par.strategies.hybrid_parallel import HybridParallelStrategy


class DataParallelStrategy(HybridParallelStrategy):
    """Data parallel training of an unchanged ``LightningModule``: Lightning's ``DDPStrategy`` plus

    - ``comm_hook``: ``None`` (DDP's all-reduce), ``"fp16"`` / ``"bf16"`` (16-bit gradients on the wire:
      half the bytes, ~3 / ~2 significant digits), ``"powersgd"`` (rank-``powersgd_rank`` PowerSGD from
      iteration ``powersgd_start_iter``, plain all-reduce before). Registered on CPU/gloo as well as
      CUDA (Lightning registers hooks only on CUDA).
    - ``zero_stage``: ``0`` (replicas, DDP), ``1`` (the optimizer from ``configure_optimizers`` is wrapped in
      torch's ``ZeroRedundancyOptimizer``: each rank keeps ~1/N of its state; LR schedulers keep working),
      ``2`` (FSDP2: gradients reduce-scattered, each rank keeps 1/N of them and of the optimizer state;
      parameters gathered once per step) or ``3`` (FSDP2: parameters sharded as well, gathered per block in
      forward and again in backward); see [Note: what stages 2 and 3 keep and shard] in
      :mod:`lightning_par.dp.fsdp`. Stages 2 and 3 take no DDP option (comm hook, buckets...).
    - ``save_distributed_checkpoint``: ``False`` (one file in one device's format) or ``True`` (a DCP
      directory, each rank writing its shards); ``async_save``: write in the background. Either loads under
      any layout (:mod:`lightning_par.strategies._checkpoint`).
    - ``lr_scaling``: ``"none"``, ``"linear"`` or ``"sqrt"``: every configured learning rate (LR schedulers'
      ``base_lrs`` too) times ``global batch / reference_batch_size`` (or its root; ``None``: one device's batch
      per optimizer step); see :mod:`lightning_par.dp.lr_scaling`. Available as :attr:`lr_scale_factor`.
    - ``fault_tolerance``: ``None`` or ``"torchft"``: each torchrun job is one replica group of a torchft quorum
      (:mod:`lightning_par.dp.ft`); gradients are averaged over the live groups, a lost group drops out while
      at least ``min_replicas`` train on, and a restarted one rejoins with a live peer's state
      (``ft_timeout``: seconds to wait for a quorum, a peer or its state).
    - ``sync``: ``"every_step"`` (DDP), ``"local_sgd"`` or ``"diloco"``: each replica steps on its own gradients
      and every ``sync_every`` optimizer steps the replicas average their parameters (local SGD) or their change
      since the last sync, stepped by an outer Nesterov SGD (``outer_lr``, ``outer_momentum``; DiLoCo); see
      :mod:`lightning_par.dp.local_sgd` and [Note: replicas without DDP between syncs] in
      :mod:`~lightning_par.strategies._replica_engine`. ``fragments`` > 1 (``sync="diloco"``): streaming DiLoCo, the
      block stack's fragments synced at staggered steps, overlapped with the forward ([Note: streaming DiLoCo]).

    ``weights`` / ``weights_prefix``: a weights file read into the module at setup (each rank reads its FSDP
    shards only under stages 2 / 3, which also build ``trainer.init_module()`` modules on the meta device).
    DDP settings (passed to ``DistributedDataParallel``, defaults as there): ``find_unused_parameters``,
    ``bucket_cap_mb`` (None: 25 MiB buckets after a 1 MiB first one), ``gradient_as_bucket_view``
    (True saves a copy and the bucket-sized second gradient buffer), ``static_graph`` (True when every
    step uses the same parameters: lets DDP skip per-step graph bookkeeping).
    ``start_method``: ``"popen"`` (Lightning's default, re-runs the script per rank), ``"spawn"``,
    ``"fork"`` (fast on CPU; never after CUDA is initialised) or ``"forkserver"``. ``timeout``: seconds
    (or a timedelta) before a collective gives up. ``nonfinite``: ``"error"`` (a NaN / inf loss or gradient
    stops training, naming it) or ``"skip"`` (that optimizer step is skipped on every rank); see
    [Note: non-finite values] in :mod:`lightning_par.nonfinite`. ``process_group_backend``: ``None`` picks gloo for
    CPU and NCCL for CUDA.
    """

    strategy_name = "data_parallel"
    _ft_kind = "ddp"  # a replica group is one rank; torchft's average is a DDP comm hook
    strategy_description = "lightning_par data parallel (DDP + comm hooks, ZeRO-1, LR scaling)"

    __init__ = takes_options(DataParallelOptions, plumbing=False)  # [Note: flat keywords, grouped options]

    def _init_options(self, options: DataParallelOptions) -> None:
        self._dp_options = options  # frozen and checked, every group and across them (read by _sync_options)
        # the core with pp = tp = 1 and our fault tolerance (the core's checks are its layouts'; ours are
        # DataParallelOptions')
        super()._init_options(options.core(), ft_options=options.fault_tolerance)
        self._ddp_kwargs = options.replicas.ddp_kwargs(  # DistributedDataParallel's (DDPStrategy keeps them here)
            fault_tolerant=options.fault_tolerance.fault_tolerance is not None)
        self._lr_scale_factor: float | None = None

    # -- public state -------------------------------------------------------------------------------

    @property
    def comm_hook(self) -> str | None:
        return self._dp_options.comm.comm_hook

    @property
    def zero_stage(self) -> int:
        return self._options.sharding.zero_stage

    @property
    def lr_scale_factor(self) -> float:
        """The factor the configured learning rates were multiplied by (1.0 with ``lr_scaling="none"``)."""
        if self._dp_options.lr_scaling.lr_scaling == "none":
            return 1.0
        if self._lr_scale_factor is None:
            raise RuntimeError(f"`lr_scale_factor` is known once training starts (it needs the train dataloader's "
                               f"batch size); lr_scaling={self._dp_options.lr_scaling.lr_scaling!r}.")
        return self._lr_scale_factor

    @property
    def fsdp_units(self) -> list[str]:
        """Names of the modules sharded as FSDP units under ``zero_stage`` 2 / 3 (``""``: the root)."""
        units = self._engine.units if self._engine is not None else None
        if units is None:
            raise RuntimeError(f"`fsdp_units` exist once the module is sharded in Trainer setup (zero_stage="
                               f"{self.zero_stage}; only stages 2 and 3 shard it).")
        return units

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return self.zero_stage >= 2 or self._weights.restore_after_setup(self.lightning_module)  # into the shards

    def _meta_build(self) -> bool:
        return self.zero_stage >= 2  # DDP replicas hold the whole module anyway

    # -- Lightning hooks ----------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # in the launching process; the core refuses FSDP's precisions and offloads
        if self.zero_stage >= 2 and self._layer_sync is not None:
            raise ValueError(f"`Trainer(sync_batchnorm=True)` with `zero_stage={self.zero_stage}` is not supported "
                             f"(FSDP shards the module in place); use zero_stage=0 or 1 for SyncBatchNorm.")
        sync = self._dp_options.sync.sync
        if sync != "every_step" and self._layer_sync is not None:
            raise ValueError(f"`Trainer(sync_batchnorm=True)` with `sync={sync!r}` is not supported: SyncBatchNorm "
                             f"communicates in every forward, which local SGD / DiLoCo trains without. Drop "
                             f"sync_batchnorm, or use sync='every_step'.")

    def _consolidates_weights(self) -> bool:
        return self.zero_stage >= 2  # fork / spawn: the caller's module receives the whole weights of the shards

    def _engine_class(self, pipelined: bool) -> type:
        return ReplicaEngine

    def _sync_options(self) -> SyncOptions:
        return self._dp_options.sync

    def _sharded_replicas(self, topology=None) -> bool:
        return self.zero_stage >= 2  # FSDP at every size, one device too

    def _build_groups(self, pipelined: bool) -> Groups:
        """No group beyond Lightning's (DDP's is the world's); under zero_stage 2 / 3 FSDP's ``dp`` mesh."""
        sharded = self._sharded_replicas()
        mesh = self.topology.build_mesh(self.root_device.type, timeout=self._timeout) if sharded else None
        return Groups(mesh=mesh, timeout=self._timeout, sharded_replicas=sharded)

    def _register_ddp_hooks(self) -> None:
        """Register the chosen communication hook on every device type (Lightning: CUDA only; for bf16 on
        a CPU build see [Note: bf16 hook on CPU] in :mod:`lightning_par.dp.comm_hooks`); or torchft's."""
        if self._ft.start(self.lightning_module.trainer, self._engine):  # torchft's average is the hook
            return
        comm = self._dp_options.comm
        selected = comm_hooks.select_comm_hook(comm.comm_hook, powersgd_rank=comm.powersgd_rank,
                                               powersgd_start_iter=comm.powersgd_start_iter,
                                               backend=torch.distributed.get_backend())
        if selected is None:
            return
        if not isinstance(self.model, DistributedDataParallel):
            raise RuntimeError(f"comm_hook={comm.comm_hook!r} needs the DDP-wrapped model, found "
                               f"{type(self.model).__name__}.")
        state, hook = selected
        self.model.register_comm_hook(state, hook)

    def on_train_start(self) -> None:
        super().on_train_start()
        scaled = self._dp_options.lr_scaling
        if scaled.lr_scaling == "none":
            return
        # The train dataloader exists only from here on; a resumed run has restored already-scaled learning
        # rates by now, which apply_lr_scale detects ([Note: scaling an optimizer that a scheduler drives]).
        # Every rank computes the same factor, so a refusal is raised everywhere before any collective.
        trainer = self.lightning_module.trainer
        per_device = scaling.find_batch_size(trainer.train_dataloader)
        factor = scaling.resolve_lr_scale_factor(
            lr_scaling=scaled.lr_scaling, reference_batch_size=scaled.reference_batch_size,
            per_device_batch=per_device, world_size=self.world_size,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
        )
        scaling.apply_lr_scale(self.optimizers, [c.scheduler for c in self.lr_scheduler_configs], factor)
        self._lr_scale_factor = factor
        global_batch = scaling.global_batch_size(per_device, self.world_size, trainer.accumulate_grad_batches)
        reference = scaled.reference_batch_size or per_device * trainer.accumulate_grad_batches
        rank_zero_info(f"lr_scaling={scaled.lr_scaling!r}: learning rates x {factor:g} (global batch {global_batch} = "
                       f"{per_device} per device x {self.world_size} devices x {trainer.accumulate_grad_batches} "
                       f"accumulated, reference batch {reference})")
        for logger in trainer.loggers:
            logger.log_hyperparams({"lr_scale_factor": factor})


__all__ = ["DataParallelStrategy"]
