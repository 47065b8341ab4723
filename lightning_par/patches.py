"""Every change lightning_par still makes to an object it does not own, in one list, each with its reason.

Behaviour is attached through what torch and Lightning provide: module forward (pre-)hooks with kwargs
(:mod:`lightning_par.tensor.parallelize`), ``distribute_module``'s input / output functions
(:mod:`lightning_par.tensor.transposed`), subclass copies of Lightning's precision plugin and torch's
``GradScaler`` that the strategy installs in setup and gives back at teardown
(:mod:`lightning_par.strategies._precision`), torch's optimizer step hooks for DTensor and plain parameters
stepped apart (:class:`lightning_par.tensor.mixed.StepByKind`, removed at teardown), a ZeRO optimizer class
whose ``step`` carries the LR schedulers' mark (:func:`lightning_par._compat.shard_aware_zero_optimizer`),
and what a parallelized module is read from the module itself (no registry of modules). What no hook serves
is listed in :data:`PATCHES` below.

A patch that outlives one call is recorded here when it is installed (:func:`record`, under its name in
:data:`PATCHES`: an unlisted patch cannot be recorded) and undone at teardown (:func:`undo`, newest first);
:func:`pending` says what is installed now, and the teardown test checks that a fit leaves nothing pending.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Patch:
    """One change to a foreign object: what it changes, which module makes it, why no hook or wrapper of
    torch / Lightning serves, and when it is taken out."""

    target: str
    by: str
    why: str
    undone: str


PATCHES: dict[str, Patch] = {
    "dtensor-rules": Patch(
        target="DTensor's process-global sharding propagator (op strategy tables of `DTensor._op_dispatcher`)",
        by="lightning_par.tensor.rules (rules of tensor.attention and tensor.fused)",
        why="each rule answers one case of an op (head-sharded attention, a fused q/k/v split) and hands every "
            "other call to torch's own strategy; torch's public `register_sharding` replaces an op's whole "
            "strategy, cannot be taken out again, and keys DTensor's cache by int arguments only, so for the "
            "CPU attention kernel (no torch strategy to wrap) it would reuse a decision made for another "
            "`attn_mask` / `scale` ([Note: keyword masks in the sharding cache])",
        undone="HybridParallelStrategy.teardown (tensor.rules.restore_rules)"),
    "gated-block-forward": Patch(
        target="instance `forward` of a pipelined block, with several chunks on a rank",
        by="lightning_par.pipeline.stage.StageRuntime.install ([Note: gated chunks])",
        why="a block of an inactive chunk must not compute in a stage forward (it does outside one: activation "
            "checkpointing recomputes it in backward); a forward pre-hook can change a module's inputs but not "
            "skip its forward",
        undone="not: it lives as long as the pipelined model, whose other stages' blocks are Ghosts"),
    "module-log": Patch(
        target="`LightningModule.log` of the user's module (an instance attribute shadowing the method)",
        by="lightning_par.pipeline.routing.LogCapture; lightning_par.advisor (a probe's training step logs nothing)",
        why="values logged per micro-batch are combined before Lightning sees them; Lightning has no hook "
            "between `self.log` and its result collection",
        undone="on leaving the `with LogCapture(...)` block"),
    "distributed-sampler": Patch(
        target="`use_distributed_sampler` of the trainer's accelerator connector, at world size 1",
        by="lightning_par.topology (the size-1 rule)",
        why="a one-process run must see plain Lightning's batches; Lightning decides before the strategy "
            "is asked",
        undone="at teardown, by the restore function the strategy holds"),
    "ddp-ignore": Patch(
        target="DDP's ignore list on the LightningModule (`_ddp_params_and_buffers_to_ignore`)",
        by="lightning_par.strategies._pipeline_engine (outside fit)",
        why="DDPStrategy broadcasts rank 0's states at setup, which under pipeline parallelism belong to "
            "another stage",
        undone="at the end of setup"),
    "implicit-replication": Patch(
        target="DTensor's op dispatcher flag `_allow_implicit_replication`",
        by="lightning_par._compat.implicit_replication",
        why="torch's own `implicit_replication` resets the flag to False on exit, so it does not nest",
        undone="on leaving the context (the previous value comes back)"),
}

_installed: list[tuple[str, Callable[[], None]]] = []  # (patch name, undo), newest last
_permanent: dict[str, int] = {}  # installations of the patches never taken out, by name


def record(name: str, undo: Optional[Callable[[], None]]) -> Callable[[], None]:
    """Record that the patch ``name`` (a key of :data:`PATCHES`) was installed, and how to take it out; returns the
    take-out of this one installation (its ``undo``, once; nested installations are each taken out by their own).
    ``undo=None``: a patch that lives as long as the object it changes, counted in :func:`permanent`."""
    if name not in PATCHES:
        raise ValueError(f"patch {name!r} is not listed in lightning_par.patches.PATCHES ({sorted(PATCHES)}): "
                         f"list it there with its reason, or attach the behaviour through a hook.")
    if undo is None:
        _permanent[name] = _permanent.get(name, 0) + 1
        return lambda: None
    entry = (name, undo)
    _installed.append(entry)

    def take_out() -> None:
        for i in range(len(_installed) - 1, -1, -1):
            if _installed[i] is entry:
                del _installed[i]
                undo()
                return
    return take_out


def permanent() -> dict[str, int]:
    """How many times each patch that is never taken out was installed in this process."""
    return dict(_permanent)


def undo(name: Optional[str] = None) -> None:
    """Take out every recorded patch (of ``name`` only, if given), newest first."""
    keep = []
    while _installed:
        entry = _installed.pop()
        if name is None or entry[0] == name:
            entry[1]()
        else:
            keep.append(entry)
    _installed.extend(reversed(keep))


def pending() -> list[str]:
    """The names of the recorded patches still installed, oldest first."""
    return [name for name, _ in _installed]
