"""The interface of the core's engines: what :class:`~lightning_par.HybridParallelStrategy` delegates to, the same
methods for the pipeline engine (:mod:`~lightning_par.strategies._pipeline_engine`: several stages, or the
pipeline preset at any size), the SPMD engine (:mod:`~lightning_par.strategies._spmd_engine`: one stage, the
user's step run by Lightning as it is) and the replica engine (:mod:`~lightning_par.strategies._replica_engine`:
DataParallelStrategy's DDP or FSDP2 replicas).

[Note: engines behind one interface]
An engine is built once per strategy (in ``setup_environment``, when the layout is known) from three frozen
objects: :class:`EngineOptions` (the strategy's frozen option groups, resolved for this layout), :class:`Groups`
(the process groups and the mesh it needs) and :class:`Host` (the strategy's own services it calls back: weights,
the precision subclass, Lightning's DDP setup). Beyond those it reads only the strategy's public Lightning attributes
(``lightning_module``, ``root_device``, ``precision_plugin``, ``topology``, ...), never its private ones. The
strategy picks the engine class once and calls every hook through :class:`Engine`'s methods, with no
``isinstance``. A hook that Lightning's default implementation serves for one engine receives that default as
``run`` (a callable) and the engine decides whether to call it; checkpoint hooks return None where the
strategy's default applies.

[Note: loss reporting, one rule]
What a step returns and logs: :class:`~lightning_par.DataParallelStrategy` (every zero stage, torchft too) keeps
DDP's rank-local values (``self.log(..., sync_dist=True)`` averages them), so at zero stage 0 it stays bit for bit
Lightning's ``DDPStrategy``. The core (HybridParallelStrategy and its pipeline / tensor presets) reports the mean
over the data-parallel replicas on every rank, at every size (one replica: its own value): what one device gives
for the global batch, so ``trainer.callback_metrics`` agree on every rank. The returned loss keeps this rank's
own gradient (the engines average the gradients, not the loss). The SPMD engine takes the mean in its
``eval_step`` ([Note: the replicas' mean of a step] in :mod:`~lightning_par.strategies._spmd_engine`), the
pipeline engine when it routes the last stage's results ([Note: log routing] in
:mod:`lightning_par.pipeline.routing`). Under torchft the replicas are the live groups, known only to torchft and
changing from step to step, so each group reports the mean over its own batch (the rule with
``data_parallel_size=1``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from lightning_par.dp import zero
from lightning_par.compile import Compiled, UserCompile, compile_stacks, compile_what, take_user_compile
from lightning_par.dp.comm_hooks import HookAverage
from lightning_par.memory.checkpointing import Checkpointed, apply_activation_checkpointing
from lightning_par.strategies._checkpoint import _unwrap
from lightning_par.strategies._periodic_sync import PeriodicSyncHooks
from lightning_par.tensor.mixed import split_step_by_kind
from lightning_par.parallelize import EngineOptions, Groups, Rank  # noqa: F401  - the engines' values


@dataclass(frozen=True)
class Host:
    """The strategy's services an engine calls (bound methods of the strategy)."""

    open_weights: Callable  # (module) -> reader or None
    place_share: Callable  # (module, reader, owned=None)
    install_precision: Callable  # (PrecisionHooks)
    record_one_device_order: Callable  # ()
    lightning_setup: Callable  # (trainer): DDPStrategy.setup
    lightning_teardown: Callable  # (): the strategy's Lightning teardown
    forward_redirection: Any = None  # Lightning's, for a step run through FSDP's root unit
    lightning_configure_ddp: Optional[Callable] = None  # (): DDPStrategy.configure_ddp (the replica engine's DDP)


class Engine(PeriodicSyncHooks):
    """The methods every engine has; the defaults are what an engine that needs nothing there does."""

    runtime = None  # the pipeline stage (the pipeline engine, once installed)
    plan = None  # the tensor plan this rank applied
    stand_ins = None  # the trace's stand-ins of a meta-built module
    runner = None  # the schedule runner (the pipeline engine)
    checkpointed: Optional[Checkpointed] = None  # the blocks activation_checkpointing recomputes
    compiled: Optional[Compiled] = None  # the blocks compile= (or the user's torch.compile) compiled
    user_compile: Optional[UserCompile] = None  # the user's torch.compile, undone at setup

    def __init__(self, strategy, options: EngineOptions, groups: Groups, host: Host) -> None:
        self.strategy, self.options, self.groups, self.host = strategy, options, groups, host
        # how the replicas average a flat gradient bucket in place, where not by the dp group's all-reduce: a DDP
        # communication hook's ([Note: DDP's hooks on the core's flat buckets] in lightning_par.dp.comm_hooks) or,
        # under torchft, its average over the live replica groups (use_replica_average)
        self.replica_average: Optional[Callable] = None
        if options.comm.comm_hook is not None and groups.dp is not None:
            self.replica_average = HookAverage(options.comm.comm_hook, groups.dp,
                                               powersgd_rank=options.comm.powersgd_rank,
                                               powersgd_start_iter=options.comm.powersgd_start_iter)
        self.periodic = None  # sync="local_sgd" | "diloco" while fitting (lightning_par.dp.local_sgd.PeriodicSync)

    # -- setup ------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        raise NotImplementedError

    def place(self, run: Callable) -> None:
        """``model_to_device``; ``run``: Lightning's."""
        run()

    def install(self) -> None:
        """``configure_ddp`` (DDPStrategy.setup, before the optimizers): what must exist before them."""

    def rank_values(self) -> Rank:
        """Where this rank stands, as the parallelize order reads it (:class:`lightning_par.parallelize.Rank`)."""
        s = self.strategy
        return Rank(device=s.root_device, rank=s.global_rank, world_size=s.world_size, topology=s.topology,
                    precision=s.precision_plugin.precision, owner=type(s).__name__)

    def checkpoint_blocks(self, module: torch.nn.Module, blocks: Optional[str]) -> None:
        """``activation_checkpointing`` on ``module``'s block stacks (``blocks``: the main one's name), taken out at
        teardown (:mod:`lightning_par.memory.checkpointing`)."""
        self.uncheckpoint_blocks()
        self.checkpointed = apply_activation_checkpointing(module, self.options.activation_checkpointing,
                                                           blocks=blocks, owner=type(self.strategy).__name__)

    def take_user_compile(self, module: torch.nn.Module, blocks: Optional[str]) -> None:
        """First thing in setup, before anything reads the module's tree: the user's ``torch.compile`` (of blocks, or
        of the whole module through Lightning) undone, its compiler kept for :meth:`compile_blocks`; and the stack
        ``compile`` needs checked, before any collective ([Note: a module the user compiled] in
        :mod:`lightning_par.compile`)."""
        from lightning.pytorch.utilities.compile import to_uncompiled

        taken = take_user_compile(module)
        if taken.whole_module:
            to_uncompiled(module)  # its forward and *_step methods eager again (the ends stay eager)
        if taken.compiler is not None:
            self.user_compile = taken
            if self.groups.cp is not None:  # as compile= itself (lightning_par.options.check_compile_composes)
                raise ValueError(f"{type(module).__name__} was compiled with torch.compile, which is not composed "
                                 f"with context parallel yet; pass the module uncompiled with "
                                 f"context_parallel_size > 1.")
        if self.user_compile is not None or self.options.stack.compile is not False:
            compile_stacks(module, blocks, what=compile_what(self.options.stack.compile, self.user_compile),
                           owner=type(self.strategy).__name__)

    def compile_blocks(self, module: torch.nn.Module, blocks: Optional[str]) -> None:
        """Step 8 of the parallelize order again, on a later setup of a module the engine keeps (its blocks)."""
        from lightning_par.parallelize import apply_compile

        self.compiled = apply_compile(module, self.options.stack, self.rank_values(), blocks=blocks,
                                      user=self.user_compile)

    def uncompile_blocks(self) -> None:
        """At teardown: the blocks ``compile`` compiled run their eager forward again (a later Trainer applies its own
        setting); blocks compiled with the user's own ``torch.compile`` stay compiled with it."""
        if self.compiled is not None and self.options.stack.compile is not False:
            self.compiled.undo()
        self.compiled = None

    def uncheckpoint_blocks(self) -> None:
        if self.checkpointed is not None:
            self.checkpointed.undo()
            self.checkpointed = None

    def use_replica_average(self, average: Callable) -> None:
        """torchft: gradients are averaged over the live replica groups with ``average`` (called as
        ``average(flat, tensors, last)``, in place: :func:`~lightning_par.tensor.mixed.average_flat_`)."""
        self.replica_average = average

    def on_train_start(self) -> None:
        pass

    # -- steps ------------------------------------------------------------------------------------
    def training_step(self, run: Callable, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def backward(self, run: Callable, closure_loss: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def finish_gradients(self, closure: Callable) -> Callable:
        """The optimizer step's closure followed by whatever settles the gradients (reductions over ranks)."""
        return closure

    def clip_grad_norm(self, optimizer, clip_val: Union[int, float]) -> None:
        raise NotImplementedError

    def eval_step(self, hook: str, run: Callable, context, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    @property
    def last_step_stats(self) -> dict[str, float]:
        return self.runner.last_step_stats if self.runner is not None else {}

    # -- checkpoints (None: the strategy's default) ----------------------------------------------------
    def owns(self, p: torch.nn.Parameter, name: str) -> bool:
        """Whether this rank counts ``p`` (for the global gradient norm and the consolidated state)."""
        return True

    def owned_state(self) -> Optional[dict[str, Any]]:
        return None

    def writes_param(self, param, name: str) -> Optional[bool]:
        return None

    def expected_keys(self) -> Optional[list[str]]:
        return None

    def layout(self) -> dict[str, Any]:
        """The layout a checkpoint records (``lightning-par-checkpoint inspect`` prints it)."""
        topo = self.strategy.topology
        return {"data_parallel_size": topo.data_parallel_size, "pipeline_parallel_size": topo.pipeline_parallel_size,
                "tensor_parallel_size": topo.tensor_parallel_size, "mesh_order": "_".join(topo.order)}

    def wrap_optimizers(self, optimizers: list, schedulers: list) -> tuple[list, list]:
        """``setup_optimizers``: ZeRO-1 over the ``dp`` group ([Note: ZeRO on the core's data axis]) and, with a
        mesh, DTensor and plain parameters stepped apart ([Note: mixed DTensor ...]): the optimizers and the step
        hooks (taken out at teardown)."""
        topo = self.strategy.topology
        if self.options.zero_stage == 1 and topo.data_parallel_size > 1:
            from lightning_par.experts.zero import expert_shards  # [Note: ZeRO-1 with expert parallelism]

            shards = expert_shards(getattr(self, "experts", None), self.strategy.lightning_module, topo,
                                   self.strategy.global_rank)
            optimizers = zero.shard_optimizers(optimizers, schedulers, self.groups.dp, shards)
        if self.groups.mesh is None:
            return optimizers, []
        return optimizers, [split_step_by_kind(zero.local_optimizer(_unwrap(opt))) for opt in optimizers]

    def reshard(self) -> None:
        """After forward-only passes and before checkpoints: the module at rest."""

    def teardown(self) -> None:
        self.stop_periodic_sync()
        self.uncheckpoint_blocks()
        self.uncompile_blocks()
        self.host.lightning_teardown()


def optimizer_params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]
