"""Which parameters outside the block stack each pipeline stage needs, learned from the setup trace.

[Note: the ends a stage needs]
Every stage runs the user's step from its start (see stage.py), so what a stage computes outside the blocks
depends on where the code sits relative to the blocks. While the setup trace runs the step once
([Note: block flow] in flow.py; with stand-ins of a meta-built module's parameters), a torch function mode
records, for every parameter outside the blocks, where the step uses it: before the first block (the embedding:
every stage runs that code, the first one for its gradient, the others for the shapes and the device of
what the blocks' other arguments are computed from), inside block ``i`` (a table the blocks read: the
stages holding ``i``), or after block ``i`` (the stages whose blocks run on past it, and the last stage,
which runs everything after its blocks: the final norm and the head). A stage materializes the parameters
it needs and nothing else; one the traced step never touches (a head only ``predict_step`` uses) is kept
by every stage, so no later step meets a missing one. The lowest stage that needs a parameter owns it
until the first step's gradients say which stages share it ([Note: shared parameters] in shared.py).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from lightning_par._compat import tree_flatten

BEFORE = ("before", -1)


class _Recorder(TorchFunctionMode):
    def __init__(self, ids: dict[int, str]):
        super().__init__()
        self.ids, self.where = ids, BEFORE
        self.uses: dict[str, set[tuple[str, int]]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for obj in tree_flatten((args, kwargs or {}))[0]:
            name = self.ids.get(id(obj)) if isinstance(obj, torch.Tensor) else None
            if name is not None:
                self.uses.setdefault(name, set()).add(self.where)
        return func(*args, **(kwargs or {}))


def record_uses(root: nn.Module, container: nn.Module, block_ids: set[int],
                step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` wrapped so that running it records where it uses each parameter of ``root`` outside the blocks
    (``block_ids``: ids of the blocks' parameters); the record is the returned callable's ``uses``
    (``{name: {("before", -1) | ("in", i) | ("after", i)}}``)."""
    ids = {id(p): n for n, p in root.named_parameters() if id(p) not in block_ids}
    recorder = _Recorder(ids)

    def run():
        handles = []
        for i, block in enumerate(container):
            handles.append(block.register_forward_pre_hook(lambda *_, i=i: setattr(recorder, "where", ("in", i))))
            handles.append(block.register_forward_hook(lambda *_, i=i: setattr(recorder, "where", ("after", i))))
        recorder.where = BEFORE
        try:
            with recorder:
                return step()
        finally:
            for h in handles:
                h.remove()

    run.uses = recorder.uses
    return run


def stage_needs(uses: dict[str, set], chunks: list[tuple[int, int, int]], num_virtual: int) -> Callable[[str], bool]:
    """Whether a rank running ``chunks`` (``(virtual stage, lo, hi)`` block ranges of ``num_virtual``) needs the
    non-block parameter ``name`` (see [Note: the ends a stage needs]); a name never used is needed everywhere.

    Example:
        >>> uses = {"emb": {("before", -1)}, "head": {("after", 3)}, "table": {("in", 1)}}
        >>> first = stage_needs(uses, [(0, 0, 2)], 2)
        >>> [n for n in ("emb", "head", "table", "unused") if first(n)]
        ['emb', 'table', 'unused']
        >>> last = stage_needs(uses, [(1, 2, 4)], 2)
        >>> [n for n in ("emb", "head", "table", "unused") if last(n)]
        ['emb', 'head', 'unused']
    """
    holds_last = any(k == num_virtual - 1 for k, _, _ in chunks)

    def needed_at(where: tuple[str, int]) -> bool:
        kind, i = where
        if kind == "before":
            return True
        if kind == "in":
            return any(lo <= i < hi for _, lo, hi in chunks)
        return holds_last or any(i <= hi - 2 for _, lo, hi in chunks)  # code after block i runs until block hi-1

    def needs(name: str) -> bool:
        where = uses.get(name)
        return where is None or any(needed_at(w) for w in where)

    return needs


def first_owner(uses: dict[str, set], bounds: list[tuple[int, int]], stages_per_rank: int) -> dict[str, int]:
    """The lowest pipeline stage (rank coordinate) that needs each used non-block parameter."""
    pp = len(bounds) // stages_per_rank
    needs = [stage_needs(uses, [(c * pp + s, *bounds[c * pp + s]) for c in range(stages_per_rank)], len(bounds))
             for s in range(pp)]
    return {name: next(s for s in range(pp) if needs[s](name)) for name in uses}


def trace_device(module: nn.Module, device: torch.device) -> Optional[torch.device]:
    """Where the setup trace runs: the module's parameters' device, or ``device`` (the rank's) for a module with
    meta parameters, whose trace computes with stand-ins ([Note: tracing a meta-built module] in stand_ins.py)."""
    p = next(module.parameters(), None)
    if p is None:
        return None
    return device if any(q.is_meta for q in module.parameters()) else p.device
