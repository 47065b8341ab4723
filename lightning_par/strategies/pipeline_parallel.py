"""Pipeline parallelism for an unchanged LightningModule (``Trainer(strategy=PipelineParallelStrategy(...))``).

The work lives in :mod:`lightning_par.pipeline`; this class wires it into Lightning's hooks:

1. ``setup_environment``: resolve the (pp, dp) layout, start the process group, build the groups.
2. ``configure_ddp`` / ``setup``: find the block stack, partition it, install this rank's stage
   (blocks of other stages become ghosts) before the optimizers are built from what is left.
3. ``training_step``: the whole schedule (every micro-batch's forward and backward) in
   :mod:`~lightning_par.pipeline.runner`, see [Note: schedule inside training_step] there; ``backward``:
   reduce and hand over the gradients (:mod:`~lightning_par.pipeline.shared`).
4. ``validation_step`` / ``test_step`` / ``predict_step``: forward-only pipeline; every rank returns and
   logs the last stage's results (:mod:`~lightning_par.pipeline.routing`).
5. Checkpoints: the hooks of :mod:`~lightning_par.strategies._checkpoint`; a stage writes the blocks and
   parameters it owns (:func:`~lightning_par.pipeline.consolidate.owned_state`), and one device's optimizer
   order is recorded before the module is split.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence, Union

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_par.pipeline.consolidate import owned_state
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.pipeline.flow import trace_flow
from lightning_par.pipeline.mailbox import ResultMailbox
from lightning_par.pipeline.microbatch import check_microbatches, first_batch, split_batch
from lightning_par.pipeline.options import check_layout, check_options
from lightning_par.pipeline.partition import partition_blocks, stage_bounds, stage_table
from lightning_par.pipeline.profile import mean_over_ranks, profile_step
from lightning_par.pipeline.routing import LogCapture, ResultRouter, confine_metrics
from lightning_par.pipeline.runner import ScheduleRunner, base_seed, loss_of, rng_fork
from lightning_par.pipeline.shared import SharedParameters, sync_found_inf
from lightning_par.pipeline.stage import Ghost, StageRuntime
from lightning_par.strategies._base import LayoutStrategy
from lightning_par.topology import Topology, check_sizes, keep_loader_on_one_process


class PipelineParallelStrategy(LayoutStrategy):
    """Split the model's repeated blocks into ``pipeline_parallel_size`` stages, ``data_parallel_size``
    replicas of the pipeline; micro-batches flow through the stages in a ``gpipe``, ``1f1b``,
    ``interleaved_1f1b`` (``stages_per_rank`` ≥ 2 chunks per rank) or ``zero_bubble`` order."""

    strategy_name = "pipeline_parallel"
    strategy_description = "lightning_par pipeline parallel (unchanged module; GPipe, 1F1B, interleaved, zero bubble)"

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
        check_sizes(pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size)
        check_options(microbatches=microbatches, schedule=schedule, stages_per_rank=stages_per_rank, blocks=blocks,
                      balance=balance)
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint, start_method=start_method, timeout=timeout,
            async_save=async_save, accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
        )
        self._pp_size, self._dp_size = pipeline_parallel_size, data_parallel_size
        self._microbatches, self._schedule, self._stages_per_rank = microbatches, schedule, stages_per_rank
        self._blocks, self._balance = blocks, list(balance) if not isinstance(balance, str) else balance
        self._pp_group = self._dp_group = None
        self._p2p_groups: tuple = (None, None, None, None)
        self._runtime: Optional[StageRuntime] = None
        self._runner: Optional[ScheduleRunner] = None
        self._shared: Optional[SharedParameters] = None
        self._new_grads: list[Optional[torch.Tensor]] = []  # this step's gradients, from training_step to backward
        self._full_keys: list[str] = []
        self._block_prefix = ""
        self._restore_loader = lambda: None

    # -- layout -----------------------------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.topology.coordinates(self.global_rank)["pp"]

    @property
    def runtime(self) -> StageRuntime:
        if self._runtime is None:
            raise RuntimeError("The pipeline stage exists only after the strategy's `setup`.")
        return self._runtime

    @property
    def last_step_stats(self) -> dict[str, float]:
        """Seconds of the last training step's schedule (benchmarks, the bubble callback)."""
        return self._runner.last_step_stats if self._runner is not None else {}

    def setup_environment(self) -> None:
        world = self.num_nodes * len(self.parallel_devices or [None])
        self._topology = Topology.resolve(world, data_parallel_size=self._dp_size,
                                          pipeline_parallel_size=self._pp_size, model_axis="pp")
        pp = self._topology.pipeline_parallel_size
        self._stages_per_rank = 1 if pp == 1 else self._stages_per_rank  # one stage: no chunks to interleave
        check_layout(schedule=self._schedule, microbatches=self._microbatches, pipeline_parallel_size=pp)
        super().setup_environment()
        self._pp_group = self._new_groups("pp")
        self._dp_group = self._new_groups("dp")
        # activations up, gradients down, and with several chunks per rank the same to a lower / higher rank
        # (the ring wraps around): [Note: one direction per group] in pipeline/p2p.py
        self._p2p_groups = tuple(self._new_groups("pp") for _ in range(2 if self._stages_per_rank == 1 else 4))
        self._result_group = self._new_groups("pp")  # the last stage's step results: [Note: result mailbox]

    # -- installing the stage ---------------------------------------------------------------------
    def setup(self, trainer) -> None:
        self._restore_loader = keep_loader_on_one_process(trainer, self.world_size)  # [Note: one process ...]
        if trainer.state.fn == TrainerFn.FITTING and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "PipelineParallelStrategy supports automatic optimization only: the schedule runs each "
                "micro-batch's backward itself. Remove `self.automatic_optimization = False` from the module."
            )
        if self._runtime is not None:
            # A later fit / validate / test / predict of the same Trainer (under popen, rank 0 is this very
            # process): the stage is installed, and DDPStrategy's module-state broadcast would now pair
            # tensors of different stages. Redo only what a stage needs.
            self.accelerator.setup(trainer)
            self.model_to_device()
            if trainer.state.fn == TrainerFn.FITTING:
                self.setup_optimizers(trainer)
            self.setup_precision_plugin()
            if trainer.state.fn == TrainerFn.FITTING:
                _optimizers_to_device(self.optimizers, self.root_device)
            return
        super().setup(trainer)
        if self._runtime is None:  # validate / test / predict: no configure_ddp
            self._install()

    def teardown(self) -> None:
        self._restore_loader()
        super().teardown()

    def configure_ddp(self) -> None:  # called by DDPStrategy.setup before the optimizers are built
        self._install()

    def _install(self) -> None:
        lm, topo = self.lightning_module, self.topology
        if any(isinstance(m, Ghost) for m in lm.modules()):
            raise RuntimeError(
                f"This {type(lm).__name__} was already split into pipeline stages by another Trainer in this "
                f"process; its other stages' blocks are gone. Reuse that Trainer, or load the consolidated "
                f"checkpoint into a fresh module (`{type(lm).__name__}.load_from_checkpoint(path)`)."
            )
        # 1. the block stack and what flows between its blocks ([Note: block flow] in pipeline/flow.py)
        path, container = find_blocks(lm, self._blocks)
        with rng_fork(self.root_device, True):  # the batch drawn too: a shuffling sampler seeds from the global RNG
            step = self._sample_step(lm)
            flow = trace_flow(lm, path, container, step) if step is not None else None
        for warning in flow.warnings if flow is not None else ():
            rank_zero_warn(warning)
        # 2. blocks per stage: balanced by parameters, or by profiled time (balance="time")
        params = [sum(p.numel() for p in b.parameters()) for b in container]
        times = self._profile(lm, container) if self._balance == "time" else None
        pp, v = topo.pipeline_parallel_size, self._stages_per_rank
        counts = partition_blocks(len(container), pp * v, balance=self._balance,
                                  costs=times[1] if times else [float(n) for n in params],
                                  first_extra=times[0] if times else 0.0, last_extra=times[2] if times else 0.0)
        bounds = stage_bounds(counts)
        if flow is not None:
            flow.check_stages(path, bounds)
        self._full_keys = list(lm.state_dict().keys())
        self._block_prefix = f"{path}."
        if lm.trainer.state.fn == TrainerFn.FITTING:
            self._record_one_device_order()  # before the split: [Note: recording one device's order]
        total = sum(p.numel() for p in lm.parameters())
        rank_zero_info(stage_table(counts, params, times, path=path, total_params=total,
                                   replicas=topo.data_parallel_size, schedule=self._schedule, balance=self._balance))
        # 3. this rank's stage: its chunks' blocks stay, the others become ghosts
        ring = topo.group_ranks("pp", self.global_rank)
        virtual = [c * pp + self.stage for c in range(v)]  # virtual stage c·p + s is this rank's chunk c
        self._runtime = rt = StageRuntime(
            container=container, chunks=[(k, *bounds[k]) for k in virtual], ranks=[ring[k % pp] for k in range(pp * v)],
            device=self.root_device, seed=base_seed(), groups=self._p2p_groups, flow=flow,
        )
        rt.install()
        rt.weights = [p for p in lm.parameters() if p.requires_grad]
        # 4. the schedule, the routing of results, the gradients that span ranks
        mailbox = (ResultMailbox(ranks=ring, me=self.global_rank, group=self._result_group, device=self.root_device)
                   if self._result_group is not None else None)
        router = ResultRouter(mailbox=mailbox, is_last=rt.is_last, device=self.root_device, dp_group=self._dp_group,
                              dp_size=topo.data_parallel_size, pp_group=self._pp_group, last_rank=ring[-1])
        self._runner = ScheduleRunner(rt, router, schedule=self._schedule, stage=self.stage, num_stages=pp,
                                      microbatches=self._num_microbatches())
        self._shared = SharedParameters(lm, [p for p in lm.parameters() if p.requires_grad],
                                        {id(p) for b in container for p in b.parameters()}, topology=topo,
                                        rank=self.global_rank, timeout=self._timeout, dp_group=self._dp_group)
        self.model = lm
        confine_metrics(lm, is_last=rt.is_last, dp_group=self._dp_group)
        # 5. Lightning's clipping and loss scaling see the whole pipeline
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # global norm over stages
        if getattr(self.precision_plugin, "scaler", None) is not None:
            self._plugin_after_closure = self.precision_plugin._after_closure
            self.precision_plugin._after_closure = self._after_closure

    def _profile(self, lm, container):
        """Every rank times the user's step on one micro-batch of its first training batch (see
        [Note: profiling the unchanged step] in pipeline/profile.py), all at once, so the timings see the
        contention of the real run (CPU ranks share cores and memory bandwidth, which slows a large head
        more than the blocks); every rank then uses the mean over ranks, so all choose the same split."""
        if lm.trainer.state.fn != TrainerFn.FITTING:
            rank_zero_warn("balance='time' profiles a training batch; outside fit the split follows 'params'.")
            return None

        def measure():
            with rng_fork(self.root_device, True):
                step = self._sample_step(lm)
                result = profile_step(container, lambda: loss_of(step()), self.root_device, repeats=8)
            for p in lm.parameters():
                p.grad = None
            return result
        return mean_over_ranks(measure)

    def _sample_step(self, lm):
        """The user's step (of this trainer function) on one micro-batch of its first batch, or None."""
        t, plugin = lm.trainer, self.precision_plugin
        loop, hook, context = {TrainerFn.FITTING: (t.fit_loop, "training_step", plugin.train_step_context),
                               TrainerFn.VALIDATING: (t.validate_loop, "validation_step", plugin.val_step_context),
                               TrainerFn.TESTING: (t.test_loop, "test_step", plugin.test_step_context),
                               TrainerFn.PREDICTING: (t.predict_loop, "predict_step", plugin.predict_step_context),
                               }[t.state.fn]
        batch = first_batch(loop._data_source.dataloader() if loop._data_source.is_defined() else None)
        if batch is None:
            return None
        mb = split_batch(self.batch_to_device(batch), self._num_microbatches())[0]

        def step():
            with LogCapture(lm), context():
                return getattr(lm, hook)(mb, 0)
        return step

    # -- training ---------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        loader = self.lightning_module.trainer.train_dataloader
        check_microbatches(self._microbatches, getattr(loader, "batch_size", None))

    def _num_microbatches(self) -> int:
        return self._microbatches or 2 * self.topology.pipeline_parallel_size

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        lm, (batch, *rest) = self.lightning_module, args
        result, self._new_grads = self._runner.train(
            lm, batch, lambda mb: lm.training_step(mb, *rest, **kwargs),
            context=self.precision_plugin.train_step_context,
            params=self._shared.params, accumulate=lm.trainer.accumulate_grad_batches,
            seed_step=lm.trainer.global_step * 65_537 + int(rest[0] if rest else 0),
            scaler=getattr(self.precision_plugin, "scaler", None),  # 16-mixed: one loss scale, see _after_closure
        )
        return result

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        lm = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)  # on_before_backward hooks
        self._shared.add_step_gradients(self._new_grads, self.optimizers)
        self._new_grads = []
        return self.precision_plugin.post_backward(closure_loss, lm)  # on_after_backward hooks

    def _owns(self, p: torch.nn.Parameter, name: str) -> bool:
        """Whether this stage counts ``p`` (for the global gradient norm and the consolidated state)."""
        return self._shared.owns(p, name)

    def _after_closure(self, model, optimizer) -> None:
        """16-mixed: one overflow anywhere skips the step everywhere, before Lightning's hooks, clipping and
        ``scaler.step`` see the flags."""
        sync_found_inf(self.precision_plugin.scaler, optimizer, self.root_device)
        self._plugin_after_closure(model, optimizer)

    def _clip_grad_by_norm(self, optimizer, clip_val: Union[int, float]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._shared.clip_grad_norm_(params, clip_val, group=self._pp_group, device=self.root_device)

    # -- evaluation -------------------------------------------------------------------------------
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _eval_step(self, hook: str, context, args: tuple, kwargs: dict) -> Any:
        lm, (batch, *rest) = self.lightning_module, args
        return self._runner.evaluate(lm, batch, lambda mb: getattr(lm, hook)(mb, *rest, **kwargs), context=context,
                                     predict=hook == "predict_step")

    # -- checkpoints: the interface of lightning_par.strategies._checkpoint ------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the installed stage: a directory's blocks are read by their stage only

    def _first_replica(self) -> bool:
        return self.topology.coordinates(self.global_rank)["dp"] == 0

    def _checkpoint_model_share(self) -> dict[str, Any]:
        lm = self.lightning_module
        if self._runtime is None:
            return lm.state_dict()
        return owned_state(lm, block_prefix=self._block_prefix, owns=self._owns, first_stage=self.stage == 0,
                           first_replica=self._first_replica())

    def _checkpoint_writes_param(self, param, name: str) -> bool:
        return self._runtime is None or (self._first_replica() and self._owns(param, name))

    def _checkpoint_expected_keys(self) -> list[str]:
        return self._full_keys if self._runtime is not None else list(self.lightning_module.state_dict())

    def _checkpoint_layout(self) -> dict[str, Any]:
        return {**super()._checkpoint_layout(), "schedule": self._schedule, "stages_per_rank": self._stages_per_rank,
                "balance": self._balance}


__all__ = ["PipelineParallelStrategy"]
