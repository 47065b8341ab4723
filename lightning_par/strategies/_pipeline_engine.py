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

from lightning_par._compat import ddp_ignore, optimizers_to_device
from lightning_par.context.apply import apply_context_parallel
from lightning_par.dp import fsdp
from lightning_par.pipeline.consolidate import owned_state
from lightning_par.materialize import free_parameters, has_meta, move_real
from lightning_par.pipeline.discovery import check_enough_blocks, find_blocks
from lightning_par.pipeline.ends import first_owner, stage_needs
from lightning_par.pipeline.flow import trace_flow
from lightning_par.pipeline.mailbox import ResultMailbox
from lightning_par.pipeline.microbatch import check_microbatches
from lightning_par.pipeline.partition import partition_blocks, stage_bounds, stage_table
from lightning_par.pipeline.routing import ResultRouter, confine_metrics
from lightning_par.pipeline.runner import ScheduleRunner, base_seed, rng_fork
from lightning_par.pipeline.shared import SharedParameters, sync_found_inf
from lightning_par.pipeline.stand_ins import StandIns
from lightning_par.pipeline.stage import Ghost, StageRuntime
from lightning_par.strategies._engine import Engine, optimizer_params as _params
from lightning_par.strategies._pipeline_sample import check_batch_semantics, profile_blocks, sample_step
from lightning_par.strategies._precision import PrecisionHooks
from lightning_par.tensor.boundary import StageBoundary, check_sequence_stack
from lightning_par.tensor.mixed import clip_grad_value_, settle_grads
from lightning_par.tensor.parallelize import backward_context, broadcast_state, parallelize, register_rules, to_plain
from lightning_par.tensor.plan import build_plan


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

    @property
    def stage(self) -> int:
        return self.s.topology.coordinates(self.s.global_rank)["pp"]

    # -- setup ------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        s, g = self.s, self.groups
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
            self._apply_context()  # taken out at teardown
            s.model_to_device()
            if trainer.state.fn == TrainerFn.FITTING:
                s.setup_optimizers(trainer)
            s.setup_precision_plugin()
            if trainer.state.fn == TrainerFn.FITTING:
                optimizers_to_device(s.optimizers, s.root_device)
        else:
            self.host.lightning_setup(trainer)  # DDPStrategy.setup: model_to_device installs the stage, then optimizers
            ddp_ignore(s.lightning_module, None)
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
        move_real(s.model, s.root_device)

    def install(self) -> None:
        if self.runtime is not None:  # installed by model_to_device already
            return
        s, o, g = self.s, self.options, self.groups
        lm, topo = s.lightning_module, s.topology
        if any(isinstance(m, Ghost) for m in lm.modules()):
            raise RuntimeError(
                f"This {type(lm).__name__} was already split into pipeline stages by another Trainer in this "
                f"process; its other stages' blocks are gone. Reuse that Trainer, or load the consolidated "
                f"checkpoint into a fresh module (`{type(lm).__name__}.load_from_checkpoint(path)`)."
            )
        # 1. the block stack, what flows between its blocks ([Note: block flow] in pipeline/flow.py) and where the
        #    step uses what lies outside them ([Note: the ends a stage needs] in pipeline/ends.py), traced with
        #    stand-ins for a meta-built module's parameters ([Note: tracing a meta-built module] in
        #    pipeline/stand_ins.py); a weights file is checked against the whole module first
        reader = self.host.open_weights(lm)
        path, container = find_blocks(lm, o.blocks)
        check_enough_blocks(path, container, o.stages, o.stages_per_rank)  # before any collective
        self.stand_ins = StandIns(s.root_device) if has_meta(lm) else None
        with rng_fork(s.root_device, True):  # the batch drawn too: a shuffling sampler seeds from the global RNG
            step = sample_step(s, lm, o.microbatches, record=container)
            flow = trace_flow(lm, path, container, step, self.stand_ins) if step is not None else None
        uses = getattr(step, "uses", {})
        for warning in flow.warnings if flow is not None else ():
            rank_zero_warn(warning)
        # [Note: losses that couple samples] in pipeline/coupling.py
        check_batch_semantics(s, lm, step, o.microbatches, o.strict_batch_semantics)
        # 2. blocks per stage: balanced by parameters, or by profiled time (balance="time")
        params = [sum(p.numel() for p in b.parameters()) for b in container]
        balance = o.balance if isinstance(o.balance, str) else list(o.balance)
        times = profile_blocks(s, lm, container, o.microbatches) if balance == "time" else None
        pp, v = topo.pipeline_parallel_size, o.stages_per_rank
        counts = partition_blocks(len(container), pp * v, balance=balance,
                                  costs=times[1] if times else [float(n) for n in params],
                                  first_extra=times[0] if times else 0.0, last_extra=times[2] if times else 0.0)
        bounds = stage_bounds(counts)
        if flow is not None:
            flow.check_stages(path, bounds)
        # 3. the tensor plan, found on the whole module (pure: the same ValueError on every rank)
        tp = topo.tensor_parallel_size
        plan = build_plan(lm, tp, o.plan, sequence_parallel=o.sequence_parallel,
                          loss_parallel=o.loss_parallel) if tp > 1 else None
        if plan is not None and o.sequence_parallel:  # [Note: sequence-sharded stage boundaries]
            check_sequence_stack(plan, path, len(container), tp, flow.hidden_shape if flow is not None else None)
        self.full_keys = list(lm.state_dict().keys())
        self.block_prefix, self.stack_path = f"{path}.", path  # its other stages' blocks become ghosts below
        if lm.trainer.state.fn == TrainerFn.FITTING:
            self.host.record_one_device_order()  # before the split: [Note: recording one device's order]
        total = sum(p.numel() for p in lm.parameters())
        rank_zero_info(stage_table(counts, params, times, path=path, total_params=total,
                                   replicas=topo.data_parallel_size, schedule=o.schedule, balance=balance))
        # 4. this rank's stage: its chunks' blocks stay, the others become ghosts; the rest is parallelized
        ring = topo.group_ranks("pp", s.global_rank)
        virtual = [c * pp + self.stage for c in range(v)]  # virtual stage c·p + s is this rank's chunk c
        self.runtime = rt = StageRuntime(
            container=container, chunks=[(k, *bounds[k]) for k in virtual], ranks=[ring[k % pp] for k in range(pp * v)],
            device=s.root_device, seed=base_seed(), groups=g.p2p, flow=flow,
            boundary=StageBoundary(g.mesh["tp"], sequence_parallel=o.sequence_parallel) if plan is not None else None,
        )
        if s.world_size > 1:  # after every check that can refuse: every rank starts from rank 0's weights
            broadcast_state(lm, src=0)
        inputs = self._recorded_inputs(lm, plan, step, path, len(container), virtual, bounds)
        rt.install()
        self.checkpoint_blocks(lm, path)  # after the stage's hooks (a block's RNG is saved reseeded), before TP / FSDP
        if plan is not None:  # a meta-built stage is parallelized as meta tensors: each rank then makes its shards
            ghosts = [f"{path}.{i}" for i, block in enumerate(container) if isinstance(block, Ghost)]
            self.plan = plan.without(ghosts)
            parallelize(lm, self.plan, g.mesh["tp"], sequence_parallel=o.sequence_parallel, check=o.verify,
                        inputs=inputs)
            rank_zero_info(f"{topo}\n{self.plan.describe(lm)}")
        needs = stage_needs(uses, rt.chunks, pp * v)  # this stage's blocks and the ends it needs: placed, weights=
        owned = lambda n: n.startswith(self.block_prefix) or needs(n)  # noqa: E731
        shards = None
        if g.sharded_replicas:  # zero_stage 2 / 3: [Note: FSDP under pipeline parallelism] in dp/fsdp.py
            free_parameters(lm, [n for n, p in lm.named_parameters() if id(p) in _not_held(lm, owned)])
            fsdp.shard_module(lm, g.mesh["dp"], zero_stage=o.zero_stage, precision=s.precision_plugin.precision,
                              broadcast=False, ignored=[p for p in lm.parameters() if id(p) in _not_held(lm, owned)],
                              blocks=[(f"{path}.{i}", b) for i, b in enumerate(container) if not isinstance(b, Ghost)],
                              offload=o.offload)
        self.host.place_share(lm, reader, owned=owned)
        if g.sharded_replicas:
            shards = fsdp.StageShards(lm)
        rt.weights = [p for p in lm.parameters() if p.requires_grad and not p.is_meta]
        self._apply_context()
        # 5. the schedule, the routing of results, the gradients that span ranks
        mailbox = (ResultMailbox(ranks=ring, me=s.global_rank, group=g.result, device=s.root_device)
                   if g.result is not None else None)
        router = ResultRouter(mailbox=mailbox, is_last=rt.is_last, device=s.root_device, dp_group=g.dp,
                              dp_size=topo.data_parallel_size, pp_group=g.pp, last_rank=ring[-1])
        self.runner = ScheduleRunner(rt, router, schedule=o.schedule, stage=self.stage, num_stages=pp,
                                     microbatches=o.microbatches, shards=shards)
        self.shared = SharedParameters(lm, [p for p in lm.parameters() if p.requires_grad],
                                       {id(p) for b in container for p in b.parameters()}, topology=topo,
                                       rank=s.global_rank, timeout=g.timeout,
                                       dp_group=None if shards is not None or self.syncs_periodically else g.dp,
                                       cp_group=g.cp,
                                       default_owner=first_owner(uses, bounds, v))
        self.shared.replica_average = self.replica_average  # a communication hook's (torchft's: use_replica_average)
        s.model = lm
        confine_metrics(lm, is_last=rt.is_last, dp_group=g.dp)
        # 6. Lightning's clipping and loss scaling see the whole model ([Note: precision subclasses])
        tensor = g.mesh is not None
        self.precision_hooks = PrecisionHooks(
            clip_by_norm=self.clip_grad_norm,  # global norm over stages and shards
            clip_by_value=(lambda opt, value: clip_grad_value_(_params(opt), value)) if tensor else None,
            before_optimizer_hooks=self.sync_found_inf if getattr(s.precision_plugin, "scaler", None) else None,
            split_unscale=tensor)
        self.host.install_precision(self.precision_hooks)

    def _recorded_inputs(self, lm, plan, step, path, n_blocks, virtual, bounds):
        """The inputs of the first region of each kind among this rank's blocks, recorded in one more run of the
        trace's micro-batch on the whole module ([Note: the setup check] in lightning_par/verify.py); None where
        nothing is checked or nothing can run (a meta-built module runs on the meta device: [Note: the setup
        check])."""
        from lightning_par.pipeline.flow import kept_state
        from lightning_par.tensor.probe import probe_targets
        from lightning_par.verify import record_inputs

        if plan is None or step is None or not self.options.verify:
            return None
        mine = {i for k in virtual for i in range(*bounds[k])}
        stage_plan = plan.without([f"{path}.{i}" for i in range(n_blocks) if i not in mine])
        with rng_fork(self.s.root_device, True), kept_state(lm):
            return record_inputs(lm, probe_targets(lm, stage_plan), step)

    def _apply_context(self) -> None:
        """cp hooks on this stage's blocks, after the stage's and the checkpointing's own ([Note: context
        parallelism inside pipeline stages])."""
        if self.groups.cp is not None and self.context is None:
            self.context = apply_context_parallel(self.s.lightning_module, self.groups.cp,
                                                  blocks=self.block_prefix[:-1],
                                                  ranges=[(lo, hi) for _, lo, hi in self.runtime.chunks])
            self.runtime.send_last()  # after cp's gather

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
        return owned_state(s.lightning_module, block_prefix=self.block_prefix, owns=self.owns,
                           first_stage=self.stage == 0,
                           first_replica=self._first_replica() or self.groups.sharded_replicas)

    def writes_param(self, param, name: str) -> Optional[bool]:
        if self.runtime is None:
            return None
        replica_writes = self._first_replica() or (
            self.options.zero_stage >= 1 and self.s.topology.data_parallel_size > 1)  # each its partition / shards
        return replica_writes and self.owns(param, name)

    def expected_keys(self) -> Optional[list[str]]:
        return self.full_keys if self.runtime is not None else None

    def layout(self) -> dict[str, Any]:
        o = self.options
        return {"schedule": o.schedule, "stages_per_rank": o.stages_per_rank,
                "balance": o.balance if isinstance(o.balance, str) else list(o.balance)}

    def _first_replica(self) -> bool:  # (and the first of its cp group: they hold the same parameters)
        coords = self.s.topology.coordinates(self.s.global_rank)
        return coords["dp"] == 0 and coords.get("cp", 0) == 0


def _guarded(step, context):
    def run(mb):
        with context.guard():
            return step(mb)
    return run


def _not_held(module: torch.nn.Module, owned) -> set[int]:
    """Ids of the parameters none of whose names ``owned`` accepts (a tied parameter is held under any name)."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {i for i, ns in names.items() if not any(owned(n) for n in ns)}
