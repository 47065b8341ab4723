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

[Note: streaming DiLoCo]
``fragments=F > 1`` (Douillard et al. 2025, "Streaming DiLoCo"; torchft's ``DiLoCo`` with several model fragments):
the block stack is cut into F contiguous ranges (the parameters before it join the first, those after it the last),
each with its own synced copy and outer momentum. As in torchft, fragment f is synced at the optimizer steps
s = (f + 1) H / F + k H (H = ``sync_every``, a multiple of F), so one fragment's bytes cross the link every H / F
steps and each fragment every H. Its all-reduce is started at the end of its sync step (the pseudo-gradient, in
flight on a background gloo / NCCL work) and finished at the fragment's next use: the forward pre-hook of the first
module holding one of its parameters (a checkpoint, the end of training and the next optimizer step finish whatever
is still in flight; the latter refuses a fragment whose parameters got gradients although none of its modules ran
forward: the forward read it before its sync finished). The fragment's parameters do not change in between, so the numbers are torchft's with
``fragment_sync_delay=0`` (the outer step on the averaged pseudo-gradient, ``fragment_update_alpha=0``), while
the communication overlaps the forward of the fragments before it. Between a sync step's end and the
fragment's next forward, hooks see its parameters before the sync. Not under torchft (refused): torchft's own
streaming needs its quorum per fragment sync.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_par.tensor.mixed import average_flat_, start_average_flat

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
    if fragments > 1 and sync != "diloco":
        raise ValueError(f"`fragments={fragments}` (streaming DiLoCo) needs sync='diloco', not sync={sync!r}; for "
                         f"streamed parameter averaging use sync='diloco' with outer_lr=1.0, outer_momentum=0.0.")
    if fragments > 1 and (sync_every < fragments or sync_every % fragments):
        raise ValueError(f"`fragments={fragments}` needs `sync_every` to be a multiple of it (got sync_every="
                         f"{sync_every}): one fragment is synced every sync_every / fragments steps, as torchft's "
                         f"streaming DiLoCo. Use sync_every={max(1, sync_every // fragments) * fragments}.")


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
    """Local SGD or DiLoCo over ``params`` (the replica's own tensors, in one order on every rank; a DTensor
    parameter is synced through its local shard), torchft's numbers over a plain process group of ``replicas``
    ranks ([Note: our own periodic averaging]).

    ``fragments`` (streaming DiLoCo, [Note: streaming DiLoCo]): the indices into ``params`` of each fragment, and
    ``owners`` the modules holding each fragment's parameters, whose forward waits for the fragment's sync.
    ``step()`` after every optimizer step of the inner optimizer; it syncs when a fragment is due and says so.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, sync: str, every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, group=None, replicas: Optional[int] = None,
                 fragments: Optional[Sequence[Sequence[int]]] = None,
                 owners: Optional[Sequence[Sequence[torch.nn.Module]]] = None) -> None:
        if sync not in ("local_sgd", "diloco"):
            raise ValueError(f"PeriodicSync syncs 'local_sgd' or 'diloco', not {sync!r}.")
        params = list(params)
        self.given = params  # the parameters themselves (their .grad), for the check in step()
        self.params = [_local(p) for p in params]
        self.sync, self.every, self.group = sync, every, group
        if replicas is None:
            replicas = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.replicas = replicas
        # averages tensors in place over the replicas and says whether the sync commits: the group's all-reduce
        # (always), or torchft's over the live replica groups ([Note: syncs on torchft's quorum])
        self.reduce: Callable[[Sequence[torch.Tensor]], bool] = self._all_reduce
        self.since = 0  # optimizer steps since the last sync of the whole model (modulo every)
        self.fragments = [list(f) for f in fragments] if fragments else [list(range(len(self.params)))]
        n = len(self.fragments)
        self.offsets = [every // n * (f + 1) for f in range(n)]  # torchft's: fragment f at (f + 1) H / F, then + H
        self.pending: dict[int, Callable[[], None]] = {}  # fragments whose all-reduce is in flight
        self.hooks = [m.register_forward_pre_hook(lambda *_, f=f: self.finish(f))
                      for f, ms in enumerate(owners or []) for m in ms]
        self.synced: Optional[list[torch.Tensor]] = None
        self.outer: Optional[torch.optim.SGD] = None
        if sync == "diloco":
            self.synced = [p.detach().clone() for p in self.params]  # the last synced parameters
            self.outer = torch.optim.SGD(self.synced, lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)

    def step(self) -> bool:
        """Count one optimizer step; sync each fragment that is due (True when one is)."""
        for f in list(self.pending):  # not used by this step's forward (else its hook had finished it)
            used = [i for i in self.fragments[f] if self.given[i].grad is not None]
            if used:
                raise RuntimeError(f"Streaming DiLoCo: parameter {used[0]} (in the optimizer's order) of fragment {f} "
                                   f"has a gradient, but no module holding fragment {f}'s parameters ran forward "
                                   f"this step, so its sync finished too late (the forward read it before). Use "
                                   f"fragments=1, or call the module that holds it.")
            self.finish(f)
        self.since += 1
        due = [f for f, offset in enumerate(self.offsets) if self.since == offset]
        if self.since >= self.every:
            self.since = 0
        if len(self.fragments) == 1:
            if due:
                self._sync_fragments([0])
            return bool(due)
        for f in due:
            self.start(f)
        return bool(due)

    def _all_reduce(self, tensors: Sequence[torch.Tensor]) -> bool:
        if self.replicas > 1:
            average_flat_(tensors, self.group, self.replicas)
        return True

    @torch.no_grad()
    def sync_now(self) -> bool:
        """Sync the whole model now (every rank of the group calls it); the count starts again."""
        self.finish()
        self.since = 0
        return self._sync_fragments(range(len(self.fragments)))

    def _sync_fragments(self, fragments: Iterable[int]) -> bool:
        """Average the parameters (local SGD), or step the outer optimizer on the averaged pseudo-gradient and
        continue from its result (DiLoCo). A sync that does not commit (a replica group lost under torchft)
        leaves local SGD's replica as it is and resets DiLoCo's to the last synced parameters, as torchft's
        LocalSGD and DiLoCo do; returns whether it committed."""
        idx = [i for f in fragments for i in self.fragments[f]]
        if self.synced is None:
            averaged = [self.params[i].clone() for i in idx]
            if self.reduce(averaged):
                for i, a in zip(idx, averaged):
                    self.params[i].copy_(a)
                return True
            return False
        deltas = [self.synced[i] - self.params[i] for i in idx]  # the pseudo-gradient
        if not self.reduce(deltas):
            for i in idx:
                self.params[i].copy_(self.synced[i])
            return False
        self._outer_step(idx, deltas)
        return True

    def _outer_step(self, idx: list[int], deltas: list[torch.Tensor]) -> None:
        for i, d in zip(idx, deltas):
            self.synced[i].grad = d
        self.outer.step()  # parameters without a gradient (other fragments) are left alone, momentum too
        self.outer.zero_grad(set_to_none=True)
        for i in idx:
            self.params[i].copy_(self.synced[i])

    # -- streaming DiLoCo ([Note: streaming DiLoCo]) ------------------------------------------------------------
    @torch.no_grad()
    def start(self, f: int) -> None:
        """Fragment ``f``'s pseudo-gradient, its average started (in flight on return)."""
        self.finish(f)
        idx = self.fragments[f]
        deltas = [self.synced[i] - self.params[i] for i in idx]
        finish = start_average_flat(deltas, self.group, self.replicas) if self.replicas > 1 else (lambda: None)

        def apply() -> None:
            finish()
            self._outer_step(idx, deltas)

        self.pending[f] = apply

    @torch.no_grad()
    def finish(self, f: Optional[int] = None) -> None:
        """Wait for fragment ``f``'s sync (None: every fragment's) and apply it."""
        for g in ([f] if f is not None else list(self.pending)):
            apply = self.pending.pop(g, None)
            if apply is not None:
                apply()

    def close(self) -> None:
        """Finish what is in flight and take the forward hooks out."""
        self.finish()
        while self.hooks:
            self.hooks.pop().remove()

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
        self.finish()
        state: dict[str, Any] = {"sync": self.sync, "every": self.every, "since": self.since,
                                 "fragments": len(self.fragments)}
        if self.synced is not None:
            state["synced"] = [s.detach().cpu().clone() for s in self.synced]
            state["outer"] = _to_cpu(self.outer.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any], *, where: str = "the checkpoint") -> None:
        if state.get("sync") != self.sync:
            raise ValueError(f"{where} was saved with `sync={state.get('sync')!r}`; this run has sync={self.sync!r}. "
                             f"Resume with sync={state.get('sync')!r}.")
        if state.get("fragments", 1) != len(self.fragments):
            raise ValueError(f"{where} was saved with `fragments={state.get('fragments', 1)}`; this run has "
                             f"fragments={len(self.fragments)}. Resume with fragments={state.get('fragments', 1)}.")
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: writes reach the parameter), a plain tensor itself, detached."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t.detach()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per parameter (in the optimizer's order) its state: tensors as this rank's local values on CPU."""
    return [{k: (_local(v).cpu().clone() if isinstance(v, torch.Tensor) else v)
             for k, v in optimizer.state.get(p, {}).items()}
            for group in optimizer.param_groups for p in group["params"]]


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]], *, where: str) -> None:
    """:func:`optimizer_tensors`' values written into the optimizer's state in place (a DTensor's local shard),
    which Lightning's restore of the same layout has created."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(saved) != len(params):
        raise ValueError(f"{where} holds this rank's optimizer state of {len(saved)} parameters; its optimizer has "
                         f"{len(params)}: was it saved from another model?")
    with torch.no_grad():
        for p, state in zip(params, saved):
            current = optimizer.state[p]
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and isinstance(current.get(k), torch.Tensor):
                    _local(current[k]).copy_(v)
                elif isinstance(v, torch.Tensor):
                    if isinstance(p, DTensor):
                        raise ValueError(f"{where}: the optimizer has no state {k!r} for a sharded parameter to "
                                         f"load this rank's into (was the optimizer state restored?).")
                    current[k] = v.to(p.device) if v.dim() > 0 else v
                else:
                    current[k] = v


def block_fragments(module: torch.nn.Module, params: Sequence[torch.Tensor], fragments: int,
                    blocks: Optional[str] = None) -> tuple[list[list[int]], list[list[torch.nn.Module]]]:
    """Streaming DiLoCo's fragments of ``module`` ([Note: streaming DiLoCo]): its block stack cut into
    ``fragments`` contiguous ranges, the parameters before the stack with the first, those after it with the last.
    Returns each fragment's indices into ``params`` and the modules directly holding them."""
    from lightning_par.pipeline.discovery import find_blocks

    path, stack = find_blocks(module, blocks)
    children = list(stack.children())
    if len(children) < fragments:
        raise ValueError(f"`fragments={fragments}` cuts the block stack `{path}` of {type(module).__name__} into "
                         f"that many ranges, and it has {len(children)} blocks. Use fragments <= {len(children)}.")
    where: dict[int, int] = {}
    start = 0
    for f in range(fragments):
        count = len(children) // fragments + (1 if f < len(children) % fragments else 0)
        for block in children[start:start + count]:
            for p in block.parameters():
                where.setdefault(id(p), f)
        start += count
    seen_stack, owners = False, [[] for _ in range(fragments)]
    for name, p in module.named_parameters():
        if id(p) in where:
            seen_stack = True
        else:
            where[id(p)] = fragments - 1 if seen_stack else 0
    wanted = {id(p): i for i, p in enumerate(params)}
    indices = [[] for _ in range(fragments)]
    for p in params:
        indices[where[id(p)]].append(wanted[id(p)])
    for m in module.modules():
        held = {where[id(p)] for p in m.parameters(recurse=False) if id(p) in wanted}
        for f in held:
            owners[f].append(m)
    return indices, owners


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _local(obj).cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def rank_state(local: dict[str, Any]) -> dict[str, Any]:
    """This rank's ``local`` state alone (CPU tensors, copies): no collective."""
    return _to_cpu(local)


def rank_states(local: dict[str, Any], group=None) -> Optional[list]:
    """Every rank's ``local`` state (CPU tensors) on rank 0 of ``group``, in rank order; None on the others."""
    local = rank_state(local)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [local]
    everyone: Optional[list] = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(local, everyone, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return everyone


__all__ = ["SYNCS", "PeriodicSync", "average_", "block_fragments", "check_combination", "check_sync",
           "load_optimizer_tensors", "optimizer_tensors", "rank_state", "rank_states"]
