"""Hook wiring of torchft's fault-tolerant replica groups (``fault_tolerance="torchft"``), one implementation for
:class:`~lightning_par.DataParallelStrategy` and the hybrid core (HybridParallelStrategy and its presets); the
work is in :mod:`lightning_par.dp.ft`.

The two differ only in what a replica group is, which the ``kind`` of :class:`FaultTolerance` names:
- ``"ddp"`` (DataParallelStrategy): one rank per group holding the whole module; the cross-replica average is a
  DDP communication hook, and a recovering replica receives its peer's checkpoint ([Note: a recovering replica
  resumes from a peer as from a checkpoint]).
- ``"core"`` (the hybrid core): a group of pp x tp ranks; the engine averages over the replicas where it would
  all-reduce over its dp group, and each rank receives the share it holds ([Note: the replica axis under torchft]).

[Note: a recovering replica resumes from a peer as from a checkpoint]
The first quorum runs at the end of the strategy's ``setup``, before Lightning restores training state. A
replica that is behind (restarted by torchrun, or any but the first at step 0) receives there the peer's
``dump_checkpoint()`` (module, optimizers, LR schedulers, precision, loops, callbacks: what a ``.ckpt`` holds,
sent over torchft's HTTP transport, never written to disk) and Lightning restores from it exactly as from
``ckpt_path``: ``global_step``, epoch and batch counters continue from the peer's, so the replica's torchft
step and ``trainer.global_step`` agree. A peer serves the state it would save at that moment: the checkpoint
it is itself resuming from while in ``setup`` (a whole job restarted with ``ckpt_path``), else its live state.
The quorum then stays open for the first training batch, which every replica of the quorum runs next.

[Note: the replica axis under torchft]
Each torchrun job is one replica group holding one whole pipeline × tensor-parallel model (its ranks are its
``pp`` × ``tp`` coordinates; ``data_parallel_size`` inside a job is 1). The core's ordinary process groups (the
stages' point-to-point, the tensor-parallel and shared-parameter groups) stay inside the job; only the average
over replicas, where the core would all-reduce over its dp group (``SharedParameters.reduce`` with several
stages, ``average_grads`` with one), goes through this rank's torchft ``Manager``: every group rank has its own
ring with the same group rank of every live group, i.e. the same (pp, tp) coordinate. A step commits exactly
once, as under DataParallelStrategy ([Note: one step, committed exactly once] in lightning_par.dp.ft);
``should_commit`` agrees across the ranks of a group, so a step lost on one ring is retried by the whole group.
A restarted group's ranks each receive the state of their coordinate from a live group ([Note: a rank's own state
for its peer]); Lightning restores it as a checkpoint ([Note: a recovering replica resumes from a peer as from a
checkpoint]), here after the strategy's setup (the core restores after setup).

[Note: periodic sync under torchft, one wiring]
With ``sync="local_sgd" | "diloco"`` the replica groups meet on torchft's quorum only at syncs ([Note: syncs on
torchft's quorum] in :mod:`lightning_par.dp.local_sgd`), the same on both kinds: no per-step average is wired (no
DDP hook, no engine average), the step that ends a period opens its quorum at its start (every rank of a group
calls it: the sync step is the same on all), and the engine's sync averages over the live groups on each rank's
ring. A recovering rank's peer state holds its peer's own sync state (DiLoCo's synced copy and outer momentum of
that coordinate; no gather: it is served on torchft's quorum thread).

Loss reporting under fault tolerance: [Note: loss reporting, one rule] in :mod:`lightning_par.strategies._engine`.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par import _compat
from lightning_par.dp import ft
from lightning_par.options import one_replica_per_job
from lightning_par.strategies._checkpoint import _unwrap
from lightning_par.strategies._periodic_sync import SYNC_KEY


class FaultTolerance:
    """Owned by the strategy: ``fault_tolerance`` / ``min_replicas`` / ``ft_timeout``.

    The strategy calls :meth:`start` once its model is built (DataParallelStrategy: from ``_register_ddp_hooks``, on
    the DDP wrapper; the core: at the end of ``setup``), :meth:`join` at the end of ``setup`` and :meth:`stop` at
    teardown; ``periodic``: the replicas sync every few steps, not every step ([Note: periodic sync under torchft,
    one wiring]). ``kind``: what a replica group is (``"ddp"`` or ``"core"``, see the module's docstring)."""

    def __init__(self, strategy, kind: str, fault_tolerance: str | None, min_replicas: int, ft_timeout: float, *,
                 periodic: bool = False) -> None:
        self.s, self.kind, self.periodic = strategy, kind, periodic
        self.fault_tolerance, self.min_replicas, self.ft_timeout = fault_tolerance, min_replicas, ft_timeout
        self.group: ft.ReplicaGroup | None = None
        self.replica: ft.Replica | None = None  # this rank's replica (lightning_par.dp.ft.Replica), once joined
        self.sharing = False  # "core": while dumping this rank's state for a recovering peer

    def check_launch(self, topology) -> None:
        """In the launching process: the core runs one replica group per job."""
        if self.fault_tolerance is not None and self.kind == "core" and topology.data_parallel_size != 1:
            raise ValueError(one_replica_per_job(topology.data_parallel_size))

    def setup_environment(self) -> None:
        if self.fault_tolerance is not None:
            ft.import_torchft()
            self.group = ft.ReplicaGroup.from_env()

    def sampler_kwargs(self) -> Optional[dict[str, Any]]:
        """A group's ranks read one batch: the replica groups split the data (None without fault tolerance)."""
        return self.group.sampler_kwargs(group_rank=0, group_world_size=1) if self.group is not None else None

    def loader_processes(self) -> int:
        """Processes reading the training data ([Note: one process keeps the user's loader] in topology.py)."""
        return self.s.world_size * (self.group.num_groups if self.group is not None else 1)

    def per_step_commit(self) -> bool:
        """Whether every step asks a quorum and commits; under local SGD / DiLoCo only their syncs do."""
        return not self.periodic

    def start(self, trainer, engine) -> bool:
        """This rank's replica, its average wired into the gradients (a DDP communication hook on the wrapped
        model, or the core's ``engine``); False without fault tolerance, or outside fit."""
        if self.fault_tolerance is None or self.replica is not None or trainer.state.fn != TrainerFn.FITTING:
            return False
        s = self.s
        self._check_retryable(trainer)
        if self.kind == "ddp":
            if s.world_size != 1:
                raise ValueError(f"`fault_tolerance='torchft'` runs one rank per replica group (this group has "
                                 f"{s.world_size}: devices x num_nodes): launch one torchrun per replica group "
                                 f"with `--nproc-per-node 1` and `trainer.devices=1`; for groups of several ranks "
                                 f"that hold one model between them use "
                                 f"HybridParallelStrategy(fault_tolerance='torchft').")
            resumed = _compat.pending_checkpoint(trainer)  # [Note: a recovering replica resumes from a peer ...]
            shared = dict(state_dict=lambda: (_compat.pending_checkpoint(trainer)
                                              or _with_sync_state(_compat.dump_checkpoint(trainer), engine)),
                          step=resumed.get("global_step", 0) if resumed else 0)
        else:  # [Note: a rank's own state for its peer] and [Note: the manager's address, ...] in dp/ft.py
            shared = dict(state_dict=lambda: self.own_state(trainer, engine),
                          group_barrier=lambda: s.barrier("torchft manager address"))
        self.replica = ft.Replica(
            self.group, min_replicas=self.min_replicas, timeout_s=self.ft_timeout,
            group_rank=s.global_rank, group_world_size=s.world_size,
            load_state_dict=lambda checkpoint: _compat.restore_module_and_callbacks(trainer, checkpoint), **shared)
        if not self.per_step_commit():  # [Note: periodic sync under torchft, one wiring]
            engine.use_replica_sync(self.replica.sync_average)
        elif self.kind == "ddp":
            s.model.register_comm_hook(self.replica, ft.all_reduce_hook)
        else:
            engine.use_replica_average(self.replica.average)  # the engine's average over replicas: torchft's
        return True

    def _check_retryable(self, trainer) -> None:
        """Refuse what a step retried by running its batch again cannot reproduce."""
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise ValueError(f"`fault_tolerance='torchft'` supports automatic optimization only: "
                             f"{type(module).__name__} sets `automatic_optimization = False`, and a step that loses a "
                             f"peer is retried by running the batch again ([Note: one step, committed exactly once] "
                             f"in lightning_par.dp.ft).")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(f"`fault_tolerance='torchft'` does not support `accumulate_grad_batches="
                             f"{trainer.accumulate_grad_batches}`: a step that loses a peer is retried by running its "
                             f"last batch again, and the earlier batches' gradients are gone by then. Use 1 (and a "
                             f"larger batch).")

    def join(self) -> None:
        """The first quorum, at the end of ``setup`` ([Note: a recovering replica resumes from a peer ...])."""
        if self.replica is None:
            return
        if self.replica.join():
            rank_zero_info(f"Replica group {self.group.group_id} received step {self.replica.healed_at} "
                           f"from a live peer.")

    def on_train_start(self) -> None:
        if self.replica is not None and self.kind == "core":  # a run resumed from a file: Lightning restored
            self.replica.resume_at(self.s.lightning_module.trainer.global_step)  # its step after the quorum

    def on_train_batch_start(self, engine) -> None:
        if self.replica is not None and (self.per_step_commit() or engine.sync_follows()):
            self.replica.begin_step()  # every step's quorum, or the one of the step whose sync follows

    def stop(self) -> None:
        if self.replica is not None:
            self.replica.close()
            self.replica = None

    # -- "core": a rank's own state for a recovering peer ([Note: a rank's own state for its peer] in dp/ft.py) ----
    def own_state(self, trainer, engine) -> dict[str, Any]:
        self.sharing = True  # the strategy's state hooks answer with this rank's own tensors meanwhile
        try:
            checkpoint = _compat.dump_checkpoint(trainer)
        finally:
            self.sharing = False
        checkpoint[ft.SHARE_KEY] = {"group_rank": self.s.global_rank, "world_size": self.s.world_size}
        return _with_sync_state(checkpoint, engine)

    def received(self, checkpoint_path) -> Optional[dict[str, Any]]:
        """The live peer's state when the first quorum healed this replica past step 0 (its state is newer than the
        file; at step 0 it was only the initial weights: every group of a whole-job restart then resumes from its
        own file); None otherwise."""
        healed = self.replica is not None and bool(self.replica.healed_at)
        received = _compat.pending_checkpoint(self.s.lightning_module.trainer) if healed else None
        if ft.SHARE_KEY not in (received or {}):
            return None
        rank_zero_info(f"Replica group {self.group.group_id} resumes from the live peer's state, not "
                       f"{checkpoint_path}.")
        return received

    def load_model_state_dict(self, checkpoint) -> bool:
        """A peer's own state into this rank's (True), or False: a checkpoint, not a peer's share."""
        if ft.SHARE_KEY not in checkpoint:
            return False
        s, sender = self.s, checkpoint[ft.SHARE_KEY]
        if (sender["group_rank"], sender["world_size"]) != (s.global_rank, s.world_size):
            raise RuntimeError(f"Rank {s.global_rank} of {s.world_size} received the state of rank "
                               f"{sender['group_rank']} of {sender['world_size']}: every replica group must run the "
                               f"same layout.")
        ft.load_local_module_state(s.lightning_module, checkpoint["state_dict"],
                                   where=f"replica group rank {sender['group_rank']}")
        return True

    def load_optimizer_state_dict(self, checkpoint) -> bool:
        if ft.SHARE_KEY not in checkpoint:
            return False
        for optimizer, saved in zip(self.s.optimizers, checkpoint["optimizer_states"], strict=True):
            ft.load_local_optimizer_state(_unwrap(optimizer), saved)
        return True


def _with_sync_state(checkpoint: dict[str, Any], engine) -> dict[str, Any]:
    """``checkpoint`` with this rank's own sync state ([Note: periodic sync under torchft, one wiring])."""
    state = engine.sync_state(own=True) if engine is not None else None
    return checkpoint if state is None else {**checkpoint, SYNC_KEY: state}
