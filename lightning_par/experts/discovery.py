"""Where a module keeps its routed experts: found on the unchanged module, or named by ``experts=`` (a glob).

Two layouts are recognised, as the field holds them:

- **fused**: one module holding every expert's weights as tensors whose first dimension is the expert
  (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, optional biases ``[E, ...]``) and called as
  ``experts(hidden_states, top_k_index, top_k_weights)``: Hugging Face transformers 5's MoE families (Mixtral,
  Qwen2/3-MoE, DeepSeek-V3, OLMoE, ...), whose experts classes go through ``transformers.integrations.moe``'s
  experts interface (``@use_experts_implementation``), and any module with the same shape and call.
- **list**: an ``nn.ModuleList`` named ``experts`` of E modules of one class, each an MLP with
  ``gate_proj``/``up_proj``/``down_proj`` or ``w1``/``w2``/``w3`` (older transformers, Megablocks-style code),
  called one expert at a time by its parent's forward.

    >>> found = find_experts(model)                         # doctest: +SKIP
    >>> [(c.name, c.kind, c.num_experts) for c in found]    # doctest: +SKIP
    [('model.layers.0.mlp.experts', 'fused', 8), ...]
"""
from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

FUSED, LIST = "fused", "list"
_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # (gate, up, down)
_ROUTED_ARGS = 3  # experts(hidden_states, top_k_index, top_k_weights)


@dataclass
class ExpertContainer:
    """One MoE layer's routed experts: ``name`` (qualified), the ``module`` holding them, its ``kind``
    (``"fused"`` or ``"list"``), ``num_experts`` and, for ``"fused"``, the names of its expert-indexed tensors."""

    name: str
    module: nn.Module
    kind: str
    num_experts: int
    tensors: list[str] = field(default_factory=list)
    parent: Optional[nn.Module] = None  # "list": the module whose forward loops over the experts

    def expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(qualified name, parameter) of every routed expert's weight in this container."""
        return [(f"{self.name}.{n}", p) for n, p in self.module.named_parameters()]


def fused_tensors(module: nn.Module) -> tuple[int, list[str]]:
    """(E, names) of ``module``'s own parameters whose first dimension is the expert count E, when the module is
    a fused experts container (a ``num_experts`` attribute equal to that dimension, or at least one 3-D tensor
    and every tensor sharing the first dimension); (0, []) otherwise."""
    own = [(n, p) for n, p in module.named_parameters(recurse=False)]
    if not own or not any(p.dim() == 3 for _, p in own):
        return 0, []
    first = {p.shape[0] for _, p in own if p.dim() >= 2}
    if len(first) != 1:
        return 0, []
    e = first.pop()
    declared = getattr(module, "num_experts", None)
    if declared is not None and declared != e:
        return 0, []
    if e < 2 or not _takes_routing(module):
        return 0, []
    return e, [n for n, p in own if p.dim() >= 2 and p.shape[0] == e]


def _takes_routing(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes (hidden_states, top_k_index, top_k_weights)."""
    forward = inspect.unwrap(type(module).forward)
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= _ROUTED_ARGS or any(p.kind == p.VAR_POSITIONAL for p in params)


def mlp_names(expert: nn.Module) -> Optional[tuple[str, str, str]]:
    """(gate, up, down) submodule names of a per-expert MLP, or None."""
    children = dict(expert.named_children())
    for names in _MLP_NAMES:
        if all(isinstance(children.get(n), nn.Linear) for n in names):
            return names
    return None


def _list_experts(module: nn.Module) -> int:
    if not isinstance(module, nn.ModuleList) or len(module) < 2:
        return 0
    kinds = {type(m) for m in module}
    if len(kinds) != 1:
        return 0
    return len(module)


def find_experts(module: nn.Module, experts: Optional[str] = None) -> list[ExpertContainer]:
    """Every routed-experts container of ``module`` (module order). ``experts``: a glob over qualified module
    names choosing them instead of the recognised names (``"*.block_sparse_moe.experts"``); a glob that matches
    nothing, or matches a module that is neither layout, is a ``ValueError`` naming it."""
    parents = {}
    for name, m in module.named_modules():
        for child_name, child in m.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = m
    found: list[ExpertContainer] = []
    matched = []
    for name, m in module.named_modules():
        if experts is not None and not fnmatch.fnmatchcase(name, experts):
            continue
        if experts is not None:
            matched.append(name)
        e, tensors = fused_tensors(m)
        if e:
            found.append(ExpertContainer(name, m, FUSED, e, tensors, parents.get(name)))
            continue
        e = _list_experts(m)
        if e and (experts is not None or name.rsplit(".", 1)[-1] == "experts") and mlp_names(m[0]) is not None:
            found.append(ExpertContainer(name, m, LIST, e, [], parents.get(name)))
        elif e and experts is not None:
            found.append(ExpertContainer(name, m, LIST, e, [], parents.get(name)))
        elif experts is not None and not e:
            raise ValueError(f"`experts={experts!r}` matches `{name}` ({type(m).__name__}), which holds no routed "
                             f"experts: neither expert-indexed tensors called as experts(hidden_states, "
                             f"top_k_index, top_k_weights) nor an nn.ModuleList of experts. Name the experts "
                             f"container itself.")
    if experts is not None and not matched:
        raise ValueError(f"`experts={experts!r}` matches no module of {type(module).__name__}. It is a glob over "
                         f"qualified module names, e.g. 'model.layers.*.mlp.experts'.")
    return found


def describe(found: list[ExpertContainer]) -> str:
    """One line per container: name, layout, experts and the tensors or modules that hold them."""
    lines = []
    for c in found:
        what = ", ".join(c.tensors) if c.kind == FUSED else f"{c.num_experts} x {type(c.module[0]).__name__}"
        lines.append(f"  {c.name}: {c.kind}, {c.num_experts} experts ({what})")
    return "\n".join(lines)
