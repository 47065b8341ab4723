"""Hook wiring of torchft's fault-tolerant replica groups (``fault_tolerance="torchft"``), one implementation for
:class:`~lightning_par.DataParallelStrategy` and the hybrid core (HybridParallelStrategy and its presets); the
work is in :mod:`lightning_par.dp.ft`.

The two differ only in what a replica group is, which :attr:`FaultTolerantReplicas._ft_kind` names:
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


class FaultTolerantReplicas:
    """Mixin before the strategy's Lightning base: ``fault_tolerance`` / ``min_replicas`` / ``ft_timeout``.

    The strategy calls :meth:`_start_replica` once its model is built (DataParallelStrategy: from
    ``_register_ddp_hooks``, on the DDP wrapper; the core: at the end of ``setup``), :meth:`_join_replicas` at
    the end of ``setup`` and :meth:`_stop_replica` at teardown; its ``_sync_options()`` says whether the replicas
    sync every step or periodically ([Note: periodic sync under torchft, one wiring])."""

    _ft_kind = "core"  # what a replica group is: "ddp" or "core" (see the module's docstring)
    _sharing = False  # "core": while dumping this rank's state for a recovering peer

    def _init_fault_tolerance(self, fault_tolerance: str | None, min_replicas: int, ft_timeout: float) -> None:
        self._fault_tolerance, self._min_replicas, self._ft_timeout = fault_tolerance, min_replicas, ft_timeout
        self._replica_group: ft.ReplicaGroup | None = None
        self._replica: ft.Replica | None = None

    @property
    def fault_tolerance(self) -> str | None:
        return self._fault_tolerance

    @property
    def replica(self) -> ft.Replica:
        """This process's fault-tolerant replica (torchft's ``Manager`` at ``replica.manager``)."""
        if self._replica is None:
            raise RuntimeError(f"`replica` exists from Trainer.fit's setup on, with fault_tolerance='torchft' "
                               f"(fault_tolerance={self._fault_tolerance!r}).")
        return self._replica

    @property
    def replica_average(self):
        """Averages a flat gradient in place over the live replica groups; None without fault tolerance."""
        return self._replica.average if self._replica is not None else None

    def _configure_launcher(self) -> None:  # the core, in the launching process: one replica group per job
        if self._fault_tolerance is not None and self._ft_kind == "core" and self._resolve().data_parallel_size != 1:
            raise ValueError(one_replica_per_job(self._resolve().data_parallel_size))
        super()._configure_launcher()

    def setup_environment(self) -> None:
        if self._fault_tolerance is not None:
            ft.import_torchft()
            self._replica_group = ft.ReplicaGroup.from_env()
        super().setup_environment()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._replica_group is None:
            return super().distributed_sampler_kwargs
        return self._replica_group.sampler_kwargs(group_rank=0, group_world_size=1)  # a group's ranks: one batch

    def _loader_processes(self) -> int:
        """Processes reading the training data ([Note: one process keeps the user's loader] in topology.py)."""
        return self.world_size * (self._replica_group.num_groups if self._replica_group is not None else 1)

    def _start_replica(self, trainer) -> bool:
        """This rank's replica, its average wired into the gradients (a DDP communication hook on the wrapped
        model, or the core's engine); False without fault tolerance, or outside fit."""
        if self._fault_tolerance is None or self._replica is not None or trainer.state.fn != TrainerFn.FITTING:
            return False
        self._check_retryable(trainer)
        if self._ft_kind == "ddp":
            if self.world_size != 1:
                raise ValueError(f"`fault_tolerance='torchft'` runs one rank per replica group (this group has "
                                 f"{self.world_size}: devices x num_nodes): launch one torchrun per replica group "
                                 f"with `--nproc-per-node 1` and `trainer.devices=1`; for groups of several ranks "
                                 f"that hold one model between them use "
                                 f"HybridParallelStrategy(fault_tolerance='torchft').")
            resumed = _compat.pending_checkpoint(trainer)  # [Note: a recovering replica resumes from a peer ...]
            shared = dict(state_dict=lambda: _compat.pending_checkpoint(trainer) or self._peer_checkpoint(trainer),
                          step=resumed.get("global_step", 0) if resumed else 0)
        else:  # [Note: a rank's own state for its peer] and [Note: the manager's address, ...] in dp/ft.py
            shared = dict(state_dict=lambda: self._own_state(trainer),
                          group_barrier=lambda: self.barrier("torchft manager address"))
        self._replica = ft.Replica(
            self._replica_group, min_replicas=self._min_replicas, timeout_s=self._ft_timeout,
            group_rank=self.global_rank, group_world_size=self.world_size,
            load_state_dict=lambda checkpoint: _compat.restore_module_and_callbacks(trainer, checkpoint), **shared)
        if not self._per_step_commit():  # [Note: periodic sync under torchft, one wiring]
            self._engine.use_replica_sync(self._replica.sync_average)
        elif self._ft_kind == "ddp":
            self.model.register_comm_hook(self._replica, ft.all_reduce_hook)
        else:
            self._engine.use_replica_average(self._replica.average)  # the engine's average over replicas: torchft's
        return True

    def _per_step_commit(self) -> bool:
        """Whether every step asks a quorum and commits; under local SGD / DiLoCo only their syncs do."""
        return self._sync_options().sync == "every_step"

    def _peer_checkpoint(self, trainer) -> dict[str, Any]:
        """The live state a recovering replica receives (``"ddp"``): what a checkpoint holds."""
        return self._with_sync_state(_compat.dump_checkpoint(trainer))

    def _with_sync_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with this rank's own sync state ([Note: periodic sync under torchft, one wiring])."""
        state = self._engine.sync_state(own=True) if self._engine is not None else None
        return checkpoint if state is None else {**checkpoint, SYNC_KEY: state}

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

    def _join_replicas(self) -> None:
        """The first quorum, at the end of ``setup`` ([Note: a recovering replica resumes from a peer ...])."""
        if self._replica is None:
            return
        if self._replica.join():
            rank_zero_info(f"Replica group {self._replica_group.group_id} received step {self._replica.healed_at} "
                           f"from a live peer.")

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._replica is not None and self._ft_kind == "core":  # a run resumed from a file: Lightning restored
            self._replica.resume_at(self.lightning_module.trainer.global_step)  # its step after the quorum

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._replica is not None and (self._per_step_commit() or self._engine.sync_follows()):
            self._replica.begin_step()  # every step's quorum, or the one of the step whose sync follows

    def _stop_replica(self) -> None:
        if self._replica is not None:
            self._replica.close()
            self._replica = None

    # -- "core": a rank's own state for a recovering peer ([Note: a rank's own state for its peer] in dp/ft.py) ----
    def _own_state(self, trainer) -> dict[str, Any]:
        self._sharing = True
        try:
            checkpoint = _compat.dump_checkpoint(trainer)
        finally:
            self._sharing = False
        checkpoint[ft.SHARE_KEY] = {"group_rank": self.global_rank, "world_size": self.world_size}
        return self._with_sync_state(checkpoint)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._sharing:
            return ft.local_module_state(self.lightning_module)
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self._sharing:
            return ft.local_optimizer_state(_unwrap(optimizer))
        return super().optimizer_state(optimizer)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # healed at the first quorum from a peer past step 0: its state is newer than the file (at step 0 it was only
        # the initial weights: every group of a whole-job restart then resumes from its own file)
        healed = self._replica is not None and bool(self._replica.healed_at)
        received = _compat.pending_checkpoint(self.lightning_module.trainer) if healed else None
        if ft.SHARE_KEY in (received or {}):
            rank_zero_info(f"Replica group {self._replica_group.group_id} resumes from the live peer's state, not "
                           f"{checkpoint_path}.")
            return received
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if ft.SHARE_KEY not in checkpoint:
            return super().load_model_state_dict(checkpoint, strict=strict)
        sender = checkpoint[ft.SHARE_KEY]
        if (sender["group_rank"], sender["world_size"]) != (self.global_rank, self.world_size):
            raise RuntimeError(f"Rank {self.global_rank} of {self.world_size} received the state of rank "
                               f"{sender['group_rank']} of {sender['world_size']}: every replica group must run the "
                               f"same layout.")
        ft.load_local_module_state(self.lightning_module, checkpoint["state_dict"],
                                   where=f"replica group rank {sender['group_rank']}")

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if ft.SHARE_KEY not in checkpoint:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            ft.load_local_optimizer_state(_unwrap(optimizer), saved)
