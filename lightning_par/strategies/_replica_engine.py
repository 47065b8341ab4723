"""The core's replica engine: the whole module on every rank of the ``dp`` axis (pp = tp = 1), the engine of
:class:`~lightning_par.DataParallelStrategy` (the interface: [Note: engines behind one interface] in
:mod:`~lightning_par.strategies._engine`). The replica implementation is chosen by ``zero_stage``:

- 0 and 1: Lightning's ``DDPStrategy.setup`` as it is (``DistributedDataParallel`` with the strategy's comm hook,
  ``static_graph`` and bucket options; ZeRO-1 wraps the optimizers), so that with the defaults the run *is*
  Lightning's DDP, bit for bit;
- 2 and 3: FSDP2 over the ``dp`` mesh axis (:mod:`lightning_par.dp.fsdp`), in every trainer function (a model
  that only fits sharded must validate sharded too), where Lightning's ``ModelParallelStrategy`` leaves it to the
  user's ``configure_model``.

[Note: zero_stage 2 and 3 on the replica engine]
The module itself is the root FSDP unit (it stays usable after fit: its forward gathers what it needs), so
``strategy.model is strategy.lightning_module``; each ``*_step`` runs inside the module's own ``__call__``
(Lightning's forward redirection, as DDP's wrapper does), so that FSDP's root hooks gather the root's parameters
even when the step never calls ``self(...)`` ([Note: running a step through the root unit] in
:mod:`lightning_par.dp.fsdp`). Checkpoints are restored after setup, into the shards.

Steps run as Lightning runs them and report rank-local values ([Note: loss reporting, one rule] in
:mod:`~lightning_par.strategies._engine`): the replicas' average is DDP's or FSDP's, inside backward.

[Note: replicas without DDP between syncs]
Under ``sync="local_sgd" | "diloco"`` (zero stage 0) the module is not wrapped in ``DistributedDataParallel`` at
all: DDP would all-reduce every step's gradients (``no_sync`` skips that, but its forward still broadcasts the
buffers), and between syncs each replica must train on its own gradients alone. The replicas start from rank 0's
parameters and buffers (broadcast once, as DDP's constructor does); every optimizer step is counted and every
``sync_every``-th ends with :class:`~lightning_par.dp.local_sgd.PeriodicSync`'s sync, inside Lightning's optimizer
step, so the hooks that follow it (``on_train_batch_end``, logging, a validation or checkpoint at that step) see
the synced model; at other steps they see this rank's own. Buffers (BatchNorm statistics) stay rank-local after
the start, as under torchft's LocalSGD. A checkpoint holds the sync state and every rank's own parameters and
inner optimizer state ([Note: periodic sync on the data axis] in
:mod:`~lightning_par.strategies._periodic_sync`), so a run resumes exactly at any step.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from lightning_par._compat import optimizers_to_device
from lightning_par.dp import fsdp, zero
from lightning_par.materialize import move_real
from lightning_par.parallelize import parallelize_replicas
from lightning_par.strategies._engine import Engine
from lightning_par.strategies._materialize import teardown_in_place
from lightning_par.tensor.parallelize import broadcast_state


class ReplicaEngine(Engine):
    """The hooks of a :class:`~lightning_par.DataParallelStrategy` (``strategy``)."""

    def __init__(self, strategy, options, groups, host):
        super().__init__(strategy, options, groups, host)
        self.s = strategy  # its public Lightning attributes only
        self.units: Optional[list[str]] = None  # zero_stage 2 / 3: the FSDP units, once sharded
        self.steps: Optional[fsdp.StepRunner] = None  # zero_stage 2 / 3: runs each step through the root unit

    # -- setup ------------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        self.take_user_compile(self.s.lightning_module, self.options.blocks)  # before anything reads the tree
        if self.options.zero_stage < 2:  # the order's steps 4 to 8, then DDPStrategy.setup
            self.uncheckpoint_blocks()
            made = parallelize_replicas(self.s.lightning_module, self.options, self.groups, self.rank_values(),
                                        user_compile=self.user_compile)
            self.checkpointed, self.compiled = made.checkpointed, made.compiled
            self.host.lightning_setup(trainer)  # DDPStrategy.setup: place, wrap in DDP, optimizers
            self.start_periodic_sync(trainer)  # sync="local_sgd" | "diloco" while fitting
            return
        # As DDPStrategy.setup, with FSDP in place of DDP in every trainer function ([Note: zero_stage 2 and 3 ...]).
        s = self.s
        s.accelerator.setup(trainer)
        module = s.lightning_module
        sharded = fsdp.is_sharded(module)  # a later fit / validate of the same module
        reader = None if sharded else self.host.open_weights(module)  # checked before anything is placed
        if not sharded:
            s.precision_plugin.convert_module(module)
            move_real(module, s.root_device)  # a meta-built module gets its shards' storage below
        self.uncheckpoint_blocks()
        made = parallelize_replicas(module, self.options, self.groups, self.rank_values(), place=self.host.place_share,
                                    reader=reader, fresh=not sharded,  # each rank's FSDP shards: storage, init, weights=
                                    user_compile=self.user_compile)
        self.checkpointed, self.units, self.compiled = made.checkpointed, made.units, made.compiled
        self.steps = fsdp.StepRunner(module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            s.setup_optimizers(trainer)
        s.setup_precision_plugin()
        if fitting:
            optimizers_to_device(s.optimizers, s.root_device)

    def place(self, run) -> None:
        """DDPStrategy.setup's ``model_to_device``: a meta-built module's storage, ``weights=``."""
        s = self.s
        move_real(s.model, s.root_device)
        self.host.place_share(s.model, self.host.open_weights(s.model))

    def install(self) -> None:
        if not self.syncs_periodically:
            return self.host.lightning_configure_ddp()  # DDP with the strategy's options and comm hook
        if dist.is_initialized():  # no DDP wrapper: rank 0's start, coalesced as DDP's constructor broadcasts it
            broadcast_state(self.s.model, src=0)

    # -- steps: Lightning's, through FSDP's root unit once sharded ---------------------------------------
    def training_step(self, run, args: tuple, kwargs: dict) -> Any:
        return self.eval_step("training_step", run, self.s.precision_plugin.train_step_context, args, kwargs)

    def eval_step(self, hook: str, run, context, args: tuple, kwargs: dict) -> Any:
        if self.steps is None:
            return run()
        with context():
            return self.steps.run(hook, self.host.forward_redirection, *args, **(kwargs or {}))

    def backward(self, run, closure_loss) -> Any:
        return run()

    def clip_grad_norm(self, optimizer, clip_val) -> None:
        self.s.precision_plugin.clip_grad_by_norm(optimizer, clip_val)  # Lightning's clipping, as DDP's

    def wrap_optimizers(self, optimizers: list, schedulers: list) -> tuple[list, list]:
        """ZeRO-1 over every rank ([Note: wrapping the user's optimizer] in lightning_par.dp.zero); no step hooks."""
        if self.options.zero_stage == 1:
            optimizers = zero.shard_optimizers(optimizers, schedulers)
        return optimizers, []

    def layout(self) -> dict[str, Any]:  # the replicas' layout, without the core's pp / tp axes
        return {"data_parallel_size": self.s.world_size, "zero_stage": self.options.zero_stage}

    # -- checkpoints and teardown -------------------------------------------------------------------
    def reshard(self) -> None:
        if self.units is not None:  # forward-only passes leave some units gathered: back to the shards
            fsdp.reshard(self.s.lightning_module)

    def teardown(self) -> None:
        self.uncheckpoint_blocks()
        self.uncompile_blocks()
        self.stop_periodic_sync()
        if self.steps is None:
            return self.host.lightning_teardown()
        self.steps.close()
        self.units = self.steps = None
        teardown_in_place(self.s)  # the sharded module stays where it is
