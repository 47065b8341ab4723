"""Tensor-parallel plans as plain data: which module gets which sharding style.

A plan maps module names (fully qualified, as ``named_modules`` gives them) to one of the styles in
:data:`STYLES`. It is built in three layers, each overriding the one before:

1. ``auto``: the Megatron pairs found by inspecting the module tree (:func:`find_megatron_pairs`), and
   fused projections with their output projection (:func:`fused_projections`);
2. a Hugging Face model's ``config.base_model_tp_plan`` (:func:`hf_plan`), where one is present;
3. the user's ``{module_glob: style}`` dict (:func:`apply_user_plan`).

:func:`~.regions.finalize` then adds the ``"prepare"`` entries (the parent of a column/row pair receives its
input once as a replicated DTensor, see [Note: prepare the block input once]) and checks every sharded
dimension and head count against the tensor-parallel size; what a layer is (linear, transposed linear, norm,
head counts) is read in :mod:`.layers`. Everything here is pure: no process group, no DTensor, so it is
unit-tested without processes and every error is raised before any collective.

Example::

    >>> plan = build_plan(gpt, tp_size=2)            # doctest: +SKIP
    >>> plan.styles["blocks.0.attn.q_proj"], plan.styles["blocks.0.attn"]  # doctest: +SKIP
    ('colwise', 'prepare')
"""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field
from typing import Mapping

from torch import nn

from lightning_par.tensor.layers import linear_features, multihead_attention_modules

#: Styles a user may write in ``plan={glob: style}``.
USER_STYLES = ("colwise", "rowwise", "sequence", "replicate")
#: Internal style: the module's first input becomes a replicated DTensor once (parent of a pair).
PREPARE = "prepare"
#: Internal styles under sequence parallelism: a block of the stack (its input is split along the
#: sequence; the last block gathers its output back), and the last block.
BLOCK, LAST_BLOCK = "sequence_block", "sequence_block_last"
#: Internal styles under loss parallelism: the output head (logits stay sharded on the vocabulary) and the
#: token embedding (vocabulary-parallel).
VOCAB_HEAD, VOCAB_EMBEDDING = "vocab_head", "vocab_embedding"
#: Internal style: a fused projection (``TensorPlan.parts`` outputs side by side in one nn.Linear), split
#: column-wise part by part (see [Note: fused projections] in :mod:`.fused`).
FUSED = "fused_colwise"
STYLES = USER_STYLES + (PREPARE, BLOCK, LAST_BLOCK, VOCAB_HEAD, VOCAB_EMBEDDING, FUSED)
_COLUMN = ("colwise", FUSED)

# Containers whose children are not called in a known order by the container itself.
_NOT_A_BLOCK = (nn.ModuleList, nn.ModuleDict)
# Hugging Face plan styles and what they mean here (anything else is left replicated with a warning).
_HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_rep": "colwise", "rowwise_rep": "rowwise",
              "local_colwise": "colwise", "local_rowwise": "rowwise", "sequence_parallel": "sequence"}


@dataclass
class TensorPlan:
    """The resolved plan: ``styles`` (module name → style) and ``replicated`` (module name → why it was
    left replicated although it looked shardable)."""

    styles: dict[str, str] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    source: str = "auto"
    parts: dict[str, int] = field(default_factory=dict)  # fused projection -> how many outputs it fuses
    # replicated module inside a region -> that region (see [Note: one layout per region])
    islands: dict[str, str] = field(default_factory=dict)
    checked: dict[str, str] = field(default_factory=dict)  # region -> what the setup check found (see .probe)

    def regions(self) -> list[str]:
        """Modules whose input enters as a DTensor and whose output leaves as plain tensors (``prepare``)."""
        return [n for n, s in self.styles.items() if s == PREPARE]

    def region_of(self, name: str) -> str | None:
        """The innermost region holding ``name`` (not ``name`` itself), or ``None``."""
        while name:
            name = name.rpartition(".")[0]
            if self.styles.get(name) == PREPARE:
                return name
        return None

    def sharded(self) -> dict[str, str]:
        return {n: s for n, s in self.styles.items() if s in _COLUMN + ("rowwise",)}

    def without(self, absent) -> "TensorPlan":
        """The plan of the modules outside ``absent`` (module names, with everything under them): a pipeline
        stage applies the plan found on the whole module to the blocks it holds."""
        absent = set(absent)

        def keep(name: str) -> bool:
            return name not in absent and not under(name, absent)

        return TensorPlan(styles={n: s for n, s in self.styles.items() if keep(n)},
                          replicated={n: w for n, w in self.replicated.items() if keep(n)}, source=self.source,
                          parts={n: k for n, k in self.parts.items() if keep(n)},
                          islands={n: r for n, r in self.islands.items() if keep(n)},
                          checked={n: w for n, w in self.checked.items() if keep(n)})

    def describe(self, module: nn.Module | None = None) -> str:
        """A human-readable table: the styles applied, then the parameter-holding modules left replicated."""
        lines = [f"tensor-parallel plan ({self.source}):"]
        for name, style in sorted(self.styles.items(), key=lambda kv: _natural(kv[0])):
            if style != "replicate":
                parts = f" ({self.parts[name]} parts)" if name in self.parts else ""
                lines.append(f"  {name or '<root>'}: {style}{parts}")
        for name, region in sorted(self.islands.items(), key=lambda kv: _natural(kv[0])):
            lines.append(f"  {name}: replicated inside {region!r} (runs on plain tensors)")
        for name, why in self.replicated.items():
            lines.append(f"  {name}: replicated ({why})")
        for name, what in self.checked.items():
            lines.append(f"  setup check of {name!r}: {what}")
        if module is not None:
            covered = set(self.sharded()) | set(self.islands)
            rest = [n for n, m in module.named_modules() if n not in covered and n not in self.replicated
                    and any(True for _ in m.parameters(recurse=False))]
            if rest:
                lines.append(f"  replicated (plain): {', '.join(rest)}")
        return "\n".join(lines)


def _natural(name: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


# -- 1. auto -----------------------------------------------------------------------------------------

def find_megatron_pairs(module: nn.Module) -> dict[str, tuple[list[str], str]]:
    """Parents holding a Megatron pair: ``{parent: ([column-wise children], row-wise child)}``.

    A pair is a module (not a ``ModuleList``/``ModuleDict``) whose direct linear children (``nn.Linear`` or
    a transposed one, see :func:`linear_features`) are ``C_1 ... C_k, R`` in registration order, where ``R``
    is the last one, every ``C_i`` reads the block's width (``in_features == R.out_features``) and ``R``
    reads what the first one writes (``R.in_features == C_1.out_features``). That is attention (q, k, v → o;
    k/v may be narrower, as in grouped-query attention) and the MLP (fc or gate, up → down); a fused qkv is
    found by :func:`fused_projections` instead.

    Example::

        >>> from torch import nn
        >>> class MLP(nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.fc = nn.Linear(8, 32); self.proj = nn.Linear(32, 8)
        >>> find_megatron_pairs(nn.ModuleDict({"mlp": MLP()}))
        {'mlp': (['mlp.fc'], 'mlp.proj')}
    """
    pairs = {}
    for name, parent, linears in _linear_parents(module):
        (r_name, (r_in, r_out)), cols = linears[-1], linears[:-1]
        if any(c_in != r_out for _, (c_in, _) in cols) or r_in != cols[0][1][1]:
            continue
        if isinstance(parent, nn.Sequential) and len(linears) != 2:
            continue  # a Sequential of three Linears chains them; only the 2-layer MLP is a pair
        prefix = f"{name}." if name else ""
        pairs[name] = ([prefix + n for n, _ in cols], prefix + r_name)
    return pairs


def _linear_parents(module: nn.Module):
    """``(name, parent, [(child name, (in_features, out_features))])`` for every module with two or more
    direct linear children (:func:`linear_features`; containers and nn.MultiheadAttention excluded),
    registration order."""
    for name, parent in module.named_modules():
        if isinstance(parent, _NOT_A_BLOCK) or isinstance(parent, nn.MultiheadAttention):
            continue
        linears = [(n, f) for n, f in ((n, linear_features(c)) for n, c in parent.named_children()) if f]
        if len(linears) >= 2:
            yield name, parent, linears



def auto_plan(module: nn.Module) -> TensorPlan:
    plan = TensorPlan(source="auto")
    for parent, (cols, row) in find_megatron_pairs(module).items():
        for c in cols:
            plan.styles[c] = "colwise"
        plan.styles[row] = "rowwise"
    for name in multihead_attention_modules(module):
        plan.replicated[name] = ("nn.MultiheadAttention passes its fused in_proj_weight and out_proj.weight to a "
                                 "functional kernel, so it cannot be split by module; the whole module stays replicated")
    for parent, (fused, row, k) in fused_projections(module).items():
        plan.styles[fused], plan.parts[fused] = FUSED, k
        plan.styles[row] = "rowwise"
    return plan


def apply_traced_roles(plan: TensorPlan, module: nn.Module) -> TensorPlan:
    """Replace the shape rule's styles by the dataflow's for every Linear a traced block called (see
    [Note: pairs from dataflow] in :mod:`.trace`); a fused projection keeps its fused style."""
    from lightning_par.tensor.trace import traced_roles

    for roles in traced_roles(module).values():
        for name, role in roles.items():
            if role == "col":
                plan.styles[name] = FUSED if plan.styles.get(name) == FUSED else "colwise"
            elif role == "row":
                plan.styles[name] = "rowwise"
            else:
                plan.styles.pop(name, None)
                plan.parts.pop(name, None)
    return plan


def fused_projections(module: nn.Module) -> dict[str, tuple[str, str, int]]:
    """Parents whose first linear child writes ``k ≥ 2`` times what their last one reads (a fused q/k/v,
    like nanoGPT's and GPT-2's ``c_attn``/``c_proj``): ``{parent: (fused child, row child, k)}``.

    Example::

        >>> from torch import nn
        >>> class Attn(nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.c_attn = nn.Linear(8, 24); self.c_proj = nn.Linear(8, 8)
        >>> fused_projections(nn.ModuleDict({"attn": Attn()}))
        {'attn': ('attn.c_attn', 'attn.c_proj', 3)}
    """
    found = {}
    for name, _, linears in _linear_parents(module):
        (f_name, (f_in, f_out)), (r_name, (r_in, r_out)) = linears[0], linears[-1]
        k, rest = divmod(f_out, r_in)
        if k >= 2 and rest == 0 and f_in == r_out:
            prefix = f"{name}." if name else ""
            found[name] = (prefix + f_name, prefix + r_name, k)
    return found


# -- 2. Hugging Face ---------------------------------------------------------------------------------

def hf_plan(module: nn.Module) -> TensorPlan | None:
    """The ``config.base_model_tp_plan`` of every Hugging Face base model inside ``module``, with its globs
    made absolute; ``None`` when there is none."""
    plan, found = TensorPlan(source="hf base_model_tp_plan"), False
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        tp_plan = getattr(config, "base_model_tp_plan", None)
        prefix_attr = getattr(sub, "base_model_prefix", None)
        if not tp_plan or not prefix_attr or not hasattr(sub, prefix_attr):
            continue  # only the top model carries both the config and its base model
        base = f"{name}.{prefix_attr}" if name else prefix_attr
        for glob, hf_style in tp_plan.items():
            style = _HF_STYLES.get(hf_style)
            for target in _match(module, f"{base}.{glob}"):
                if style is None:
                    plan.replicated[target] = f"Hugging Face style {hf_style!r} is not supported here"
                else:
                    plan.styles[target] = style
        found = True
    return plan if found else None


# -- 3. user globs -----------------------------------------------------------------------------------

def check_user_plan(plan: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(plan, Mapping):
        raise ValueError(f"`plan={plan!r}` must be 'auto' or a dict {{module_glob: style}} with style in {USER_STYLES}.")
    out = {}
    for glob, style in plan.items():
        if not isinstance(glob, str) or style not in USER_STYLES:
            raise ValueError(f"plan entry {glob!r}: {style!r} must be one of {USER_STYLES} (keys are module-name "
                             f"globs such as 'blocks.*.attn.q_proj').")
        out[glob] = style
    return out


def apply_user_plan(plan: TensorPlan, module: nn.Module, user: Mapping[str, str]) -> TensorPlan:
    """Override ``plan`` with the user's globs; a glob that matches no module is a ``ValueError`` naming the
    glob and module names that exist (a misspelled glob would otherwise leave its layers silently whole)."""
    for glob, style in check_user_plan(user).items():
        targets = _match(module, glob)
        if not targets:
            raise ValueError(f"tensor-parallel plan glob {glob!r} (style {style!r}) matches no module of "
                             f"{type(module).__name__}. Globs match the names `named_modules()` gives, such as "
                             f"{_example_names(module)}. Correct the glob or remove the entry from `plan`.")
        for t in targets:
            plan.styles[t] = style
            plan.replicated.pop(t, None)
    plan.source = f"{plan.source} + user overrides"
    return plan


def _match(module: nn.Module, glob: str) -> list[str]:
    return [n for n, _ in module.named_modules() if n and fnmatch.fnmatchcase(n, glob)]


def _example_names(module: nn.Module, k: int = 10) -> str:
    """The first ``k`` names of linear layers (what plans shard), or of any modules if there are none."""
    names = [n for n, m in module.named_modules() if n and linear_features(m) is not None]
    names = names or [n for n, _ in module.named_modules() if n]
    more = f" (and {len(names) - k} more)" if len(names) > k else ""
    return ", ".join(repr(n) for n in names[:k]) + more


def under(name: str, names) -> bool:
    """Whether an ancestor of module ``name`` is in ``names``."""
    while name:
        name = name.rpartition(".")[0]
        if name in names:
            return True
    return False


def build_plan(module: nn.Module, tp_size: int, user: Mapping[str, str] | str = "auto",
               sequence_parallel: bool = False, loss_parallel: bool = False) -> TensorPlan:
    """auto (shapes, then dataflow) → Hugging Face plan (if any) → user globs → :func:`finalize`."""
    plan = apply_traced_roles(auto_plan(module), module)
    hf = hf_plan(module)
    if hf is not None:
        # A Hugging Face plan replaces what auto found inside that model.
        plan.styles.update(hf.styles)
        plan.replicated.update(hf.replicated)
        plan.source = hf.source
    if user != "auto":
        plan = apply_user_plan(plan, module, user)
    from lightning_par.tensor.regions import finalize  # regions builds on this module's TensorPlan

    plan = finalize(plan, module, tp_size, sequence_parallel, loss_parallel)
    if not plan.sharded() and not any(s.startswith("vocab") for s in plan.styles.values()):
        warnings.warn(f"tensor parallel: the plan shards no module of {type(module).__name__} (no attention / MLP "
                      f"pair of nn.Linear layers was found); every rank computes the whole model. Give a `plan` "
                      f"{{module_glob: style}} to split it.", stacklevel=2)
    return plan
