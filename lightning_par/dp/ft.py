"""Fault-tolerant data parallelism with torchft: replica groups that drop out of a step and rejoin live.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 2000 &                 # one per job
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://HOST:29510 \
        torchrun --max-restarts 3 --nproc-per-node 1 --master-port 29600 train.py   # one per replica group

Each replica group is its own torchrun job (its own ``MASTER_ADDR:MASTER_PORT``, restarted alone by
``--max-restarts``); torchft's ``Manager`` asks the lighthouse, before every optimizer step, which groups are
alive (the *quorum*), reconfigures a gloo process group over them and averages the gradients over the live
ones. Nothing here knows Lightning: the strategy (:mod:`lightning_par.strategies._fault_tolerance`) hands
:class:`Replica` two functions, the state to send a peer and how to take a peer's state.

[Note: one step, committed exactly once]
torchft's own loop drops a batch whose gradient all-reduce lost a peer (``should_commit`` is False, the
optimizer is not stepped, its step counter does not move) and takes the next one. Lightning would count that
batch as a step all the same (``global_step``, LR schedulers, ``max_steps``), and the replica's step and
Lightning's would drift apart. :meth:`Replica.finish_step` instead asks a new quorum (without the lost peer)
and runs the same batch's forward and backward again, until the step commits: every Lightning optimizer step
is exactly one committed torchft step, on every replica, so ``trainer.global_step == manager.current_step()``
always. The price: a retried batch runs ``training_step`` twice, and what it logs ``on_epoch`` counts twice.

[Note: the manager's address, once per attempt]
With several ranks per replica group, group rank 0 starts torchft's ``ManagerServer`` and publishes its address
in the group's store (torchrun's, ``MASTER_ADDR:MASTER_PORT``); the other ranks read it there. torchrun keeps that
store across its restarts, so after a restart the other ranks could read the address of the dead attempt's
server. They read it only after a barrier over the group (this attempt's process group) that rank 0 reaches once
its new server is published.

[Note: a rank's own state for its peer]
Under a layout strategy (pipeline and tensor parallel inside a replica group) a rank holds one stage's share of
the module, and a checkpoint would gather the shares over the group, a collective that a replica serving its
state on torchft's quorum thread cannot run. Each rank therefore sends only what it holds itself: its module
state and optimizer state as they are in memory (DTensors as local shards, in the optimizer's own numbering),
with Lightning's loops, callbacks, schedulers and precision state around them, under ``SHARE_KEY``. torchft
sends a recovering rank the state of the rank with the same group rank in a live group, and group ranks lay out
the same (pp, tp) coordinates in every group, so each rank receives exactly the share it holds.

[Note: forcing DDP's unused-parameter search]
The cross-replica all-reduce is a DDP communication hook, called per gradient bucket: the buckets of every
replica must hold the same parameters in the same order. DDP rebuilds its buckets after the first step (in
the order gradients arrived), so a replica restarted mid-run would bucket differently from a survivor that
rebuilt long ago. DDP never rebuilds with ``find_unused_parameters=True`` (and ``static_graph=False``); as
torchft's own ``DistributedDataParallel`` does, the strategy sets it, at the cost of one graph traversal a step.
"""
from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

FAULT_TOLERANCE = (None, "torchft")
ENV_VARS = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE")
LAUNCH = ("start `torchft_lighthouse --min_replicas 1` once, then one torchrun per replica group with "
          "REPLICA_GROUP_ID=<0..n-1> NUM_REPLICA_GROUPS=<n> TORCHFT_LIGHTHOUSE=http://<lighthouse host>:29510 "
          "(scripts/launch_fault_tolerant.sh does both)")


def validate_fault_tolerance(fault_tolerance: Optional[str], min_replicas: int, ft_timeout: float, *,
                             zero_stage: int, comm_hook: Optional[str], static_graph: bool, lr_scaling: str) -> None:
    """Refuse what the fault-tolerant replicas cannot do, before any process exists.

    Example:
        >>> validate_fault_tolerance("torchft", 1, 60.0, zero_stage=0, comm_hook=None, static_graph=False,
        ...                          lr_scaling="none")
        >>> validate_fault_tolerance("torchelastic", 1, 60.0, zero_stage=0, comm_hook=None,
        ...                          static_graph=False, lr_scaling="none")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: `fault_tolerance='torchelastic'` must be None (off) or 'torchft' ...
    """
    if fault_tolerance not in FAULT_TOLERANCE:
        raise ValueError(f"`fault_tolerance={fault_tolerance!r}` must be None (off) or 'torchft' (per-step fault "
                         f"tolerance: replica groups drop out and rejoin from a live peer).")
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(f"`min_replicas={min_replicas!r}` must be an integer >= 1: the fewest replica groups a "
                         f"step may commit with (1 lets a lone survivor train on).")
    if isinstance(ft_timeout, bool) or not isinstance(ft_timeout, (int, float)) or not math.isfinite(ft_timeout) \
            or ft_timeout <= 0:
        raise ValueError(f"`ft_timeout={ft_timeout!r}` must be a finite positive number of seconds: how long a "
                         f"replica waits for a quorum, a peer's all-reduce or its state before giving up.")
    if fault_tolerance is None:
        return
    refusals = {
        "zero_stage": (zero_stage != 0, zero_stage,
                       "a recovering replica receives the whole optimizer state from one peer while that peer "
                       "waits for the quorum; ZeRO would first gather the shards with a collective, and FSDP "
                       "(stages 2, 3) reduces gradients outside DDP's hook, where the cross-replica average lives. "
                       "Use zero_stage=0"),
        "comm_hook": (comm_hook is not None, comm_hook,
                      "the cross-replica all-reduce is itself DDP's communication hook (torchft's Manager); "
                      "compressing hooks are not composed with it. Use comm_hook=None"),
        "static_graph": (static_graph, static_graph,
                         "DDP rebuilds its gradient buckets with a static graph, and a restarted replica's buckets "
                         "must match the survivors' ([Note: forcing DDP's unused-parameter search] in "
                         "lightning_par.dp.ft). Use static_graph=False"),
        "lr_scaling": (lr_scaling != "none", lr_scaling,
                       "the number of live replicas changes from step to step, so there is no fixed global batch "
                       "to scale by. Use lr_scaling='none' and set the learning rate for your global batch"),
    }
    for name, (refused, value, why) in refusals.items():
        if refused:
            raise ValueError(f"`fault_tolerance='torchft'` does not support `{name}={value!r}`: {why}.")


def import_torchft():
    try:
        import torchft
    except ImportError as err:  # the `ft` extra
        raise ImportError("`fault_tolerance='torchft'` needs torchft: `pip install 'lightning-par[ft]'` "
                          "(or `pip install torchft`).") from err
    return torchft


@dataclass(frozen=True)
class ReplicaGroup:
    """Which replica group this job is, of how many, and where the lighthouse is (torchft's variables).

    Example:
        >>> g = ReplicaGroup.from_env({"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2",
        ...                            "TORCHFT_LIGHTHOUSE": "http://localhost:29510"})
        >>> g.sampler_kwargs(group_rank=0, group_world_size=1)   # group 1's share of the data
        {'num_replicas': 2, 'rank': 1}
        >>> g.sampler_kwargs(group_rank=1, group_world_size=2)
        {'num_replicas': 4, 'rank': 3}
    """

    group_id: int
    num_groups: int
    lighthouse: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ReplicaGroup":
        missing = [name for name in ENV_VARS if not environ.get(name)]
        if missing:
            raise RuntimeError(f"`fault_tolerance='torchft'` needs the environment variables {', '.join(missing)} "
                               f"(not set): {LAUNCH}.")
        try:
            group_id, num_groups = int(environ["REPLICA_GROUP_ID"]), int(environ["NUM_REPLICA_GROUPS"])
        except ValueError:
            raise RuntimeError(f"REPLICA_GROUP_ID={environ['REPLICA_GROUP_ID']!r} and NUM_REPLICA_GROUPS="
                               f"{environ['NUM_REPLICA_GROUPS']!r} must be integers: {LAUNCH}.") from None
        if not 0 <= group_id < num_groups:
            raise RuntimeError(f"REPLICA_GROUP_ID={group_id} must be in 0..NUM_REPLICA_GROUPS-1 "
                               f"(NUM_REPLICA_GROUPS={num_groups}).")
        return cls(group_id, num_groups, environ["TORCHFT_LIGHTHOUSE"])

    @property
    def replica_id(self) -> str:
        return f"lightning_par_replica_group_{self.group_id}"  # torchft reads the trailing digits

    def sampler_kwargs(self, group_rank: int, group_world_size: int) -> dict[str, int]:
        """Every rank of every group reads its own share of the data; a lost group's share is skipped while
        it is away (torchft's ``DistributedSampler`` does the same)."""
        return {"num_replicas": self.num_groups * group_world_size,
                "rank": self.group_id * group_world_size + group_rank}


SHARE_KEY = "lightning_par_ft_share"  # marks a peer's rank-local state: [Note: a rank's own state for its peer]


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def local_module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with each DTensor as this rank's local shard; what is on the meta device (another
    rank's share) left out. The tensors are the module's own (no copy)."""
    return {k: _local(v) for k, v in module.state_dict().items()
            if not (isinstance(v, torch.Tensor) and v.is_meta)}


def load_local_module_state(module: torch.nn.Module, saved: Mapping[str, Any], *, where: str) -> None:
    """Copy a peer's :func:`local_module_state` into ``module``'s own tensors, in place."""
    mine = local_module_state(module)
    if sorted(mine) != sorted(saved) or any(tuple(mine[k].shape) != tuple(saved[k].shape) for k in mine):
        differ = sorted(set(mine) ^ set(saved)) or [k for k in mine if tuple(mine[k].shape) != tuple(saved[k].shape)]
        raise RuntimeError(f"The state {where} sent does not fit this rank's share of {type(module).__name__}: "
                           f"{differ[:5]} differ. Every replica group must run the same module and layout.")
    with torch.no_grad():
        for k, t in mine.items():
            t.copy_(saved[k])


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` (its own numbering) with DTensor state as local shards."""
    sd = optimizer.state_dict()
    return {"state": {i: {k: _local(v) for k, v in entry.items()} for i, entry in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """Load a peer's :func:`local_optimizer_state`: a local shard becomes a DTensor laid out as its parameter."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for i, entry in saved["state"].items():
        p = params[int(i)]
        state[i] = {k: (DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
                        if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                    for k, v in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


class FellBehind(RuntimeError):
    """This replica missed a step its peers committed while it kept running; a restart heals it."""


def all_reduce_hook(replica: "Replica", bucket):  # no return annotation: DDP checks it, and it is a string here
    """DDP communication hook: the bucket averaged over the live replica groups (torchft's Manager, gloo; one rank
    per group). A lost peer does not raise here: the Manager records the error and the step is retried
    ([Note: one step, committed exactly once])."""
    buffer = bucket.buffer()
    replica.average(buffer)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


class Replica:
    """This process's member of a fault-tolerant replica group: torchft's ``Manager`` over a gloo process group.

    ``state_dict()`` is what a recovering peer receives (called on torchft's quorum thread while this replica
    waits for the quorum, so nothing changes under it); ``load_state_dict(state)`` takes a peer's state, on
    the calling thread. ``step`` is the committed step to start from (a run resumed from a checkpoint).
    """

    def __init__(self, group: ReplicaGroup, *, min_replicas: int, timeout_s: float, group_rank: int,
                 group_world_size: int, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                 step: int = 0, max_retries: int = 10, group_barrier: Optional[Callable[[], None]] = None) -> None:
        torchft = import_torchft()
        from torchft.manager import Manager

        timeout = datetime.timedelta(seconds=timeout_s)
        self._load_state_dict, self._received, self._joining = load_state_dict, False, False
        self.group, self.group_rank, self.group_world_size = group, group_rank, group_world_size
        self._pg = torchft.ProcessGroupGloo(timeout=timeout)

        def manager():
            return Manager(
                pg=self._pg, min_replica_size=min_replicas,
                load_state_dict=self._receive, state_dict=state_dict,
                use_async_quorum=False,  # a recovering replica takes the peer's state before its forward pass
                timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                rank=group_rank, world_size=group_world_size, lighthouse_addr=group.lighthouse,
                replica_id=group.replica_id, max_retries=max_retries,
            )
        # [Note: the manager's address, once per attempt]
        if group_rank == 0:
            self.manager = manager()
        if group_barrier is not None:
            group_barrier()
        if group_rank != 0:
            self.manager = manager()
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._open = False
        self.healed_at: Optional[int] = None  # the step this replica received from a peer, if it did
        self.participants: Optional[int] = None  # live replica groups in the last committed step

    @property
    def step(self) -> int:
        return self.manager.current_step()

    def join(self) -> bool:
        """The first quorum, before the training loop: a replica behind the others (restarted, or not the first
        at step 0) receives a peer's state here. Returns whether it did."""
        self._joining = True
        try:
            self._start_quorum()
        finally:
            self._joining = False
        if self._received:
            self.healed_at, self._received = self.step, False
        return self.healed_at is not None

    def begin_step(self) -> None:
        """Before the step's first forward pass: the quorum of this step (already there after :meth:`join`)."""
        if self._open:
            return
        before = self.step
        self._start_quorum()
        self._check_not_behind(before)

    def finish_step(self, closure: Callable[[], Any]) -> Any:
        """Forward and backward (``closure``), retried under a new quorum until the step commits
        ([Note: one step, committed exactly once]); returns the closure's result."""
        while True:
            result = closure()
            if self.manager.should_commit():  # raises after `max_retries` failures in a row
                self._open = False
                self.participants = self.manager.num_participants()
                return result
            before = self.step
            self._start_quorum()
            self._check_not_behind(before)

    def sync_average(self, tensors) -> bool:
        """Local SGD / DiLoCo's sync: ``tensors`` averaged in place over the live replica groups of the quorum the
        sync's step opened (:meth:`begin_step`), then committed; returns whether it committed ([Note: syncs on
        torchft's quorum] in :mod:`lightning_par.dp.local_sgd`)."""
        buckets: dict = {}
        for t in tensors:
            buckets.setdefault((t.dtype, t.device), []).append(t)
        flats = [(same, torch.cat([t.reshape(-1) for t in same])) for same in buckets.values()]
        for work in [self.manager.allreduce(flat) for _, flat in flats]:  # AVG over the participants
            work.wait()
        for same, flat in flats:
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        committed = self.manager.should_commit()
        self._open = False
        self.participants = self.manager.num_participants()
        return committed

    def average(self, flat: torch.Tensor, tensors=None, last: bool = True) -> None:
        """``flat`` averaged in place over the live replica groups: this rank's ring, the ranks of the same group
        rank in every group of the quorum. A lost peer does not raise ([Note: one step, committed exactly once]).
        ``tensors`` / ``last`` (what ``flat`` concatenates, whether it is a step's last bucket) are not needed."""
        self.manager.allreduce(flat).wait()  # AVG over the participants

    def resume_at(self, step: int) -> None:
        """Continue counting committed steps from ``step`` (a run resumed from a checkpoint after the first quorum;
        a replica that received a peer's state at step 0 only took the initial weights, and resumes as the others)."""
        if not self.healed_at and step != self.step:
            self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def _receive(self, state: Any) -> None:
        self._received = True
        if self._joining:  # later, this replica stops instead (:class:`FellBehind`)
            self._load_state_dict(state)

    def _start_quorum(self) -> None:
        self.manager.start_quorum()
        self._open = True

    def _check_not_behind(self, before: int) -> None:
        if self._received:
            raise FellBehind(f"replica group {self.group.group_id} was at step {before} while its peers committed "
                             f"up to {self.step} (its own commit failed); it stops so that torchrun restarts it, "
                             f"and it rejoins with a peer's state.")

    def close(self) -> None:
        self.manager.shutdown(wait=False)  # its server, checkpoint transport and quorum thread
        self._pg.shutdown()
