"""Optimizer state keyed by parameter name, and torch's positional format as one device numbers it.

[Note: optimizer state by name]
``optimizer.state_dict()`` numbers parameters by their position in the optimizer's groups, and the
optimizer of a pipeline stage, a ZeRO shard or a tensor-parallel rank holds other parameters (or parts of
them) than one device's does: positions do not travel between layouts, names do. Every layout therefore
writes its share of the optimizer state as ``{name: {state key: value}}`` plus the groups' hyperparameters
with the *one-device order* of their parameters' names (``[[names of group 0], [names of group 1], ...]``:
what ``configure_optimizers`` puts in each group on the whole module). A consolidated file numbers the
names in that order, which is torch's positional format on one device, so plain Lightning resumes it;
reading any file back, a rank picks the entries of the parameters its own optimizer holds.

Example:
    >>> import torch
    >>> w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(1))
    >>> opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.5}], lr=0.1, momentum=0.9)
    >>> (w.sum() + b.sum()).backward(); opt.step()
    >>> names = {id(w): "w", id(b): "b"}
    >>> state = named_state(opt, names)
    >>> groups = named_groups(opt, [["w"], ["b"]])
    >>> positional = to_positional(state, groups)
    >>> positional["param_groups"][1]["params"], sorted(positional["state"])
    ([1], [0, 1])
    >>> back, back_groups = from_positional(positional, [["w"], ["b"]], where="x.ckpt")
    >>> sorted(back), back_groups[1]["lr"]
    (['b', 'w'], 0.5)
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from lightning_par.checkpoint.tensors import local_shard_like

Order = Sequence[Sequence[str]]  # names per param group, in the order one device's optimizer holds them


def flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the order ``state_dict()`` numbers them."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def live_order(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[list[str]]:
    """The names of ``optimizer``'s parameters, group by group."""
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def named_state(holder: torch.optim.Optimizer, names: Mapping[int, str],
                writes: Optional[Callable[[torch.Tensor, str], bool]] = None) -> dict[str, dict[str, Any]]:
    """The state ``holder`` keeps (this rank's share), keyed by parameter name; ``writes(param, name)``
    leaves out what another rank writes."""
    out = {}
    for p, entry in holder.state.items():
        name = names.get(id(p))
        if name is not None and entry and (writes is None or writes(p, name)):
            out[name] = dict(entry)
    return out


def named_groups(optimizer: torch.optim.Optimizer, order: Order) -> list[dict[str, Any]]:
    """``optimizer``'s groups' hyperparameters with the one-device ``order`` of names as their ``params``."""
    if len(order) != len(optimizer.param_groups):
        raise ValueError(f"The optimizer {type(optimizer).__name__} has {len(optimizer.param_groups)} parameter "
                         f"groups, `configure_optimizers` on the whole module {len(order)}.")
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
            for g, names in zip(optimizer.param_groups, order)]


def to_positional(state: Mapping[str, Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """torch's ``optimizer.state_dict()`` format, the names numbered in the groups' order (one device's)."""
    index: dict[str, int] = {}
    numbered = []
    for g in groups:
        ids = []
        for name in g["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        numbered.append({**g, "params": ids})
    return {"state": {index[n]: dict(state[n]) for n in index if n in state}, "param_groups": numbered}


def from_positional(positional: Mapping[str, Any], order: Order, *, where: str) -> tuple[dict, list[dict]]:
    """A positional state (one device's numbering, e.g. a plain Lightning checkpoint) by name, numbered with
    ``order`` (this run's one-device order). Raises ``ValueError`` naming ``where`` if the groups differ."""
    saved = positional.get("param_groups")
    if not isinstance(saved, list) or "state" not in positional:
        raise ValueError(f"The optimizer state in {where} is not torch's `state_dict()` format "
                         f"(keys: {sorted(map(str, positional))[:10]}).")
    sizes, want = [len(g["params"]) for g in saved], [len(names) for names in order]
    if sizes != want:
        raise ValueError(f"The checkpoint {where} holds an optimizer whose groups have {sizes} parameters; "
                         f"`configure_optimizers` on this module gives {want}. Was it saved from another model "
                         f"or another `configure_optimizers`?")
    name_of = {}
    for g, names in zip(saved, order):
        name_of.update({int(i): n for i, n in zip(g["params"], names)})
    state = {name_of[int(i)]: dict(v) for i, v in positional["state"].items() if v is not None}
    groups = [{**g, "params": list(names)} for g, names in zip(saved, order)]
    return state, groups


def load_named(optimizer: torch.optim.Optimizer, state: Mapping[str, Mapping[str, Any]],
               groups: Sequence[Mapping[str, Any]], names: Mapping[int, str], *, where: str) -> None:
    """Load the named ``state`` and ``groups`` (hyperparameters; ``params``: names) into ``optimizer``, which
    may hold any subset of the parameters (a stage's) as plain or DTensor parameters: full tensors are sliced
    to the local shard, tensors that already are DTensors are taken as they are; parameters on the meta device
    (what another rank holds) get none."""
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"The checkpoint {where} holds an optimizer with {len(groups)} parameter groups; this "
                         f"run's {type(optimizer).__name__} has {len(optimizer.param_groups)}.")
    positional_state, numbered, start = {}, [], 0
    for j, (saved, live) in enumerate(zip(groups, optimizer.param_groups)):
        members = set(saved["params"])
        stray = [names[id(p)] for p in live["params"] if names[id(p)] not in members]
        if stray:
            raise ValueError(f"The checkpoint {where} puts other parameters in optimizer group {j} than this run: "
                             f"{stray[:5]} are not in it. Resume with the `configure_optimizers` that wrote it.")
        for offset, p in enumerate(live["params"]):
            entry = state.get(names[id(p)])
            if entry and not p.is_meta:  # a meta parameter is another rank's share: this one keeps no state
                positional_state[start + offset] = {
                    k: (local_shard_like(v, p) if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape)
                        and v.dim() > 0 else v) for k, v in entry.items()}
        numbered.append({**{k: v for k, v in saved.items() if k != "params"},
                         "params": list(range(start, start + len(live["params"])))})
        start += len(live["params"])
    optimizer.load_state_dict({"state": positional_state, "param_groups": numbered})


__all__ = ["Order", "flat_params", "from_positional", "live_order", "load_named", "named_groups", "named_state",
           "to_positional"]
