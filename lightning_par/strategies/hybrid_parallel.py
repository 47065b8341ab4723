"""Data × pipeline × tensor parallelism for an unchanged LightningModule: the one core of the layout strategies.

    Trainer(devices=8, strategy=HybridParallelStrategy(data_parallel_size=2, pipeline_parallel_size=2,
                                                        tensor_parallel_size=2, schedule="1f1b", microbatches=4))

The work lives in :mod:`lightning_par.pipeline` and :mod:`lightning_par.tensor`; this class wires it into
Lightning's hooks. :class:`~lightning_par.PipelineParallelStrategy` is this class with one tensor-parallel
rank per stage.

1. ``setup_environment``: the (pp, dp, tp) layout, the process group, one group per pipeline, replica set
   and point-to-point direction, and with tensor parallelism the ``DeviceMesh`` (axes ``pp``, ``dp``, ``tp``;
   tp innermost, pp outermost by default, ``mesh_order="dp_pp_tp"`` for replicas across nodes).
2. ``configure_ddp`` / ``setup``: every rank takes rank 0's weights; the block stack is found, traced and
   partitioned; the tensor plan is found on the whole module; this rank's stage is installed (other
   stages' blocks become ghosts) and what is left is parallelized over its tensor-parallel group, before the
   optimizers are built from what is left.
3. ``training_step``: the whole schedule (every micro-batch's forward and backward) in
   :mod:`~lightning_par.pipeline.runner`; ``backward``: tensor-parallel partial sums settled, then the
   gradients reduced over the stages that share a parameter and averaged over the replicas
   (:mod:`~lightning_par.pipeline.shared`).
4. ``validation_step`` / ``test_step`` / ``predict_step``: forward-only pipeline; every rank returns and logs
   the last stage's results, averaged over the replicas (:mod:`~lightning_par.pipeline.routing`).

[Note: activations between tensor-parallel stages]
A region (the smallest module holding both sides of a Megatron pair, see [Note: one layout per region])
takes plain tensors and hands back plain tensors, so a stage boundary, which is always between two blocks,
carries a plain tensor that every rank of the tensor-parallel group holds whole (replicated). Each
tensor-parallel rank of stage s sends to the rank of stage s + 1 with the same tp (and dp) coordinate, so
the p2p groups are the ``pp`` groups of the mesh and nothing crosses tensor-parallel groups.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_par import checkpoint as ckpt
from lightning_par.pipeline import sharded_checkpoint as sharded
from lightning_par.pipeline.consolidate import consolidate, gather_optimizer_state, optimizer_state_of, owned_state
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.pipeline.flow import trace_flow
from lightning_par.pipeline.mailbox import ResultMailbox
from lightning_par.pipeline.microbatch import check_microbatches
from lightning_par.pipeline.options import check_layout, check_options
from lightning_par.pipeline.partition import partition_blocks, stage_bounds, stage_table
from lightning_par.pipeline.routing import ResultRouter, confine_metrics
from lightning_par.pipeline.runner import ScheduleRunner, base_seed, rng_fork
from lightning_par.pipeline.shared import SharedParameters, sync_found_inf
from lightning_par.pipeline.stage import Ghost, StageRuntime
from lightning_par.strategies._base import LayoutStrategy, check_flags, check_zero_stage
from lightning_par.strategies._stage_setup import profile_blocks, sample_step
from lightning_par.tensor.mixed import clip_grad_value_, install_scaler, settle_grads, split_step_by_kind
from lightning_par.tensor.parallelize import backward_context, broadcast_state, parallelize, register_rules
from lightning_par.tensor.plan import build_plan, check_user_plan
from lightning_par.tensor.rules import restore_rules
from lightning_par.topology import ORDERS, Topology, check_sizes, keep_loader_on_one_process


class HybridParallelStrategy(LayoutStrategy):
    """``pipeline_parallel_size`` stages × ``tensor_parallel_size`` ranks per stage × ``data_parallel_size``
    replicas. Every pipeline option (``microbatches``, ``schedule``, ``stages_per_rank``, ``blocks``,
    ``balance``) and tensor option (``plan``) of the two presets; with one stage the pipeline options are
    accepted and ignored, so one config spans layouts. See the module docstring for the mesh order."""

    strategy_name = "hybrid_parallel"
    strategy_description = "lightning_par data × pipeline × tensor parallel (unchanged module)"
    _model_axis: Optional[str] = None  # the axis an "auto" size fills (the presets: "pp" or "tp")

    def __init__(
        self,
        *,
        data_parallel_size: Union[int, str] = "auto",
        pipeline_parallel_size: Union[int, str] = 1,
        tensor_parallel_size: Union[int, str] = 1,
        zero_stage: int = 0,
        mesh_order: str = "pp_dp_tp",
        microbatches: Optional[int] = None,
        schedule: str = "1f1b",
        stages_per_rank: int = 1,
        blocks: Optional[str] = None,
        balance: Union[str, Sequence[int]] = "params",
        plan: Union[str, Mapping[str, str]] = "auto",
        save_distributed_checkpoint: bool = False,
        start_method: str = "popen",
        timeout: Union[float, timedelta] = 1800.0,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: Optional[str] = None,
    ):
        check_sizes(pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
                    tensor_parallel_size=tensor_parallel_size)
        check_options(microbatches=microbatches, schedule=schedule, stages_per_rank=stages_per_rank, blocks=blocks,
                      balance=balance)
        check_zero_stage(zero_stage, built=(0,), strategy=type(self).__name__)
        if mesh_order not in ORDERS:
            raise ValueError(f"`mesh_order={mesh_order!r}` must be one of {sorted(ORDERS)}: 'pp_dp_tp' (pipelines "
                             f"span nodes, as Megatron and torchtitan) or 'dp_pp_tp' (replicas span nodes).")
        self._plan_arg = check_user_plan(plan) if plan != "auto" else plan
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint, start_method=start_method, timeout=timeout,
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
        )
        self._sizes = {"data_parallel_size": data_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
                       "tensor_parallel_size": tensor_parallel_size}
        self._order, self._zero_stage = ORDERS[mesh_order], zero_stage
        self._microbatches, self._schedule, self._stages_per_rank = microbatches, schedule, stages_per_rank
        self._blocks, self._balance = blocks, list(balance) if not isinstance(balance, str) else balance
        self._pp_group = self._dp_group = self._tp_group = self._mesh = self._plan = None
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
    def device_mesh(self):
        """The (pp, dp, tp) ``DeviceMesh`` (built when a stage has several tensor-parallel ranks)."""
        if self._mesh is None:
            raise RuntimeError("The device mesh exists once processes are set up, with tensor_parallel_size > 1.")
        return self._mesh

    @property
    def plan(self):
        """The :class:`~lightning_par.tensor.plan.TensorPlan` this rank's stage applied at setup."""
        if self._plan is None:
            raise RuntimeError("The tensor-parallel plan is applied in Trainer setup, with tensor_parallel_size > 1.")
        return self._plan

    @property
    def last_step_stats(self) -> dict[str, float]:
        """Seconds of the last training step's schedule (benchmarks, the bubble callback)."""
        return self._runner.last_step_stats if self._runner is not None else {}

    def _resolve(self) -> Topology:
        world = self.num_nodes * len(self.parallel_devices or [None])
        return Topology.resolve(world, model_axis=self._model_axis, order=self._order, **self._sizes)

    def _configure_launcher(self) -> None:  # in the launching process: bad sizes fail before any process starts
        self._resolve()
        super()._configure_launcher()

    def setup_environment(self) -> None:
        self._topology = topo = self._resolve()
        pp, tp = topo.pipeline_parallel_size, topo.tensor_parallel_size
        if pp == 1:  # one stage: nothing to interleave or to split into micro-batches ([Note: options at pp=1])
            self._stages_per_rank, self._microbatches = 1, 1
        check_layout(schedule=self._schedule, microbatches=self._microbatches, pipeline_parallel_size=pp)
        super().setup_environment()
        self._pp_group = self._new_groups("pp")
        self._dp_group = self._new_groups("dp")
        # activations up, gradients down, and with several chunks per rank the same to a lower / higher rank
        # (the ring wraps around): [Note: one direction per group] in pipeline/p2p.py
        self._p2p_groups = tuple(self._new_groups("pp") for _ in range(2 if self._stages_per_rank == 1 else 4))
        self._result_group = self._new_groups("pp")  # the last stage's step results: [Note: result mailbox]
        if tp > 1:
            self._mesh = topo.build_mesh(self.root_device.type, timeout=self._timeout)
            self._tp_group = self._mesh["tp"].get_group()

    # -- installing the stage ---------------------------------------------------------------------
    def setup(self, trainer) -> None:
        self._restore_loader = keep_loader_on_one_process(trainer, self.world_size)  # [Note: one process ...]
        if trainer.state.fn == TrainerFn.FITTING and not self.lightning_module.automatic_optimization:
            raise ValueError(
                f"{type(self).__name__} supports automatic optimization only: the schedule runs each "
                "micro-batch's backward itself. Remove `self.automatic_optimization = False` from the module."
            )
        if self._runtime is not None:
            # A later fit / validate / test / predict of the same Trainer (under popen, rank 0 is this very
            # process): the stage is installed, and DDPStrategy's module-state broadcast would now pair
            # tensors of different stages. Redo only what a stage needs.
            if self._mesh is not None:
                register_rules()  # taken out at teardown
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
        if self._mesh is not None:
            restore_rules()  # DTensor's propagator is process-global: no rule of ours outlives the run
        super().teardown()

    def configure_ddp(self) -> None:  # called by DDPStrategy.setup before the optimizers are built
        self._install()

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if self._mesh is not None:  # DTensor and plain parameters stepped apart ([Note: mixed DTensor / plain ...])
            for opt in self.optimizers:
                split_step_by_kind(opt._optimizer if isinstance(opt, LightningOptimizer) else opt)

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
            step = sample_step(self, lm, self._num_microbatches())
            flow = trace_flow(lm, path, container, step) if step is not None else None
        for warning in flow.warnings if flow is not None else ():
            rank_zero_warn(warning)
        # 2. blocks per stage: balanced by parameters, or by profiled time (balance="time")
        params = [sum(p.numel() for p in b.parameters()) for b in container]
        times = profile_blocks(self, lm, container, self._num_microbatches()) if self._balance == "time" else None
        pp, v = topo.pipeline_parallel_size, self._stages_per_rank
        counts = partition_blocks(len(container), pp * v, balance=self._balance,
                                  costs=times[1] if times else [float(n) for n in params],
                                  first_extra=times[0] if times else 0.0, last_extra=times[2] if times else 0.0)
        bounds = stage_bounds(counts)
        if flow is not None:
            flow.check_stages(path, bounds)
        # 3. the tensor plan, found on the whole module (pure: the same ValueError on every rank)
        tp = topo.tensor_parallel_size
        plan = build_plan(lm, tp, self._plan_arg) if tp > 1 else None
        self._full_keys = list(lm.state_dict().keys())
        self._block_prefix = f"{path}."
        total = sum(p.numel() for p in lm.parameters())
        rank_zero_info(stage_table(counts, params, times, path=path, total_params=total,
                                   replicas=topo.data_parallel_size, schedule=self._schedule, balance=self._balance))
        # 4. this rank's stage: its chunks' blocks stay, the others become ghosts; the rest is parallelized
        ring = topo.group_ranks("pp", self.global_rank)
        virtual = [c * pp + self.stage for c in range(v)]  # virtual stage c·p + s is this rank's chunk c
        self._runtime = rt = StageRuntime(
            container=container, chunks=[(k, *bounds[k]) for k in virtual], ranks=[ring[k % pp] for k in range(pp * v)],
            device=self.root_device, seed=base_seed(), groups=self._p2p_groups, flow=flow,
        )
        if self.world_size > 1:  # after every check that can refuse: every rank starts from rank 0's weights
            broadcast_state(lm, src=0)
        rt.install()
        if plan is not None:
            ghosts = [f"{path}.{i}" for i, block in enumerate(container) if isinstance(block, Ghost)]
            self._plan = plan.without(ghosts)
            parallelize(lm, self._plan, self._mesh["tp"])
            rank_zero_info(f"{topo}\n{self._plan.describe(lm)}")
        rt.weights = [p for p in lm.parameters() if p.requires_grad]
        # 5. the schedule, the routing of results, the gradients that span ranks
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
        # 6. Lightning's clipping and loss scaling see the whole model
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # global norm over stages and shards
        if self._mesh is not None:
            self.precision_plugin.clip_grad_by_value = lambda optimizer, value: clip_grad_value_(
                [p for g in optimizer.param_groups for p in g["params"]], value)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            install_scaler(scaler if self._mesh is not None else None)
            self._plugin_after_closure = self.precision_plugin._after_closure
            self.precision_plugin._after_closure = self._after_closure

    # -- training ---------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        loader = self.lightning_module.trainer.train_dataloader
        if self.topology.pipeline_parallel_size > 1:
            check_microbatches(self._microbatches, getattr(loader, "batch_size", None))

    def _num_microbatches(self) -> int:
        return self._microbatches or 2 * self.topology.pipeline_parallel_size

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        lm, (batch, *rest) = self.lightning_module, args
        with backward_context() if self._mesh is not None else _nothing():  # [Note: one layout per region]
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
        grads = self._new_grads
        if self._tp_group is not None:
            grads = settle_grads(self._shared.params, grads, self._tp_group)
        self._shared.add_step_gradients(grads, self.optimizers)
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
        self._shared.clip_grad_norm_(params, clip_val, group=self._pp_group, device=self.root_device,
                                     tp_group=self._tp_group)

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

    # -- checkpoints ([Note: consolidated checkpoint] in pipeline/consolidate.py) -----------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        lm = self.lightning_module
        if self._runtime is None:
            return lm.state_dict()
        if not self._save_distributed_checkpoint:
            return self.caller_state()
        # each rank writes its part: [Note: sharded pipeline checkpoint]
        return owned_state(lm, block_prefix=self._block_prefix, owns=self._owns, first_stage=self.stage == 0,
                           first_replica=self.topology.coordinates(self.global_rank)["dp"] == 0)

    def caller_state(self) -> dict[str, Any]:
        """The stages' owned state (tensor-parallel shards gathered within their group, whose ranks hold the
        same keys in the same order), assembled on rank 0 in the module's key order."""
        if self._runtime is None:
            return super().caller_state()
        mine = owned_state(self.lightning_module, block_prefix=self._block_prefix, owns=self._owns,
                           first_stage=self.stage == 0,
                           first_replica=self.topology.coordinates(self.global_rank)["dp"] == 0)
        return consolidate(ckpt.full_state(mine), self._full_keys, is_rank_zero=self.is_global_zero)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        lm = self.lightning_module
        if self._runtime is None:  # before setup: the whole unchanged module
            return super().load_model_state_dict(checkpoint, strict=strict)
        local = set(lm.state_dict())
        ckpt.load_model_state(lm, {k: v for k, v in checkpoint["state_dict"].items() if k in local}, strict=strict)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self._save_distributed_checkpoint:
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            first = self.topology.coordinates(self.global_rank)["dp"] == 0
            return sharded.optimizer_items(getattr(optimizer, "_optimizer", optimizer), names,
                                           lambda p: first and self._owns(p, names[id(p)]))
        return gather_optimizer_state(ckpt.local_state(super().optimizer_state(optimizer)), self.topology.sizes)

    def _load_distributed(self, path: str) -> dict[str, Any]:  # the optimizer states load after setup
        meta = ckpt.read_meta(path)
        state = sharded.load_model(path, self.lightning_module.state_dict())
        return {**meta, "state_dict": state, "optimizer_states": [None] * sharded.optimizer_count(path)}

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if self._dcp_path is not None:
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            for i, optimizer in enumerate(self.optimizers):
                sharded.load_optimizer(self._dcp_path, getattr(optimizer, "_optimizer", optimizer), i, names)
                _optimizer_to_device(optimizer, self.root_device)
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            ckpt.load_optimizer_state(getattr(optimizer, "_optimizer", optimizer),
                                      optimizer_state_of(state, self.topology.sizes, self.global_rank), local=True)
            _optimizer_to_device(optimizer, self.root_device)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


__all__ = ["HybridParallelStrategy"]
