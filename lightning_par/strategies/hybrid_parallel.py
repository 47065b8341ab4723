"""Data × pipeline × tensor parallelism for an unchanged LightningModule: the one core of the layout strategies.

    Trainer(devices=8, strategy=HybridParallelStrategy(data_parallel_size=2, pipeline_parallel_size=2,
                                                        tensor_parallel_size=2, schedule="1f1b", microbatches=4))

The work lives in :mod:`lightning_par.pipeline`, :mod:`lightning_par.tensor` and :mod:`lightning_par.dp`; this
class wires it into Lightning's hooks. Its presets fix sizes: :class:`~lightning_par.PipelineParallelStrategy`
tp = 1, :class:`~lightning_par.TensorParallelStrategy` pp = 1, :class:`~lightning_par.DataParallelStrategy`
pp = tp = 1. Several stages (or the pipeline preset) run the pipeline engine (``_pipeline_engine``), one stage
the SPMD engine (``_spmd_engine``), DataParallelStrategy the replica engine (``_replica_engine``: DDP or FSDP2);
all behind one interface ([Note: engines behind one interface] in :mod:`~lightning_par.strategies._engine`).

1. ``setup_environment``: the (pp, dp, cp, tp) layout, the process group, one group per pipeline, replica set
   and point-to-point direction, and with tensor parallelism the ``DeviceMesh`` (axes ``pp``, ``dp``, ``tp``;
   tp innermost, pp outermost by default, ``mesh_order="dp_pp_tp"`` for replicas across nodes; ``cp`` just
   outside tp when ``context_parallel_size > 1``).
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
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_par.context.layout import check_context_layout
from lightning_par.dp import fsdp, zero
from lightning_par.options import CoreOptions, SyncOptions, takes_options
from lightning_par.pipeline.options import check_layout
from lightning_par.pipeline.stage import StageRuntime
from lightning_par.strategies._base import LayoutStrategy, check_accumulation, size_names
from lightning_par.strategies._engine import Engine, EngineOptions, Groups, Host
from lightning_par.strategies._fault_tolerance import FaultTolerantReplicas
from lightning_par.strategies._periodic_sync import SYNC_KEY  # the checkpoint entry of sync="local_sgd" | "diloco"
from lightning_par.strategies._pipeline_engine import PipelineEngine
from lightning_par.strategies._spmd_engine import SpmdEngine
from lightning_par.tensor.mixed import split_step_by_kind
from lightning_par.tensor.rules import restore_rules
from lightning_par.topology import ORDERS, Topology, keep_loader_on_one_process


class HybridParallelStrategy(FaultTolerantReplicas, LayoutStrategy):
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

    __init__ = takes_options(CoreOptions)  # every option a keyword: [Note: flat keywords, grouped options]

    def _init_options(self, options: CoreOptions, **plumbing: Any) -> None:
        super().__init__(options, **plumbing)
        self._options = options  # frozen; the engine's options are built from its groups
        self._order = ORDERS[options.layout.mesh_order]
        self._groups = Groups()
        self._engine: Optional[Engine] = None  # chosen with the layout (setup_environment)
        self._user_precision = None  # the precision plugin this run got, given back at teardown
        self._restore_loader = lambda: None
        self._step_hooks: list = []  # split_step_by_kind's optimizer hooks of this run, taken out at teardown
        f = options.fault_tolerance
        self._init_fault_tolerance(f.fault_tolerance, f.min_replicas, f.ft_timeout)

    _ac = property(lambda self: self._options.memory.activation_checkpointing)  # the setting, from the group

    # -- layout -----------------------------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.topology.coordinates(self.global_rank)["pp"]

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

    @property
    def tp_mesh(self):
        return self.device_mesh["tp"]

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

    def _owns(self, p: torch.nn.Parameter, name: str) -> bool:
        """Whether this rank counts ``p`` (for the global gradient norm and the consolidated state)."""
        return self._engine.owns(p, name) if self._engine is not None else True

    def _sharded_replicas(self, topology: Optional[Topology] = None) -> bool:
        """zero_stage 2 / 3 with several replicas: FSDP2 over the ``dp`` axis."""
        topology = topology or self.topology
        return self._options.sharding.zero_stage >= 2 and topology.data_parallel_size > 1

    def _resolve(self) -> Topology:
        world = self.num_nodes * len(self.parallel_devices or [None])
        topo = Topology.resolve(world, model_axis=self._model_axis, order=self._order, named=size_names(type(self)),
                                **self._options.layout.sizes)
        o = self._options
        check_context_layout(topo.context_parallel_size, pipeline_parallel_size=topo.pipeline_parallel_size,
                             zero_stage=o.sharding.zero_stage, fault_tolerance=o.fault_tolerance.fault_tolerance,
                             sequence_parallel=o.tensor.sequence_parallel, loss_parallel=o.tensor.loss_parallel,
                             schedule=o.pipeline.schedule, stages_per_rank=o.pipeline.stages_per_rank)
        return topo

    def _configure_launcher(self) -> None:  # in the launching process: bad sizes fail before any process starts
        topo = self._resolve()
        zero_stage, offload = self._options.sharding.zero_stage, self._options.memory.offload
        if zero_stage >= 2:  # FSDP's precisions ([Note: mixed precision under FSDP] in dp/fsdp.py)
            fsdp.check_precision(self.precision_plugin.precision, zero_stage)
        fsdp.check_offload_layout(offload, sharded=self._sharded_replicas(topo),
                                  data_parallel_size=topo.data_parallel_size)
        fsdp.check_offload_devices(offload, self.parallel_devices or [])
        super()._configure_launcher()

    def setup_environment(self) -> None:
        self._topology = topo = self._resolve()
        pp = topo.pipeline_parallel_size
        pipelined = pp > 1 or self._model_axis == "pp"
        pipeline = self._options.pipeline
        check_layout(schedule=pipeline.schedule, microbatches=pipeline.microbatches, pipeline_parallel_size=pp)
        super().setup_environment()
        if self._engine is not None:  # a later fit / validate / test of the same Trainer keeps the installed stage
            return
        engine = self._engine_class(pipelined)
        self._groups = groups = self._build_groups(pipelined)
        o = self._options
        options = EngineOptions(pipeline=o.pipeline, tensor=o.tensor, sharding=o.sharding, stack=o.stack,
                                memory=o.memory, stages=pp, sync=self._sync_options(), comm=o.comm,
                                check=o.verify)
        host = Host(open_weights=self._open_weights, place_share=self._place_share,
                    install_precision=self._install_precision, record_one_device_order=self._record_one_device_order,
                    lightning_setup=super().setup, lightning_teardown=super().teardown,
                    forward_redirection=self._forward_redirection, lightning_configure_ddp=super().configure_ddp)
        self._engine = engine(self, options, groups, host)

    def _engine_class(self, pipelined: bool) -> type:  # DataParallelStrategy: the replica engine
        return PipelineEngine if pipelined else SpmdEngine

    def _sync_options(self) -> SyncOptions:  # sync="local_sgd" | "diloco" on the data axis (DataParallelStrategy's own)
        return self._options.sync

    def _build_groups(self, pipelined: bool) -> Groups:
        """One group per replica set, and with a pipeline per pipeline, point-to-point direction and result
        mailbox; the ``DeviceMesh`` with one stage, several tensor-parallel ranks or FSDP replicas."""
        topo = self.topology
        dp = self._new_groups("dp")
        cp = self._new_groups("cp")  # the ranks sharing every sequence (lightning_par.context)
        pp = result = None
        p2p: tuple = (None, None, None, None)
        if pipelined:
            pp = self._new_groups("pp")
            # activations up, gradients down, and with several chunks per rank the same to a lower / higher
            # rank (the ring wraps around): [Note: one direction per group] in pipeline/p2p.py
            chunks = self._options.pipeline.stages_per_rank if topo.pipeline_parallel_size > 1 else 1
            p2p = tuple(self._new_groups("pp") for _ in range(2 if chunks == 1 else 4))
            result = self._new_groups("pp")  # the last stage's step results: [Note: result mailbox]
        mesh = tp = None
        if topo.tensor_parallel_size > 1 or not pipelined or self._sharded_replicas():
            mesh = topo.build_mesh(self.root_device.type, timeout=self._timeout)
            tp = mesh["tp"].get_group() if topo.tensor_parallel_size > 1 else None
        return Groups(dp=dp, pp=pp, tp=tp, cp=cp, mesh=mesh, p2p=p2p, result=result, timeout=self._timeout,
                      sharded_replicas=self._sharded_replicas())

    # -- setup and teardown: the engine's ----------------------------------------------------------------
    def setup(self, trainer) -> None:
        check_accumulation(trainer)
        self._restore_loader = keep_loader_on_one_process(trainer, self._loader_processes())  # [Note: one process ...]
        self._engine.setup(trainer)
        self._start_replica(trainer)  # fault_tolerance="torchft": this rank's replica ...
        self._join_replicas()  # ... and the first quorum

    def model_to_device(self) -> None:
        self._engine.place(super().model_to_device)  # the pipeline: the stage first, nothing else placed

    def configure_ddp(self) -> None:  # called by DDPStrategy.setup before the optimizers are built
        self._engine.install()

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        zero_stage = self._options.sharding.zero_stage
        if zero_stage == 1 and self.topology.data_parallel_size > 1:  # [Note: ZeRO on the core's data axis]
            self.optimizers = zero.shard_optimizers(self.optimizers, self.lr_scheduler_configs, self._groups.dp)
        if self._groups.mesh is not None:  # DTensor and plain parameters stepped apart ([Note: mixed DTensor ...])
            self._step_hooks = [split_step_by_kind(zero.local_optimizer(
                opt.optimizer if isinstance(opt, LightningOptimizer) else opt)) for opt in self.optimizers]

    def _install_precision(self, hooks) -> None:
        """The layout's subclass of the precision plugin ([Note: precision subclasses])."""
        from lightning_par.strategies._precision import layout_precision

        if self._user_precision is None:
            self._user_precision = self.precision_plugin
        self.precision_plugin = layout_precision(self._user_precision, hooks)

    def teardown(self) -> None:
        self._stop_replica()
        self._close_checkpointing()  # a background save finishes first
        self._restore_loader()
        while self._step_hooks:
            self._step_hooks.pop().remove()
        if self._groups.mesh is not None:
            restore_rules()  # DTensor's propagator is process-global: no rule of ours outlives the run
        if self._engine is not None:
            self._engine.teardown()
        else:
            super().teardown()
        if self._user_precision is not None:
            self.precision_plugin, self._user_precision = self._user_precision, None

    # -- steps: the engine's --------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        self._engine.on_train_start()

    def on_train_end(self) -> None:
        super().on_train_end()
        self._engine.stop_periodic_sync()  # streaming DiLoCo: the last fragment's sync finished

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine.training_step(lambda: super(HybridParallelStrategy, self).training_step(*args, **kwargs),
                                          args, kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._engine.backward(
            lambda: super(HybridParallelStrategy, self).backward(closure_loss, optimizer, *args, **kwargs),
            closure_loss)

    def _finish_gradients(self, closure):  # step 1 of OptimizerStep.optimizer_step
        return self._engine.finish_gradients(closure)

    def _after_optimizer_step(self) -> None:  # step 5
        self._engine.after_step()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _eval_step(self, hook: str, context, args: tuple, kwargs: dict) -> Any:
        run = lambda: getattr(super(HybridParallelStrategy, self), hook)(*args, **kwargs)  # noqa: E731
        return self._engine.eval_step(hook, run, context, args, kwargs)

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._checkpoint_prepare()

    def on_test_end(self) -> None:
        super().on_test_end()
        self._checkpoint_prepare()

    # -- checkpoints: the interface of lightning_par.strategies._checkpoint (one format for every layout) --
    def _checkpoint_prepare(self) -> None:  # FSDP's forward-only passes leave units gathered: back to the shards
        if self._engine is not None:
            self._engine.reshard()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the installed stage and the shards: each rank reads what it holds

    def _checkpoint_model_share(self) -> dict[str, Any]:
        share = self._engine.owned_state() if self._engine is not None else None  # a stage: no copies it never trains
        return share if share is not None else super()._checkpoint_model_share()

    def _checkpoint_writes_param(self, param, name: str) -> bool:
        writes = self._engine.writes_param(param, name) if self._engine is not None else None
        return writes if writes is not None else super()._checkpoint_writes_param(param, name)

    def _checkpoint_expected_keys(self) -> list[str]:
        keys = self._engine.expected_keys() if self._engine is not None else None
        return keys if keys is not None else super()._checkpoint_expected_keys()

    def _checkpoint_layout(self) -> dict[str, Any]:
        return {**super()._checkpoint_layout(), "mesh_order": "_".join(self.topology.order),
                **(self._engine.layout() if self._engine is not None else {})}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        state = self._engine.sync_state() if self._engine is not None else None  # every rank: a gather
        if state is not None:  # sync="local_sgd" | "diloco": [Note: periodic sync on the data axis]
            checkpoint = {**checkpoint, SYNC_KEY: state}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._engine is not None:
            self._engine.load_sync_state(checkpoint.get(SYNC_KEY), where=self._ckpt_where)


__all__ = ["HybridParallelStrategy"]
