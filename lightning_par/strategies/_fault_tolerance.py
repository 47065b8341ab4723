"""Hook wiring of fault-tolerant replica groups (torchft) into a ``DDPStrategy`` subclass; the work is in
:mod:`lightning_par.dp.ft`.

[Note: a recovering replica resumes from a peer as from a checkpoint]
The first quorum runs at the end of the strategy's ``setup``, before Lightning restores training state. A
replica that is behind (restarted by torchrun, or any but the first at step 0) receives there the peer's
``dump_checkpoint()`` (module, optimizers, LR schedulers, precision, loops, callbacks: what a ``.ckpt`` holds,
sent over torchft's HTTP transport, never written to disk) and Lightning restores from it exactly as from
``ckpt_path``: ``global_step``, epoch and batch counters continue from the peer's, so the replica's torchft
step and ``trainer.global_step`` agree. A peer serves the state it would save at that moment: the checkpoint
it is itself resuming from while in ``setup`` (a whole job restarted with ``ckpt_path``), else its live state.
The quorum then stays open for the first training batch, which every replica of the quorum runs next.
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par import _compat
from lightning_par.dp import ft


class FaultTolerantReplicas:
    """Mixin before ``DDPStrategy`` in the bases: ``fault_tolerance`` / ``min_replicas`` / ``ft_timeout``."""

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

    def setup_environment(self) -> None:
        if self._fault_tolerance is not None:
            ft.import_torchft()
            self._replica_group = ft.ReplicaGroup.from_env()
        super().setup_environment()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._replica_group is None:
            return super().distributed_sampler_kwargs
        return self._replica_group.sampler_kwargs(self.global_rank, self.world_size)

    def _start_replica(self, trainer) -> bool:
        """Create this rank's replica and register the cross-replica hook on the DDP model (from
        ``_register_ddp_hooks``); False without fault tolerance."""
        if self._fault_tolerance is None:
            return False
        self._check_retryable(trainer)
        if self.world_size != 1:
            raise ValueError(f"`fault_tolerance='torchft'` runs one rank per replica group (this group has "
                             f"{self.world_size}: devices x num_nodes): launch one torchrun per replica group with "
                             f"`--nproc-per-node 1` and `trainer.devices=1`; for groups of several ranks that "
                             f"hold one model between them use HybridParallelStrategy(fault_tolerance='torchft').")
        resumed = _compat.pending_checkpoint(trainer)
        self._replica = ft.Replica(
            self._replica_group, min_replicas=self._min_replicas, timeout_s=self._ft_timeout,
            group_rank=self.global_rank, group_world_size=self.world_size,
            state_dict=lambda: _compat.pending_checkpoint(trainer) or _compat.dump_checkpoint(trainer),
            load_state_dict=lambda checkpoint: _compat.restore_module_and_callbacks(trainer, checkpoint),
            step=resumed.get("global_step", 0) if resumed else 0)
        self.model.register_comm_hook(self._replica, ft.all_reduce_hook)
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

    def _join_replicas(self) -> None:
        """The first quorum, at the end of ``setup`` ([Note: a recovering replica resumes from a peer ...])."""
        if self._replica is None:
            return
        if self._replica.join():
            rank_zero_info(f"Replica group {self._replica_group.group_id} received step {self._replica.healed_at} "
                           f"from a live peer.")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._replica is not None:
            self._replica.begin_step()

    def _stop_replica(self) -> None:
        if self._replica is not None:
            self._replica.close()
            self._replica = None
