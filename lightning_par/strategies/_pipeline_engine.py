"""The core's hooks when the layout runs a pipeline (several stages, or the pipeline preset at any size):
install this rank's stage, parallelize what is left over its tensor-parallel group, and run each step's
schedule (see [Note: schedule inside training_step] in :mod:`lightning_par.pipeline.runner`).

[Note: activations between tensor-parallel stages]
A region (the smallest module holding both sides of a Megatron pair, see [Note: one layout per region])
takes plain tensors and hands back plain tensors, so a stage boundary, which is always between two blocks,
carries a plain tensor that every rank of the tensor-parallel group holds whole (replicated). Each
tensor-parallel rank of stage s sends to the rank of stage s + 1 with the same tp (and dp) coordinate, so
the p2p groups are the ``pp`` groups of the mesh and nothing crosses tensor-parallel groups. Under
``sequence_parallel`` the boundary carries each rank's sequence chunk instead ([Note: sequence-sharded stage
boundaries] in tensor/boundary.py); under ``loss_parallel`` the schedule (every forward and backward) runs
inside ``loss_parallel()`` and the step's result and logs are made plain ([Note: loss parallel] in
_spmd_engine.py). With ``context_parallel_size > 1`` each stage's blocks run on this rank's piece of every
sequence ([Note: context parallelism inside pipeline stages] in context/apply.py).
"""
from __future__ import annotations

import contextlib

from typing import Any, Optional, Union

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.tensor.parallel import loss_parallel

from lightning_par import patches
from lightning_par._compat import ddp_ignore, optimizers_to_device
from lightning_par.materialize import move_real
from lightning_par.parallelize import apply_context, parallelize_pipeline
from lightning_par.pipeline.consolidate import owned_state
from lightning_par.pipeline.microbatch import check_microbatches
from lightning_par.pipeline.runner import ScheduleRunner
from lightning_par.pipeline.shared import SharedParameters, sync_found_inf
from lightning_par.pipeline.stage import Ghost, StageRuntime
from lightning_par.pipeline.stand_ins import StandIns
from lightning_par.strategies._engine import Engine, optimizer_params as _params
from lightning_par.strategies._pipeline_sample import check_batch_semantics, profile_blocks, sample_step
from lightning_par.strategies._precision import PrecisionHooks
from lightning_par.tensor.mixed import clip_grad_value_, settle_grads
from lightning_par.tensor.parallelize import backward_context, register_rules, to_plain


class PipelineEngine(Engine):
    """The pipeline hooks of ``strategy`` (a :class:`~lightning_par.strategies.hybrid_parallel.HybridParallelStrategy`);
    see [Note: engines behind one interface] in :mod:`~lightning_par.strategies._engine`."""

    def __init__(self, strategy, options, groups, host):
        super().__init__(strategy, options, groups, host)
        self.s = strategy  # its public Lightning attributes only
        self.runtime: Optional[StageRuntime] = None
        self.runner: Optional[ScheduleRunner] = None
        self.shared: Optional[SharedParameters] = None
        self.plan = None
        self.precision_hooks: Optional[PrecisionHooks] = None
        self.new_grads: list[Optional[torch.Tensor]] = []  # this step's gradients, from training_step to backward
        self.full_keys: list[str] = []
        self.block_prefix = ""
        self.stand_ins: Optional[StandIns] = None  # the trace's of a meta-built module (its peak_bytes)
        self.context = None  # context_parallel_size > 1: the stage's blocks' hooks (lightning_par.context)
        self.unignore = lambda: None  # outside fit, DDP's ignore list (a patch: lightning_par.patches)

    @property
    def stage(self) -> int:
        return self.s.topology.coordinates(self.s.global_rank)["pp"]

    # -- setup ------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        s, g = self.s, self.groups
        if self.runtime is None:
            self.take_user_compile(s.lightning_module, self.options.blocks)  # before the trace reads the tree
        if trainer.state.fn == TrainerFn.FITTING and not s.lightning_module.automatic_optimization:
            raise ValueError(
                f"{type(s).__name__} supports automatic optimization only: the schedule runs each "
                "micro-batch's backward itself. Remove `self.automatic_optimization = False` from the module."
            )
        if self.runtime is not None:
            # A later fit / validate / test / predict of the same Trainer (under popen, rank 0 is this very
            # process): the stage is installed, and DDPStrategy's module-state broadcast would now pair
            # tensors of different stages. Redo only what a stage needs.
            if g.mesh is not None:
                register_rules()  # taken out at teardown
            s.accelerator.setup(trainer)
            self.host.install_precision(self.precision_hooks)  # given back at the last teardown
            self.checkpoint_blocks(s.lightning_module, self.block_prefix[:-1])  # taken out at teardown
            self.compile_blocks(s.lightning_module, self.block_prefix[:-1])
            self._apply_context()  # taken out at teardown
            s.model_to_device()
            if trainer.state.fn == TrainerFn.FITTING:
                s.setup_optimizers(trainer)
            s.setup_precision_plugin()
            if trainer.state.fn == TrainerFn.FITTING:
                optimizers_to_device(s.optimizers, s.root_device)
        else:
            self.host.lightning_setup(trainer)  # DDPStrategy.setup: model_to_device installs the stage, then optimizers
            self.unignore()  # DDP's ignore list out again
            self.unignore = lambda: None
        self.start_periodic_sync(trainer)  # sync="local_sgd" | "diloco": [Note: periodic sync on the data axis]

    def place(self, run=None) -> None:
        """DDPStrategy.setup's first step (``model_to_device``): the stage is installed before anything is placed.
        Outside fit DDPStrategy then broadcasts rank 0's states, another stage's: DDP's ignore list keeps every
        name out (until setup ends)."""
        s = self.s
        if self.runtime is None:
            self.install()
            lm = s.lightning_module
            if lm.trainer.state.fn != TrainerFn.FITTING:
                ddp_ignore(lm, [n for n, _ in [*lm.named_parameters(), *lm.named_buffers()]])
                self.unignore = patches.record("ddp-ignore", lambda: ddp_ignore(lm, None))
        move_real(s.model, s.root_device)

    def install(self) -> None:
        if self.runtime is not None:  # installed by model_to_device already
            return
        s, o, g = self.s, self.options, self.groups
        lm = s.lightning_module
        if any(isinstance(m, Ghost) for m in lm.modules()):
            raise RuntimeError(
                f"This {type(lm).__name__} was already split into pipeline stages by another Trainer in this "
                f"process; its other stages' blocks are gone. Reuse that Trainer, or load the consolidated "
                f"checkpoint into a fresh module (`{type(lm).__name__}.load_from_checkpoint(path)`)."
            )
        made = parallelize_pipeline(
            lm, o, g, self.rank_values(), sample=lambda blocks: sample_step(s, lm, o.microbatches, record=blocks),
            check_step=self._check_step, profile=lambda blocks: profile_blocks(s, lm, blocks, o.microbatches),
            place=self.host.place_share, reader=self.host.open_weights(lm),  # checked against the whole module
            before_split=(self.host.record_one_device_order  # [Note: recording one device's order]
                          if lm.trainer.state.fn == TrainerFn.FITTING else None),
            syncs_periodically=self.syncs_periodically, replica_average=self.replica_average, check=o.verify,
            user_compile=self.user_compile)
        rank_zero_info(made.summary)
        self.full_keys, self.stand_ins, self.plan = made.full_keys, made.stack.stand_ins, made.plan
        self.block_prefix, self.stack_path = f"{made.stack.path}.", made.stack.path
        self.runtime, self.checkpointed, self.context = made.runtime, made.checkpointed, made.context
        self.compiled, self.experts = made.compiled, made.experts  # experts: ZeRO-1's partition (experts/zero.py)
        self.runner, self.shared = made.schedule.runner, made.schedule.shared
        s.model = lm
        # Lightning's clipping and loss scaling see the whole model ([Note: precision subclasses])
        tensor = g.mesh is not None
        self.precision_hooks = PrecisionHooks(
            clip_by_norm=self.clip_grad_norm,  # global norm over stages and shards
            clip_by_value=(lambda opt, value: clip_grad_value_(_params(opt), value)) if tensor else None,
            before_optimizer_hooks=self.sync_found_inf if getattr(s.precision_plugin, "scaler", None) else None,
            split_unscale=tensor)
        self.host.install_precision(self.precision_hooks)

    def _check_step(self, stack) -> None:
        """The trace's warnings, then whether micro-batching changes the loss ([Note: losses that couple samples])."""
        for warning in stack.flow.warnings if stack.flow is not None else ():
            rank_zero_warn(warning)
        check_batch_semantics(self.s, self.s.lightning_module, stack.step, self.options.microbatches,
                              self.options.strict_batch_semantics)

    def _apply_context(self) -> None:
        """cp hooks on this stage's blocks, after the stage's and the checkpointing's own ([Note: context
        parallelism inside pipeline stages])."""
        if self.context is None:
            self.context = apply_context(self.s.lightning_module, self.groups, blocks=self.stack_path,
                                         runtime=self.runtime, method=self.options.context_parallel_method)

    def teardown(self) -> None:
        if self.context is not None:
            self.context.remove()
            self.context = None
        super().teardown()

    # -- training ---------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        loader = self.s.lightning_module.trainer.train_dataloader
        if self.s.topology.pipeline_parallel_size > 1:
            check_microbatches(self.options.given_microbatches, getattr(loader, "batch_size", None))

    def training_step(self, run, args: tuple, kwargs: dict) -> Any:
        s, o = self.s, self.options
        lm, (batch, *rest) = s.lightning_module, args
        tensor = self.groups.mesh is not None  # [Note: one layout per region]; [Note: loss parallel] in _spmd_engine.py
        with backward_context(loss_parallel=o.loss_parallel) if tensor else contextlib.nullcontext():
            result, self.new_grads = self.runner.train(
                lm, batch, self._plain(lambda mb: lm.training_step(mb, *rest, **kwargs)),
                context=s.precision_plugin.train_step_context,
                params=self.shared.params, accumulate=lm.trainer.accumulate_grad_batches,
                seed_step=lm.trainer.global_step * 65_537 + int(rest[0] if rest else 0),
                scaler=getattr(s.precision_plugin, "scaler", None),  # 16-mixed: one loss scale, see after_closure
            )
        return result

    def backward(self, run, closure_loss: torch.Tensor) -> torch.Tensor:
        s = self.s
        lm = s.lightning_module
        closure_loss = s.precision_plugin.pre_backward(closure_loss, lm)  # on_before_backward hooks
        grads = self.new_grads
        if self.groups.tp is not None:
            grads = settle_grads(self.shared.params, grads, self.groups.tp)
        self.shared.add_step_gradients(grads, s.optimizers)
        self.new_grads = []
        return s.precision_plugin.post_backward(closure_loss, lm)  # on_after_backward hooks

    def use_replica_average(self, average) -> None:
        super().use_replica_average(average)
        if self.shared is not None:
            self.shared.replica_average = average

    def owns(self, p: torch.nn.Parameter, name: str) -> bool:
        """Whether this stage counts ``p`` (for the global gradient norm and the consolidated state)."""
        return self.shared.owns(p, name)

    def sync_found_inf(self, optimizer) -> None:
        """16-mixed: one overflow anywhere skips the step everywhere, before Lightning's hooks, clipping and
        ``scaler.step`` see the flags."""
        sync_found_inf(self.s.precision_plugin.scaler, optimizer, self.s.root_device)

    def clip_grad_norm(self, optimizer, clip_val: Union[int, float]) -> None:
        g = self.groups
        self.shared.clip_grad_norm_(_params(optimizer), clip_val, group=g.pp, device=self.s.root_device, tp_group=g.tp,
                                    dp_group=g.dp if g.sharded_replicas else None)

    def eval_step(self, hook: str, run, context, args: tuple, kwargs: dict) -> Any:
        lm, (batch, *rest) = self.s.lightning_module, args
        with loss_parallel() if self._loss_parallel() else contextlib.nullcontext():
            return self.runner.evaluate(lm, batch, self._plain(lambda mb: getattr(lm, hook)(mb, *rest, **kwargs)),
                                        context=context, predict=hook == "predict_step")

    def _plain(self, step):
        """``step`` with its result made plain under loss_parallel (a DTensor loss; its logs: pipeline/routing.py),
        under cp inside the guard that leaves its routing modes when ``StopStage`` ends it."""
        if self.context is not None:
            step = _guarded(step, self.context)
        return (lambda mb: to_plain(step(mb))) if self._loss_parallel() else step

    def _loss_parallel(self) -> bool:
        return self.options.loss_parallel and self.groups.mesh is not None

    # -- checkpoints (the core implements lightning_par.strategies._checkpoint's interface with these) --------
    def owned_state(self) -> Optional[dict[str, torch.Tensor]]:
        """The entries of the module's state dict this stage writes ([Note: consolidated checkpoint])."""
        if self.runtime is None:
            return None
        s = self.s
        mine = owned_state(s.lightning_module, block_prefix=self.block_prefix, owns=self.owns,
                           first_stage=self.stage == 0,
                           first_replica=self._first_replica() or self.groups.sharded_replicas)
        if self._writes_experts():  # the other experts' holders too ([Note: who writes the experts] in experts/apply)
            mine.update(self.experts.state(s.lightning_module))
        return mine

    def writes_param(self, param, name: str) -> Optional[bool]:
        if self.runtime is None:
            return None
        replica_writes = self._first_replica() or (
            self.options.zero_stage >= 1 and self.s.topology.data_parallel_size > 1)  # each its partition / shards
        if self._writes_experts() and name in self.experts._names():
            replica_writes = True
        return replica_writes and self.owns(param, name)

    def _writes_experts(self) -> bool:
        return self.experts is not None and self.experts.first_holders(self.s.topology, self.s.global_rank)

    def expected_keys(self) -> Optional[list[str]]:
        return self.full_keys if self.runtime is not None else None

    def layout(self) -> dict[str, Any]:
        o = self.options
        return {**super().layout(), "schedule": o.schedule, "stages_per_rank": o.stages_per_rank,
                "balance": o.balance if isinstance(o.balance, str) else list(o.balance)}

    def _first_replica(self) -> bool:  # (and the first of its cp group: they hold the same parameters)
        coords = self.s.topology.coordinates(self.s.global_rank)
        return coords["dp"] == 0 and coords.get("cp", 0) == 0


def _guarded(step, context):
    def run(mb):
        with context.guard():
            return step(mb)
    return run


