"""Hook wiring of torchft's replica groups into the hybrid core (HybridParallelStrategy and its presets): the
data-parallel axis is the set of live replica groups, as in torchft's HSDP; the work is in :mod:`lightning_par.dp.ft`.

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
checkpoint] in _fault_tolerance.py), here after the strategy's setup (the core restores after setup).

Loss reporting under fault tolerance is per replica group: rank 0 of each group returns and logs the mean over
that group's own batch (the core's rule with ``data_parallel_size=1``), as DataParallelStrategy is rank-local; the
live groups are known only to torchft and change from step to step.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par import _compat
from lightning_par.dp import ft
from lightning_par.options import one_replica_per_job
from lightning_par.strategies._checkpoint import _unwrap
from lightning_par.strategies._fault_tolerance import FaultTolerantReplicas


class FaultTolerantCore(FaultTolerantReplicas):
    """Mixin before the layout base of :class:`~lightning_par.HybridParallelStrategy` (``fault_tolerance``,
    ``min_replicas``, ``ft_timeout``); see [Note: the replica axis under torchft]."""

    _sharing = False  # while dumping this rank's state for a recovering peer

    @property
    def replica_average(self):
        """Averages a flat gradient in place over the live replica groups; None without fault tolerance."""
        return self._replica.average if self._replica is not None else None

    def _configure_launcher(self) -> None:
        if self._fault_tolerance is not None and self._resolve().data_parallel_size != 1:
            raise ValueError(one_replica_per_job(self._resolve().data_parallel_size))
        super()._configure_launcher()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._replica_group is None:
            return super().distributed_sampler_kwargs
        return self._replica_group.sampler_kwargs(group_rank=0, group_world_size=1)  # a group's ranks: one batch

    def _loader_processes(self) -> int:
        """Processes reading the training data ([Note: one process keeps the user's loader] in topology.py)."""
        return self.world_size * (self._replica_group.num_groups if self._replica_group is not None else 1)

    def _join_as_replica(self, trainer) -> None:
        """This rank's replica, its average in the core's gradient path, and the first quorum (end of ``setup``)."""
        if self._fault_tolerance is None or self._replica is not None or trainer.state.fn != TrainerFn.FITTING:
            return
        self._check_retryable(trainer)
        self._replica = ft.Replica(
            self._replica_group, min_replicas=self._min_replicas, timeout_s=self._ft_timeout,
            group_rank=self.global_rank, group_world_size=self.world_size,
            state_dict=lambda: self._own_state(trainer),
            load_state_dict=lambda checkpoint: _compat.restore_module_and_callbacks(trainer, checkpoint),
            group_barrier=lambda: self.barrier("torchft manager address"))  # [Note: the manager's address, ...]
        self._engine.use_replica_average(self._replica.average)  # the engine's average over replicas: torchft's
        self._join_replicas()

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._replica is not None:  # a run resumed from a file: Lightning restored its step after the quorum
            self._replica.resume_at(self.lightning_module.trainer.global_step)

    # -- a rank's own state for a recovering peer ([Note: a rank's own state for its peer] in dp/ft.py) ----------
    def _own_state(self, trainer) -> dict[str, Any]:
        self._sharing = True
        try:
            checkpoint = _compat.dump_checkpoint(trainer)
        finally:
            self._sharing = False
        checkpoint[ft.SHARE_KEY] = {"group_rank": self.global_rank, "world_size": self.world_size}
        return checkpoint

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
