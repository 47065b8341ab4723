"""Data × pipeline × tensor parallelism for an unchanged LightningModule: the one core of the layout strategies.

    Trainer(devices=8, strategy=HybridParallelStrategy(data_parallel_size=2, pipeline_parallel_size=2,
                                                        tensor_parallel_size=2, schedule="1f1b", microbatches=4))

The work lives in :mod:`lightning_par.pipeline`, :mod:`lightning_par.tensor` and :mod:`lightning_par.dp`; this
class wires it into Lightning's hooks. Its presets fix sizes: :class:`~lightning_par.PipelineParallelStrategy`
tp = 1, :class:`~lightning_par.TensorParallelStrategy` pp = 1, :class:`~lightning_par.DataParallelStrategy`
pp = tp = 1. Several stages (or the pipeline preset) run the pipeline engine (``_pipeline_engine``), one stage
the SPMD engine (``_spmd_engine``), DataParallelStrategy the replica engine (``_replica_engine``: DDP or FSDP2);
all behind one interface ([Note: engines behind one interface] in :mod:`~lightning_par.strategies._engine`); an
engine applies the parallelize order of :mod:`lightning_par.parallelize`. The strategy overrides each Lightning hook
once, here, and owns its collaborators: the checkpointer (:mod:`~lightning_par.strategies._checkpoint`), fault
tolerance (:mod:`~lightning_par.strategies._fault_tolerance`), the step guard (non-finite values and named waits,
:mod:`~lightning_par.strategies._nonfinite`) and the weights reader (:mod:`~lightning_par.strategies._materialize`).

The hooks in the order Lightning calls them, and the walk of one training batch: docs/design.md.
"""
from __future__ import annotations

import contextlib
from typing import Any, Generator, Optional

import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_par.dp import fsdp, ft
from lightning_par.options import CoreOptions, SyncOptions, takes_options
from lightning_par.pipeline.options import check_layout
from lightning_par.pipeline.stage import StageRuntime
from lightning_par.strategies._base import build_groups, check_accumulation, resolve_topology, size_names
from lightning_par.strategies._checkpoint import Checkpointer, _unwrap as unwrap_optimizer
from lightning_par.strategies._checkpoint_io import AtomicCheckpointIO
from lightning_par.strategies._engine import Engine, EngineOptions, Groups, Host
from lightning_par.strategies._fault_tolerance import FaultTolerance
from lightning_par.strategies._materialize import Weights, meta_init_context, swap_launcher, teardown_meta
from lightning_par.strategies._nonfinite import SkipStep, StepGuard
from lightning_par.strategies._periodic_sync import SYNC_KEY  # the checkpoint entry of sync="local_sgd" | "diloco"
from lightning_par.strategies._pipeline_engine import PipelineEngine
from lightning_par.strategies._spmd_engine import SpmdEngine
from lightning_par.tensor.rules import restore_rules
from lightning_par.topology import ORDERS, Topology, keep_loader_on_one_process


class HybridParallelStrategy(DDPStrategy):
    """``pipeline_parallel_size`` stages × ``tensor_parallel_size`` ranks per stage × ``data_parallel_size``
    replicas on one ``DeviceMesh`` (axes ``pp``, ``dp``, ``tp``; tp innermost, pp outermost by default,
    ``mesh_order="dp_pp_tp"`` for replicas across nodes).

    Every pipeline option (``microbatches``, ``schedule``, ``stages_per_rank``, ``blocks``, ``balance``,
    ``strict_batch_semantics``: refuse a loss that micro-batching changes, see [Note: losses that couple samples]
    in :mod:`lightning_par.pipeline.coupling`, instead of warning), tensor option (``plan``, ``sequence_parallel``,
    ``loss_parallel``) and ``activation_checkpointing`` (:mod:`lightning_par.memory`) of the presets; with one stage the
    pipeline options are accepted and ignored, so one config spans layouts (``blocks`` still names the stack that
    ``activation_checkpointing`` recomputes). With several stages under
    ``sequence_parallel`` each tensor-parallel rank sends only its sequence chunk to the next stage
    ([Note: sequence-sharded stage boundaries] in :mod:`lightning_par.tensor.boundary`), and under
    ``loss_parallel`` the last stage computes the loss on vocabulary shards. Every rank returns and logs the
    mean over the replicas ([Note: loss reporting, one rule] in :mod:`~lightning_par.strategies._engine`).
    ``context_parallel_size``: ranks that share every sequence, each running the block stack on its piece
    (:mod:`lightning_par.context`); with one stage for now (dp × cp × tp).
    ``nonfinite``: ``"error"`` or ``"skip"`` ([Note: non-finite values] in :mod:`lightning_par.nonfinite`).
    ``weights`` / ``weights_prefix``: a weights file or directory read into each rank's share at setup; with
    ``trainer.init_module(empty_init=True)`` or ``configure_model`` the module is built on the meta device and
    each rank materializes only its share (:mod:`lightning_par.materialize`).
    ``fault_tolerance="torchft"`` (``min_replicas``, ``ft_timeout``): each torchrun job is one replica group holding
    the whole pp × tp model, and the replicas are the live groups ([Note: the replica axis under torchft] in
    :mod:`lightning_par.strategies._fault_tolerance`); with ``sync="local_sgd" | "diloco"`` they meet at syncs only."""

    strategy_name = "hybrid_parallel"
    strategy_description = "lightning_par data × pipeline × tensor parallel (unchanged module)"
    _model_axis: Optional[str] = None  # the axis an "auto" size fills (the presets: "pp" or "tp")
    _ft_kind = "core"  # what a fault-tolerant replica group is (lightning_par.strategies._fault_tolerance)

    __init__ = takes_options(CoreOptions)  # every option a keyword: [Note: flat keywords, grouped options]

    def _init_options(self, options: CoreOptions, *, ft_options=None, **plumbing: Any) -> None:
        """``options``: the frozen groups, checked ([Note: flat keywords, grouped options] in
        :mod:`lightning_par.options`); ``ft_options``: a preset's own fault-tolerance group, checked by it."""
        launch = options.launch
        io = plumbing.pop("checkpoint_io", None) or AtomicCheckpointIO()  # atomic saves ([Note: atomic checkpoints])
        super().__init__(**plumbing, checkpoint_io=io, process_group_backend=launch.process_group_backend,
                         start_method=launch.start_method, timeout=launch.collective_timeout)
        self._options = options  # frozen; the engine's options are built from its groups
        self._order = ORDERS[options.layout.mesh_order]
        self._topology: Optional[Topology] = None
        self._groups = Groups()
        self._engine: Optional[Engine] = None  # chosen with the layout (setup_environment)
        self._user_precision = None  # the precision plugin this run got, given back at teardown
        self._restore_loader = lambda: None
        self._step_hooks: list = []  # split_step_by_kind's optimizer hooks of this run, taken out at teardown
        c, f = options.checkpointing, ft_options or options.fault_tolerance
        self._checkpoints = Checkpointer(self, save_distributed_checkpoint=c.save_distributed_checkpoint,
                                         async_save=c.async_save)
        self._ft = FaultTolerance(self, self._ft_kind, f.fault_tolerance, f.min_replicas, f.ft_timeout,
                                  periodic=self._sync_options().sync != "every_step")
        self._guard = StepGuard(self, options.steps.nonfinite)
        self._weights = Weights(self, options.weights.weights, options.weights.weights_prefix)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:  # our own name only (not DDPStrategy's ddp_* variants)
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description)

    # -- layout ---------------------------------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError(f"The layout of {type(self).__name__} exists once its processes are set up "
                               f"(`setup_environment`, in Trainer.fit / validate / test / predict).")
        return self._topology

    stage = property(lambda self: self.topology.coordinates(self.global_rank)["pp"])  # this rank's pipeline stage

    @property
    def runtime(self) -> StageRuntime:
        if self._engine is None or self._engine.runtime is None:
            raise RuntimeError("The pipeline stage exists only after the strategy's `setup`, in a pipeline layout.")
        return self._engine.runtime

    @property
    def device_mesh(self):
        """The (pp, dp, tp) ``DeviceMesh`` (built with one stage, or with several tensor-parallel ranks)."""
        if self._groups.mesh is None:
            raise RuntimeError("The device mesh exists once processes are set up (Trainer.fit / validate / ...), "
                               "with one stage or tensor_parallel_size > 1.")
        return self._groups.mesh

    tp_mesh = property(lambda self: self.device_mesh["tp"])

    @property
    def plan(self):
        """The :class:`~lightning_par.tensor.plan.TensorPlan` this rank applied at setup."""
        if self._engine is None or self._engine.plan is None:
            raise RuntimeError("The tensor plan exists after Trainer setup (an earlier Trainer's, on its strategy).")
        return self._engine.plan

    @property
    def last_step_stats(self) -> dict[str, float]:
        """Seconds of the last training step's schedule (benchmarks, the bubble callback)."""
        return self._engine.last_step_stats if self._engine is not None else {}

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:  # only data-parallel replicas (or torchft's) split the data
        return self._ft.sampler_kwargs() or self.topology.sampler_kwargs(self.global_rank)

    fault_tolerance = property(lambda self: self._ft.fault_tolerance)  # None or "torchft"

    @property
    def replica(self):
        """This process's fault-tolerant replica (torchft's ``Manager`` at ``replica.manager``)."""
        if self._ft.replica is None:
            raise RuntimeError(f"`replica` exists from Trainer.fit's setup on, with fault_tolerance='torchft' "
                               f"(fault_tolerance={self._ft.fault_tolerance!r}).")
        return self._ft.replica

    @property
    def skipped_steps(self) -> list[int]:
        """Global steps skipped by ``nonfinite="skip"``."""
        return self._guard.skipped_steps

    @property
    def weights_bytes_read(self) -> int:
        """Bytes of tensor data this rank read from ``weights=`` (0 before setup or without weights)."""
        return self._weights.bytes_read

    def _owns(self, p: torch.nn.Parameter, name: str) -> bool:
        """Whether this rank counts ``p`` (for the global gradient norm and the consolidated state)."""
        return self._engine.owns(p, name) if self._engine is not None else True

    def _sharded_replicas(self, topology: Optional[Topology] = None) -> bool:
        """zero_stage 2 / 3 with several replicas: FSDP2 over the ``dp`` axis."""
        topology = topology or self.topology
        return self._options.sharding.zero_stage >= 2 and topology.data_parallel_size > 1

    def _resolve(self) -> Topology:
        world = self.num_nodes * len(self.parallel_devices or [None])
        return resolve_topology(self._options, world, model_axis=self._model_axis, order=self._order,
                                named=size_names(type(self)))

    def _configure_launcher(self) -> None:  # in the launching process: bad sizes fail before any process starts
        topo = self._resolve()
        zero_stage, offload = self._options.sharding.zero_stage, self._options.memory.offload
        if zero_stage >= 2:  # FSDP's precisions ([Note: mixed precision under FSDP] in dp/fsdp.py)
            fsdp.check_precision(self.precision_plugin.precision, zero_stage)
        fsdp.check_offload_layout(offload, sharded=self._sharded_replicas(topo),
                                  data_parallel_size=topo.data_parallel_size)
        fsdp.check_offload_devices(offload, self.parallel_devices or [])
        self._ft.check_launch(topo)  # the core: one replica group per job
        super()._configure_launcher()
        self._launcher = swap_launcher(self, self._launcher, self._start_method, self._consolidates_weights())

    def _consolidates_weights(self) -> bool:
        """Whether a fork / spawn launch hands the caller the whole module gathered from every rank (stages and
        shards: ConsolidatingLauncher) rather than rank 0's tensors (HeldTensorsLauncher)."""
        return True

    def setup_environment(self) -> None:
        self._topology = topo = self._resolve()
        pp = topo.pipeline_parallel_size
        pipelined = pp > 1 or self._model_axis == "pp"
        pipeline = self._options.pipeline
        check_layout(schedule=pipeline.schedule, microbatches=pipeline.microbatches, pipeline_parallel_size=pp)
        self._ft.setup_environment()  # fault_tolerance="torchft": this job's replica group
        super().setup_environment()
        if self._engine is not None:  # a later fit / validate / test of the same Trainer keeps the installed stage
            return
        engine = self._engine_class(pipelined)
        self._groups = groups = self._build_groups(pipelined)
        o = self._options
        options = EngineOptions(pipeline=o.pipeline, tensor=o.tensor, sharding=o.sharding, stack=o.stack,
                                memory=o.memory, stages=pp, sync=self._sync_options(), comm=o.comm,
                                check=o.verify, layout=o.layout)
        host = Host(open_weights=self._weights.open, place_share=self._weights.place,
                    install_precision=self._install_precision,
                    record_one_device_order=self._checkpoints.record_one_device_order,
                    lightning_setup=super().setup, lightning_teardown=self._lightning_teardown,
                    forward_redirection=self._forward_redirection, lightning_configure_ddp=super().configure_ddp)
        self._engine = engine(self, options, groups, host)

    def _engine_class(self, pipelined: bool) -> type:  # DataParallelStrategy: the replica engine
        return PipelineEngine if pipelined else SpmdEngine

    def _sync_options(self) -> SyncOptions:  # sync="local_sgd" | "diloco" on the data axis (DataParallelStrategy's own)
        return self._options.sync

    def _build_groups(self, pipelined: bool) -> Groups:
        return build_groups(self.topology, self.global_rank, self.root_device.type, timeout=self._timeout,
                            pipelined=pipelined, stages_per_rank=self._options.pipeline.stages_per_rank,
                            sharded_replicas=self._sharded_replicas())

    # -- setup and teardown: the engine's -------------------------------------------------------------------
    def _meta_build(self) -> bool:  # whether ``init_module()`` / ``configure_model`` build on the meta device
        return True

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Parameters on the meta device unless ``empty_init=False`` (``configure_model`` asks with ``None``);
        each rank materializes its share in setup (the weights reader's ``place``)."""
        context = (super().tensor_init_context(empty_init) if empty_init is False or not self._meta_build()
                   else meta_init_context(self))
        with context:
            yield

    def setup(self, trainer) -> None:
        check_accumulation(trainer)
        self._restore_loader = keep_loader_on_one_process(trainer, self._ft.loader_processes())  # [Note: one ...]
        self._engine.setup(trainer)
        self._ft.start(trainer, self._engine)  # fault_tolerance="torchft": this rank's replica ...
        self._ft.join()  # ... and the first quorum

    def model_to_device(self) -> None:
        self._engine.place(super().model_to_device)  # the pipeline: the stage first, nothing else placed

    def configure_ddp(self) -> None:  # called by DDPStrategy.setup before the optimizers are built
        self._engine.install()

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        self.optimizers, self._step_hooks = self._engine.wrap_optimizers(self.optimizers, self.lr_scheduler_configs)

    def _install_precision(self, hooks) -> None:
        """The layout's subclass of the precision plugin ([Note: precision subclasses])."""
        from lightning_par.strategies._precision import layout_precision

        if self._user_precision is None:
            self._user_precision = self.precision_plugin
        self.precision_plugin = layout_precision(self._user_precision, hooks)

    def _lightning_teardown(self) -> None:
        """DDPStrategy's teardown, or for a meta-built module the same steps moving only what holds storage."""
        self._checkpoints.close()
        self._weights.forget_restore_decision()
        if not teardown_meta(self):
            super().teardown()

    def teardown(self) -> None:
        self._ft.stop()
        self._checkpoints.close()  # a background save finishes first
        self._restore_loader()
        while self._step_hooks:
            self._step_hooks.pop().remove()
        if self._groups.mesh is not None:
            restore_rules()  # DTensor's propagator is process-global: no rule of ours outlives the run
        if self._engine is not None:
            self._engine.teardown()
        else:
            self._lightning_teardown()
        if self._user_precision is not None:
            self.precision_plugin, self._user_precision = self._user_precision, None

    # -- steps: the engine's --------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        self._ft.on_train_start()
        self._engine.on_train_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._ft.on_train_batch_start(self._engine)

    def on_train_end(self) -> None:
        super().on_train_end()
        self._engine.stop_periodic_sync()  # streaming DiLoCo: the last fragment's sync finished

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        lightning = super().training_step

        def run():  # Lightning's, in its named wait ([Note: every wait bounded] in lightning_par.waits)
            with self._guard.wait("training_step"):
                return lightning(*args, **kwargs)
        return self._engine.training_step(run, args, kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        lightning = super().backward

        def run():
            with self._guard.wait("backward"):
                return lightning(closure_loss, optimizer, *args, **kwargs)
        return self._engine.backward(run, closure_loss)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        """Every wrapping of Lightning's step, in one written order, from the outside in:

        1. the engine's ``finish_gradients``: the closure, then what settles the gradients (tensor-parallel partial
           sums, the replicas' average; nothing under DDP, whose reduction runs inside backward).
        2. ``fault_tolerance="torchft"``: the closure runs until the step commits on the live quorum ([Note: one
           step, committed exactly once] in :mod:`lightning_par.dp.ft`).
        3. The non-finite check at the end of the closure ([Note: checking inside the closure] in
           :mod:`~lightning_par.strategies._nonfinite`): a skip leaves ``optimizer.step`` by :class:`SkipStep`.
        4. Lightning's step (clipping, ``on_before_optimizer_step``, the update) inside a named wait.
        5. The engine's ``after_step()``, for a step taken or skipped (``sync="local_sgd" | "diloco"``: [Note:
           periodic sync on the data axis])."""
        closure = self._engine.finish_gradients(closure)  # 1.
        replica = self._ft.replica
        if replica is not None and self._ft.per_step_commit():  # 2. (local SGD / DiLoCo commit their syncs only)
            committed = replica.finish_step(closure)
            closure = lambda: committed  # noqa: E731
        topo = self.topology

        def checked_closure():  # 3.
            result = closure()
            self._guard.check_finite(optimizer, result, self.stage, topo.pipeline_parallel_size)
            return result

        with self._guard.wait("optimizer_step"):
            try:  # 4.
                result = super().optimizer_step(optimizer, checked_closure, model, **kwargs)
            except SkipStep:
                for hooks in self._step_hooks:  # the skipped step ran no post-hook: the user's param groups come back
                    hooks.restore()
                result = None
            self._engine.after_step()  # 5.
        return result

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        lightning = super().validation_step
        return self._engine.eval_step("validation_step", lambda: lightning(*args, **kwargs),
                                      self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        lightning = super().test_step
        return self._engine.eval_step("test_step", lambda: lightning(*args, **kwargs),
                                      self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        lightning = super().predict_step
        return self._engine.eval_step("predict_step", lambda: lightning(*args, **kwargs),
                                      self.precision_plugin.predict_step_context, args, kwargs)

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._checkpoint_prepare()

    def on_test_end(self) -> None:
        super().on_test_end()
        self._checkpoint_prepare()

    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._checkpoint_prepare()

    # -- checkpoints: the Checkpointer's, with the engine's answers (one format for every layout) ------------------
    def _checkpoint_prepare(self) -> None:  # FSDP's forward-only passes leave units gathered: back to the shards
        if self._engine is not None:
            self._engine.reshard()

    def _checkpoint_model_share(self) -> dict[str, Any]:
        share = self._engine.owned_state() if self._engine is not None else None  # a stage: no copies it never trains
        return share if share is not None else self.lightning_module.state_dict()

    def _checkpoint_writes_param(self, param, name: str) -> bool:
        writes = self._engine.writes_param(param, name) if self._engine is not None else None
        return writes if writes is not None else True

    def _checkpoint_expected_keys(self) -> list[str]:
        keys = self._engine.expected_keys() if self._engine is not None else None
        return keys if keys is not None else list(self.lightning_module.state_dict())

    def _checkpoint_layout(self) -> dict[str, Any]:
        return {"strategy": self.strategy_name, "world_size": self.world_size,
                **(self._engine.layout() if self._engine is not None else {})}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the installed stage and the shards: each rank reads what it holds

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._ft.sharing:  # a recovering peer's: this rank's own tensors ([Note: a rank's own state for its peer])
            return ft.local_module_state(self.lightning_module)
        return self._checkpoints.lightning_module_state_dict()

    def consolidated_state(self) -> dict[str, Any]:
        """The whole unchanged module's state dict on global rank 0 (``{}`` elsewhere; every rank calls it)."""
        return self._checkpoints.consolidated_state()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self._ft.sharing:
            return ft.local_optimizer_state(unwrap_optimizer(optimizer))
        return self._checkpoints.optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        state = self._engine.sync_state() if self._engine is not None else None  # every rank: a gather
        if state is not None:  # sync="local_sgd" | "diloco": [Note: periodic sync on the data axis]
            checkpoint = {**checkpoint, SYNC_KEY: state}
        self._checkpoints.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath) -> None:
        self._checkpoints.finish_save()
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        received = self._ft.received(checkpoint_path)  # healed from a live peer: its state, not the file's
        if received is not None:
            return received
        lightning = super().load_checkpoint
        return self._checkpoints.load_checkpoint(checkpoint_path, lambda path: lightning(path, weights_only=weights_only))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not self._ft.load_model_state_dict(checkpoint):  # a peer's share, or a checkpoint
            self._checkpoints.load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if not self._ft.load_optimizer_state_dict(checkpoint):
            self._checkpoints.load_optimizer_state_dict(checkpoint)
        if self._engine is not None:
            self._engine.load_sync_state(checkpoint.get(SYNC_KEY), where=self._checkpoints.where)


__all__ = ["HybridParallelStrategy"]
