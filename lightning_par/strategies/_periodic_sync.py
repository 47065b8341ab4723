"""Every engine's ``sync="local_sgd" | "diloco"`` hooks (:class:`PeriodicSyncHooks`, a base of
:class:`~lightning_par.strategies._engine.Engine`): the work is :class:`lightning_par.dp.local_sgd.PeriodicSync`'s.

[Note: periodic sync on the data axis]
Under ``sync="local_sgd" | "diloco"`` the replicas of the ``dp`` axis never average gradients: the replica engine
does not wrap the module in DDP ([Note: replicas without DDP between syncs] in
:mod:`~lightning_par.strategies._replica_engine`), the SPMD engine skips its replicas' gradient average and the
pipeline engine builds its shared-parameter reduction without the ``dp`` group. Everything inside a replica stays
as it is: tensor-parallel partial sums, the stages' shared parameters, context parallelism's mean, clipping on the
replica's own gradients. After every optimizer step (taken or skipped, inside Lightning's optimizer step:
:meth:`~lightning_par.HybridParallelStrategy.optimizer_step`) :class:`~lightning_par.dp.local_sgd.PeriodicSync`
counts it and at every ``sync_every``-th averages this rank's tensors with its ``dp`` peers only, the ranks of the
same (pp, cp, tp) coordinates holding the same shards: the local shard of a DTensor parameter, the stage's own
parameters of a pipeline (a parameter left on the meta device is not this stage's and is skipped). A checkpoint
holds every rank's own parameters, inner optimizer tensors and sync state (DiLoCo's synced copy and outer
momentum of its coordinates) on global rank 0 under the layout it was saved with; a resume needs that layout and
is exact at any step, between syncs too. Under ``fault_tolerance="torchft"`` a recovering replica group's rank
receives, with its peer's state, that peer's own sync state alone (:meth:`PeriodicSyncHooks.sync_state` with
``own=True``: no collective, torchft's quorum thread serves it), the rank of the same coordinates of a live group
([Note: a rank's own state for its peer] in :mod:`lightning_par.dp.ft`); it holds the same tensors as a file's.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_par.dp import local_sgd
from lightning_par.strategies._checkpoint import _unwrap

SYNC_KEY = "lightning_par_sync"  # the checkpoint entry of sync="local_sgd" | "diloco"


class PeriodicSyncHooks:
    """Mixed into :class:`~lightning_par.strategies._engine.Engine` (``self.strategy``, ``self.options``,
    ``self.groups``; ``self.periodic``: the sync while fitting)."""

    periodic: Optional[local_sgd.PeriodicSync] = None
    stack_path: Optional[str] = None  # the block stack the engine found (a pipeline's stages hold part of it)

    @property
    def syncs_periodically(self) -> bool:
        """``sync="local_sgd" | "diloco"``: no gradient average over the replicas."""
        return self.options.sync.sync != "every_step"

    def start_periodic_sync(self, trainer) -> None:
        """While fitting with ``sync="local_sgd" | "diloco"``, once the optimizers exist: the sync of this rank's
        share of the optimizer's parameters with its ``dp`` peers (streaming DiLoCo: the fragments of the
        LightningModule's block stack)."""
        self.stop_periodic_sync()
        if not self.syncs_periodically or trainer.state.fn != TrainerFn.FITTING:
            return
        s, sync = self.strategy, self.options.sync
        if len(s.optimizers) != 1:
            raise ValueError(f"`sync={sync.sync!r}` counts the steps of one optimizer: `configure_optimizers` of "
                             f"{type(s.lightning_module).__name__} returns {len(s.optimizers)}. Return one, or use "
                             f"sync='every_step'.")
        params = [p for group in _unwrap(s.optimizers[0]).param_groups for p in group["params"]]
        params = [p for p in dict.fromkeys(params) if not p.is_meta]  # a tied parameter once; this stage's own
        fragments = owners = None
        if sync.fragments > 1:  # [Note: streaming DiLoCo] in lightning_par.dp.local_sgd
            fragments, owners = local_sgd.block_fragments(s.lightning_module, params, sync.fragments,
                                                          blocks=self.stack_path or self.options.blocks)
        self.periodic = local_sgd.PeriodicSync(params, sync=sync.sync, every=sync.sync_every, outer_lr=sync.outer_lr,
                                               outer_momentum=sync.outer_momentum, group=self.groups.dp,
                                               replicas=s.topology.data_parallel_size, owners=owners,
                                               fragments=fragments)

    def stop_periodic_sync(self) -> None:
        """Teardown (and a new start): a sync in flight finished, the hooks taken out, the sync dropped."""
        if self.periodic is not None:
            self.periodic.close()
        self.periodic = None

    def after_step(self) -> None:
        """After every optimizer step (taken or skipped): the periodic sync counts it (and syncs every H-th)."""
        if self.periodic is not None:
            self.periodic.step()

    def sync_follows(self) -> bool:
        """Whether this step ends with a sync (its optimizer step is the ``sync_every``-th)."""
        return self.periodic is not None and self.periodic.since == self.periodic.every - 1

    def use_replica_sync(self, reduce: Callable) -> None:
        """torchft: syncs average over the live replica groups and commit (``reduce(tensors) -> committed``)."""
        self.periodic.reduce = reduce

    def sync_state(self, own: bool = False) -> Optional[dict[str, Any]]:
        """The sync state for a checkpoint (every rank calls it: a gather): the step count, the layout and, on
        global rank 0, every rank's own state (``ranks``: its parameters, its inner optimizer's tensors, its sync
        state); None without a periodic sync. ``own=True``: this rank's own state alone (``rank``, ``own``), no
        collective: what a recovering peer of its coordinates receives under torchft."""
        if self.periodic is None:
            return None
        s = self.strategy
        mine = self.periodic.state_dict()
        local = {"params": [p.detach() for p in self.periodic.params], "sync": mine,
                 "inner": local_sgd.optimizer_tensors(_unwrap(s.optimizers[0]))}
        state = {"sync": mine["sync"], "every": mine["every"], "since": mine["since"], "layout": _layout(s)}
        if own:
            return {**state, "rank": s.global_rank, "own": local_sgd.rank_state(local)}
        return {**state, "ranks": local_sgd.rank_states(local)}

    def load_sync_state(self, state: Optional[dict[str, Any]], where: str) -> None:
        """After Lightning restored the module (the first replica's) and the optimizer: this rank's own state (from
        a file's ``ranks``, or a live peer's ``own``)."""
        if self.periodic is None:
            return
        if state is None:  # saved under sync="every_step": the replicas start equal, from the checkpoint's weights
            self.periodic.restart()
            return
        s, saved = self.strategy, state.get("layout")
        if "own" in state:  # a peer's ([Note: a rank's own state for its peer] in lightning_par.dp.ft)
            if state["rank"] != s.global_rank or saved != _layout(s):
                raise ValueError(f"{where} holds rank {state['rank']}'s sync={state['sync']!r} state of the layout "
                                 f"{saved}; this is rank {s.global_rank} of {_layout(s)}. Every replica group must "
                                 f"run the same layout.")
            mine = state["own"]
        else:
            ranks = state["ranks"]
            if len(ranks) != s.world_size or (saved is not None and saved != _layout(s)):
                raise ValueError(f"{where} holds the replicas of a {len(ranks)}-rank sync={state['sync']!r} run; "
                                 f"this run has {s.world_size} ranks (saved layout {saved}, this run's "
                                 f"{_layout(s)}). Resume with the saved layout: each rank resumes its own replica.")
            mine = ranks[s.global_rank]
        with torch.no_grad():
            for p, t in zip(self.periodic.params, mine["params"], strict=True):
                p.copy_(t)
        local_sgd.load_optimizer_tensors(_unwrap(s.optimizers[0]), mine["inner"], where=where)
        self.periodic.load_state_dict(mine["sync"], where=where)


def _layout(strategy) -> dict[str, int]:
    topo = strategy.topology
    return {"world_size": strategy.world_size, "pipeline_parallel_size": topo.pipeline_parallel_size,
            "data_parallel_size": topo.data_parallel_size, "tensor_parallel_size": topo.tensor_parallel_size,
            "context_parallel_size": topo.context_parallel_size}
