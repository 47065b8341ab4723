"""Data parallelism: Lightning's ``DDPStrategy`` (torch DDP; gloo on CPU, NCCL on CUDA) plus gradient
compression hooks on every backend, ZeRO-1 optimizer-state sharding and learning-rate scaling.

    Trainer(accelerator="cpu", devices=2, strategy=DataParallelStrategy())
    Trainer(devices=4, strategy=DataParallelStrategy(comm_hook="bf16", zero_stage=1, lr_scaling="linear"))
    Trainer(devices=2, strategy="data_parallel")

With the defaults it *is* Lightning's DDP: same wrapper, same reduction, same logged values (bit for
bit); on a single process it iterates the user's loader as it is, as plain Lightning does ([Note: one
process keeps the user's loader] in :mod:`lightning_par.topology`). The work of each addition lives in
:mod:`lightning_par.dp`; this class only calls it from the right Lightning hook.
"""
from __future__ import annotations

import datetime
from typing import Any, Literal

import torch.distributed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel

from lightning_par.dp import comm_hooks, zero
from lightning_par.strategies._base import as_timeout, check_start_method
from lightning_par.strategies._registry import RegisteredByName
from lightning_par.topology import keep_loader_on_one_process
from lightning_par.dp import lr_scaling as scaling


class DataParallelStrategy(RegisteredByName, DDPStrategy):
    """Data parallel training of an unchanged ``LightningModule``: Lightning's ``DDPStrategy`` plus

    - ``comm_hook``: ``None`` (DDP's all-reduce), ``"fp16"`` / ``"bf16"`` (16-bit gradients on the wire:
      half the bytes, ~3 / ~2 significant digits), ``"powersgd"`` (rank-``powersgd_rank`` PowerSGD from
      iteration ``powersgd_start_iter``, plain all-reduce before). Registered on CPU/gloo as well as
      CUDA (Lightning registers hooks only on CUDA).
    - ``zero_stage``: ``0`` or ``1`` (the optimizer from ``configure_optimizers`` is wrapped in torch's
      ``ZeroRedundancyOptimizer``: each rank keeps ~1/N of its state; LR schedulers keep working;
      checkpoints hold the consolidated state, loadable by a plain single-device run).
    - ``lr_scaling``: ``"none"``, ``"linear"`` or ``"sqrt"``: every configured learning rate (including
      the ``base_lrs`` of LR schedulers) is multiplied by ``global batch / reference_batch_size``
      (or its square root), where global batch = per-device batch × world size ×
      ``accumulate_grad_batches`` with the per-device batch read from the train dataloader when
      training starts. ``reference_batch_size=None`` means the batch one device takes per optimizer
      step (per-device batch × accumulate_grad_batches), i.e. the factor is the world size (or its
      root). The factor is printed on rank 0, logged as hyper-parameter ``lr_scale_factor`` and
      available as :attr:`lr_scale_factor`.

    DDP settings (passed to ``DistributedDataParallel``, defaults as there): ``find_unused_parameters``,
    ``bucket_cap_mb`` (None: 25 MiB buckets after a 1 MiB first one), ``gradient_as_bucket_view``
    (True saves a copy and the bucket-sized second gradient buffer), ``static_graph`` (True when every
    step uses the same parameters: lets DDP skip per-step graph bookkeeping).
    ``start_method``: ``"popen"`` (Lightning's default, re-runs the script per rank), ``"spawn"``,
    ``"fork"`` (fast on CPU; never after CUDA is initialised) or ``"forkserver"``. ``timeout``: seconds
    (or a timedelta) before a collective gives up. ``process_group_backend``: ``None`` picks gloo for
    CPU and NCCL for CUDA.
    """

    strategy_name = "data_parallel"
    strategy_description = "lightning_par data parallel (DDP + comm hooks, ZeRO-1, LR scaling)"

    def __init__(
        self,
        *,
        comm_hook: Literal["fp16", "bf16", "powersgd"] | None = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        zero_stage: int = 0,
        lr_scaling: Literal["none", "linear", "sqrt"] = "none",
        reference_batch_size: int | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        timeout: float | datetime.timedelta = 1800.0,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        process_group_backend: str | None = None,
    ) -> None:
        # 1. validate everything before any process or collective exists
        comm_hooks.validate_comm_hook(comm_hook, powersgd_rank, powersgd_start_iter)
        zero.validate_zero_stage(zero_stage)
        scaling.validate_lr_scaling(lr_scaling, reference_batch_size)
        check_start_method(start_method)
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                          or not bucket_cap_mb > 0):
            raise ValueError(f"`bucket_cap_mb={bucket_cap_mb!r}` must be a positive number of MiB or None (DDP's "
                             f"default: 25 MiB buckets after a 1 MiB first bucket).")
        for name, value in (("find_unused_parameters", find_unused_parameters),
                            ("gradient_as_bucket_view", gradient_as_bucket_view),
                            ("static_graph", static_graph)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}={value!r}` must be True or False.")
        ddp_kwargs: dict[str, Any] = dict(find_unused_parameters=find_unused_parameters,
                                          gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
        if bucket_cap_mb is not None:  # None leaves DDP's own bucketing (as Lightning's DDPStrategy does)
            ddp_kwargs["bucket_cap_mb"] = float(bucket_cap_mb)
        super().__init__(process_group_backend=process_group_backend, timeout=as_timeout(timeout),
                         start_method=start_method, **ddp_kwargs)
        self._comm_hook = comm_hook
        self._powersgd_rank = powersgd_rank
        self._powersgd_start_iter = powersgd_start_iter
        self._zero_stage = zero_stage
        self._lr_scaling = lr_scaling
        self._reference_batch_size = reference_batch_size
        self._lr_scale_factor: float | None = None
        self._restore_loader = lambda: None

    # -- public state -------------------------------------------------------------------------------

    @property
    def comm_hook(self) -> str | None:
        return self._comm_hook

    @property
    def zero_stage(self) -> int:
        return self._zero_stage

    @property
    def lr_scale_factor(self) -> float:
        """The factor the configured learning rates were multiplied by (1.0 with ``lr_scaling="none"``)."""
        if self._lr_scaling == "none":
            return 1.0
        if self._lr_scale_factor is None:
            raise RuntimeError(f"`lr_scale_factor` is known once training starts (it needs the train dataloader's "
                               f"batch size); lr_scaling={self._lr_scaling!r}.")
        return self._lr_scale_factor

    # -- Lightning hooks ----------------------------------------------------------------------------

    def _register_ddp_hooks(self) -> None:
        """Register the chosen communication hook on every device type (Lightning: CUDA only; for bf16 on
        a CPU build see [Note: bf16 hook on CPU] in :mod:`lightning_par.dp.comm_hooks`)."""
        selected = comm_hooks.select_comm_hook(self._comm_hook, powersgd_rank=self._powersgd_rank,
                                               powersgd_start_iter=self._powersgd_start_iter,
                                               backend=torch.distributed.get_backend())
        if selected is None:
            return
        if not isinstance(self.model, DistributedDataParallel):
            raise RuntimeError(f"comm_hook={self._comm_hook!r} needs the DDP-wrapped model, found "
                               f"{type(self.model).__name__}.")
        state, hook = selected
        self.model.register_comm_hook(state, hook)

    def setup(self, trainer) -> None:
        # [Note: one process keeps the user's loader] in lightning_par/topology.py
        self._restore_loader = keep_loader_on_one_process(trainer, self.world_size)
        super().setup(trainer)

    def teardown(self) -> None:
        self._restore_loader()
        super().teardown()

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if self._zero_stage == 1:  # [Note: wrapping the user's optimizer] in lightning_par.dp.zero
            sharded = [zero.shard_optimizer(opt) for opt in self.optimizers]
            by_id = {id(old): new for old, new in zip(self.optimizers, sharded)}
            for config in self.lr_scheduler_configs:
                new = by_id.get(id(config.scheduler.optimizer))
                if new is not None:
                    zero.rebind_scheduler(config.scheduler, new)
            self.optimizers = sharded

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._lr_scaling == "none":
            return
        # The train dataloader exists only from here on; a resumed run has restored already-scaled learning
        # rates by now, which apply_lr_scale detects ([Note: scaling an optimizer that a scheduler drives]).
        # Every rank computes the same factor, so a refusal is raised everywhere before any collective.
        trainer = self.lightning_module.trainer
        per_device = scaling.find_batch_size(trainer.train_dataloader)
        factor = scaling.resolve_lr_scale_factor(
            lr_scaling=self._lr_scaling, reference_batch_size=self._reference_batch_size,
            per_device_batch=per_device, world_size=self.world_size,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
        )
        scaling.apply_lr_scale(self.optimizers, [c.scheduler for c in self.lr_scheduler_configs], factor)
        self._lr_scale_factor = factor
        global_batch = scaling.global_batch_size(per_device, self.world_size, trainer.accumulate_grad_batches)
        reference = self._reference_batch_size or per_device * trainer.accumulate_grad_batches
        rank_zero_info(f"lr_scaling={self._lr_scaling!r}: learning rates x {factor:g} (global batch {global_batch} = "
                       f"{per_device} per device x {self.world_size} devices x {trainer.accumulate_grad_batches} "
                       f"accumulated, reference batch {reference})")
        for logger in trainer.loggers:
            logger.log_hyperparams({"lr_scale_factor": factor})



__all__ = ["DataParallelStrategy"]
