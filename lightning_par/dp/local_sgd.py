"""Periodic synchronization of data-parallel replicas: local SGD and DiLoCo (``sync="local_sgd" | "diloco"``).

Every replica takes its own optimizer steps (the user's optimizer, the *inner* one) on its own batches, with no
gradient all-reduce; every ``sync_every`` optimizer steps the replicas meet:

- ``local_sgd`` (Stich 2018; Lin et al. 2018): the parameters are averaged over the replicas.
- ``diloco`` (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"): each
  replica's *pseudo-gradient* (the last synced parameters minus its own) is averaged over the replicas, an *outer*
  optimizer (SGD with Nesterov momentum; the paper's lr 0.7, momentum 0.9) steps the last synced copy with it,
  and every replica continues from the result. With ``outer_lr=1`` and ``outer_momentum=0`` that is local SGD.

Nothing here knows Lightning: :class:`PeriodicSync` holds the parameters, counts the optimizer steps it is told
of (:meth:`PeriodicSync.step`), and syncs over a process group (None: the world).

    >>> check_sync("every_step", 1, 0.7, 0.9, 1)
    >>> check_sync("async", 1, 0.7, 0.9, 1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `sync='async'` must be one of 'every_step', 'local_sgd', 'diloco': ...

[Note: our own periodic averaging]
torchft's ``LocalSGD`` and ``DiLoCo`` (``torchft/local_sgd.py``) compute exactly this but need torchft's
``Manager`` (a lighthouse, quorums), and torch's ``PeriodicModelAverager`` averages parameters only (no
DiLoCo) with a step counter of its own that no checkpoint holds. :class:`PeriodicSync` therefore does
torchft's numbers over a plain process group: the same pseudo-gradient (last synced - current), averaged
(all-reduce SUM / replicas), the same outer step (``torch.optim.SGD(nesterov=True)``) applied to the last
synced copy, which is then copied into the parameters. Differences: the synced copy stays on the parameters'
device (torchft keeps it in host memory), the all-reduce is one flat buffer per dtype (torchft: one per
parameter), and the outer optimizer steps the copy rather than the parameters themselves (the parameters'
``.grad`` stays the inner optimizer's). The state (step count, synced copy, outer optimizer) is a state dict,
so a checkpoint resumes exactly (:meth:`PeriodicSync.state_dict`).

[Note: syncs on torchft's quorum]
Under ``fault_tolerance="torchft"`` (one rank per replica group) the replica groups meet only at syncs: the step
that ends a period opens a torchft quorum at its start (where a restarted group joins and receives a live group's
state, this sync state among it, at a step boundary), and its sync averages over the quorum's live groups with
torchft's all-reduce and commits with ``should_commit``. Between syncs no quorum is asked for and nothing is
committed, so torchft's step counts syncs, not optimizer steps. A sync that does not commit is discarded as torchft
discards it (:meth:`PeriodicSync.sync_now`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_par.tensor.mixed import average_flat_

SYNCS = ("every_step", "local_sgd", "diloco")


def check_sync(sync: Any, sync_every: Any, outer_lr: Any, outer_momentum: Any, fragments: Any) -> None:
    """Refuse a value of the sync options that cannot work, naming it and the fix."""
    if sync not in SYNCS:
        raise ValueError(f"`sync={sync!r}` must be one of {', '.join(repr(s) for s in SYNCS)}: 'every_step' "
                         f"(DDP's gradient all-reduce every step), 'local_sgd' (parameters averaged every "
                         f"`sync_every` steps) or 'diloco' (an outer Nesterov step on the averaged parameter "
                         f"change every `sync_every` steps).")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"`sync_every={sync_every!r}` must be an integer >= 1: the optimizer steps between two "
                         f"syncs of the replicas (1: every step).")
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not math.isfinite(outer_lr) \
            or outer_lr <= 0:
        raise ValueError(f"`outer_lr={outer_lr!r}` must be a finite positive number: DiLoCo's outer learning rate "
                         f"(the paper's 0.7; 1 with outer_momentum=0 is local SGD).")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) \
            or not 0 <= outer_momentum < 1:
        raise ValueError(f"`outer_momentum={outer_momentum!r}` must be a number in [0, 1): DiLoCo's outer Nesterov "
                         f"momentum (the paper's 0.9; 0: plain SGD).")
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"`fragments={fragments!r}` must be an integer >= 1.")
    if fragments > 1:
        raise ValueError(f"`fragments={fragments}` (streaming DiLoCo: fragments synced at staggered steps, "
                         f"overlapped with compute) is not supported; use fragments=1 (the whole model synced "
                         f"at once). See docs/limitations.md.")


def check_combination(sync: str, *, zero_stage: int, ddp_options: dict) -> None:
    """What ``sync='local_sgd' | 'diloco'`` cannot combine with (``ddp_options``: the DDP options given a value
    other than their default, the comm hook among them)."""
    if sync == "every_step":
        return
    if zero_stage > 0:
        raise ValueError(f"`sync={sync!r}` does not support `zero_stage={zero_stage}`: between syncs every replica "
                         f"steps its own whole model with its own optimizer state, which ZeRO would shard over the "
                         f"replicas (and reduce the gradients every step). Use zero_stage=0.")
    if ddp_options:
        given = ", ".join(f"{k}={v!r}" for k, v in ddp_options.items())
        raise ValueError(f"`sync={sync!r}` trains each replica without DDP's gradient all-reduce, so the DDP "
                         f"options {given} have nothing to act on (a comm_hook compresses that all-reduce). Drop "
                         f"{'them' if len(ddp_options) > 1 else 'it'}, or use sync='every_step'.")


def average_(tensors: Sequence[torch.Tensor], group=None) -> None:
    """Average ``tensors`` in place over the ranks of ``group``: one flat all-reduce (SUM, then / ranks) per
    dtype and device (:func:`lightning_par.tensor.mixed.average_flat_`, the replicas' gradient average)."""
    average_flat_(tensors, group, dist.get_world_size(group))


class PeriodicSync:
    """Local SGD or DiLoCo over ``params`` (the replica's own tensors, in one order on every rank), torchft's
    numbers over a plain process group ([Note: our own periodic averaging]).

    ``step()`` after every optimizer step of the inner optimizer; it syncs at every ``every``-th and says so.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, sync: str, every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, group=None) -> None:
        if sync not in ("local_sgd", "diloco"):
            raise ValueError(f"PeriodicSync syncs 'local_sgd' or 'diloco', not {sync!r}.")
        self.params = [p for p in params]
        self.sync, self.every, self.group = sync, every, group
        # averages tensors in place over the replicas and says whether the sync commits: the group's all-reduce
        # (always), or torchft's over the live replica groups ([Note: syncs on torchft's quorum])
        self.reduce: Callable[[Sequence[torch.Tensor]], bool] = self._all_reduce
        self.since = 0  # optimizer steps since the last sync
        self.synced: Optional[list[torch.Tensor]] = None
        self.outer: Optional[torch.optim.SGD] = None
        if sync == "diloco":
            self.synced = [p.detach().clone() for p in self.params]  # the last synced parameters
            self.outer = torch.optim.SGD(self.synced, lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)

    def step(self) -> bool:
        """Count one optimizer step; sync when it is the ``every``-th since the last sync (True then)."""
        self.since += 1
        if self.since < self.every:
            return False
        self.sync_now()
        return True

    def _all_reduce(self, tensors: Sequence[torch.Tensor]) -> bool:
        average_(tensors, self.group)
        return True

    @torch.no_grad()
    def sync_now(self) -> bool:
        """Average the parameters (local SGD), or step the outer optimizer on the averaged pseudo-gradient and
        continue from its result (DiLoCo); every rank of the group calls it. A sync that does not commit (a
        replica group lost under torchft) leaves local SGD's replica as it is and resets DiLoCo's to the last
        synced parameters, as torchft's LocalSGD and DiLoCo do; returns whether it committed."""
        self.since = 0
        if self.synced is None:
            averaged = [p.data.clone() for p in self.params]
            if self.reduce(averaged):
                for p, a in zip(self.params, averaged):
                    p.data.copy_(a)
                return True
            return False
        deltas = [s - p.data for s, p in zip(self.synced, self.params)]  # the pseudo-gradient
        if not self.reduce(deltas):
            for p, s in zip(self.params, self.synced):
                p.data.copy_(s)
            return False
        for s, d in zip(self.synced, deltas):
            s.grad = d
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for p, s in zip(self.params, self.synced):
            p.data.copy_(s)
        return True

    def restart(self) -> None:
        """Start afresh from the parameters as they are now (a checkpoint without sync state): no step counted,
        the synced copy theirs, the outer optimizer without momentum."""
        self.since = 0
        if self.synced is not None:
            with torch.no_grad():
                for s, p in zip(self.synced, self.params):
                    s.copy_(p)
            self.outer.state.clear()

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What every rank shares (the same on every rank): the step count since the last sync, and under
        DiLoCo the last synced parameters and the outer optimizer's state; on CPU."""
        state: dict[str, Any] = {"sync": self.sync, "every": self.every, "since": self.since}
        if self.synced is not None:
            state["synced"] = [s.detach().cpu().clone() for s in self.synced]
            state["outer"] = _to_cpu(self.outer.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any], *, where: str = "the checkpoint") -> None:
        if state.get("sync") != self.sync:
            raise ValueError(f"{where} was saved with `sync={state.get('sync')!r}`; this run has sync={self.sync!r}. "
                             f"Resume with sync={state.get('sync')!r}.")
        self.since = int(state["since"]) % self.every  # another sync_every: the count continues modulo it
        if self.synced is None:
            return
        saved = state["synced"]
        if len(saved) != len(self.synced) or any(a.shape != b.shape for a, b in zip(saved, self.synced)):
            raise ValueError(f"{where} holds DiLoCo's synced copy of {len(saved)} parameters that do not fit this "
                             f"module's {len(self.synced)}: was it saved from another model?")
        with torch.no_grad():
            for s, t in zip(self.synced, saved):
                s.copy_(t)
        self.outer.load_state_dict(state["outer"])


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def rank_states(local: dict[str, Any], group=None) -> Optional[list]:
    """Every rank's ``local`` state (CPU tensors) on rank 0 of ``group``, in rank order; None on the others."""
    local = _to_cpu(local)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [local]
    everyone: Optional[list] = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(local, everyone, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return everyone


__all__ = ["SYNCS", "PeriodicSync", "average_", "check_combination", "check_sync", "rank_states"]
