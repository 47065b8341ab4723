"""Tensor-parallel plans as plain data: which module gets which sharding style.

A plan maps module names (fully qualified, as ``named_modules`` gives them) to one of the styles in
:data:`STYLES`. It is built in three layers, each overriding the one before:

1. ``auto``: the Megatron pairs found by inspecting the module tree (:func:`find_megatron_pairs`), and
   fused projections with their output projection (:func:`fused_projections`);
2. a Hugging Face model's ``config.base_model_tp_plan`` (:func:`hf_plan`), where one is present;
3. the user's ``{module_glob: style}`` dict (:func:`apply_user_plan`).

:func:`finalize` then adds the ``"prepare"`` entries (the parent of a column/row pair receives its input
once as a replicated DTensor, see [Note: prepare the block input once]) and checks every sharded
dimension and head count against the tensor-parallel size. Everything here is pure: no process group,
no DTensor, so it is unit-tested without processes and every error is raised before any collective.

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

import torch
from torch import nn

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

# Attribute names under which attention modules store head counts (own attributes or ``config``).
_HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "nhead", "num_attention_heads")
_KV_HEAD_ATTRS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")
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


def _is_plain_linear(m: nn.Module) -> bool:
    # nn.Linear subclasses that only rename the class (e.g. NonDynamicallyQuantizableLinear) still count.
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def is_transposed_linear(m: nn.Module) -> bool:
    """A linear layer that stores its weight transposed, ``[in, out]``, and computes ``x @ weight + bias``:
    Hugging Face's ``Conv1D`` (``transformers.pytorch_utils``; GPT-2, OpenAI GPT).

    [Note: transposed linear layers]
    Recognised by duck typing, so that the package never imports transformers: a module without children
    whose parameters are a 2-D ``weight`` ``[nx, nf]`` and an optional ``bias`` ``[nf]``, that either
    stores ``nf`` (``Conv1D(nf, nx)`` keeps ``self.nf``) or is a class named ``Conv1D`` (torch's real
    convolution is ``nn.Conv1d``, with a 3-D weight). Its output features are the weight's dim 1, so the
    column-wise split is ``Shard(1)`` of the weight and ``Shard(0)`` of the bias, the row-wise split
    ``Shard(0)`` of the weight with the bias replicated (:mod:`.transposed`); the plan treats it as an
    ``nn.Linear(nx, nf)`` otherwise.

    Example::

        >>> import torch
        >>> class Conv1D(nn.Module):  # transformers.pytorch_utils.Conv1D, reduced to its parameters
        ...     def __init__(self, nf, nx):
        ...         super().__init__(); self.nf = nf
        ...         self.weight, self.bias = nn.Parameter(torch.zeros(nx, nf)), nn.Parameter(torch.zeros(nf))
        >>> is_transposed_linear(Conv1D(24, 8)), linear_features(Conv1D(24, 8))
        (True, (8, 24))
        >>> is_transposed_linear(nn.Linear(8, 24)), is_transposed_linear(nn.Conv1d(8, 24, 1))
        (False, False)
    """
    if isinstance(m, (nn.Linear, nn.Embedding)) or next(m.children(), None) is not None:
        return False
    weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return False
    nf = getattr(m, "nf", None)
    if not (isinstance(nf, int) and nf == weight.shape[1]) and type(m).__name__ != "Conv1D":
        return False
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[1],)):
        return False
    return {n for n, _ in m.named_parameters(recurse=False)} <= {"weight", "bias"}


def linear_features(m: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a plain ``nn.Linear`` or a transposed linear layer
    (:func:`is_transposed_linear`); ``None`` for anything else."""
    if _is_plain_linear(m):
        return m.in_features, m.out_features
    if is_transposed_linear(m):
        nx, nf = m.weight.shape
        return int(nx), int(nf)
    return None


def multihead_attention_modules(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)]


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


# -- finalize: prepare entries + divisibility --------------------------------------------------------

def is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith(("LayerNorm", "RMSNorm"))


def add_sequence_parallel(plan: TensorPlan, module: nn.Module) -> TensorPlan:
    """Under ``sequence_parallel=True``: every block that holds prepared modules gets a block style (the last
    block of its stack the gathering one), and the norms directly inside those blocks become ``sequence``.

    [Note: sequence parallel span]
    The residual stream is split along the sequence from the first block's input to the last block's
    output; embeddings, the final norm and the head keep full sequences (they sit outside the block stack
    in user code that the strategy does not rewrite, e.g. ``pos_emb(arange(T))`` added to the tokens).
    """
    modules = dict(module.named_modules())
    for region in plan.regions():
        parent = region.rpartition(".")[0]
        if "." not in region or isinstance(modules[parent], _NOT_A_BLOCK):
            raise ValueError(f"sequence_parallel=True: {region!r} ({type(modules[region]).__name__}) holds column-wise "
                             f"layers but sits directly in {type(modules[parent]).__name__ if parent else 'the root'}, "
                             f"not inside a block module that receives the residual stream; the sequence could not be "
                             f"split at a block boundary. Use sequence_parallel=False for this model.")
    blocks = sorted({n.rpartition(".")[0] for n in plan.regions()}, key=_natural)
    stacks: dict[str, list[str]] = {}
    for b in blocks:
        stacks.setdefault(b.rpartition(".")[0], []).append(b)
    for stack, members in stacks.items():
        for b in members:
            plan.styles[b] = LAST_BLOCK if b == members[-1] else BLOCK
            for child_name, child in modules[b].named_children():
                name = f"{b}.{child_name}"
                if is_norm(child) and plan.styles.get(name) in (None, "sequence"):
                    plan.styles[name] = "sequence"
                elif plan.styles.get(name) != PREPARE and any(True for _ in child.parameters()):
                    # it would receive this rank's part of the sequence: only norms and regions know that
                    raise ValueError(f"sequence_parallel=True: {name!r} ({type(child).__name__}) sits in the block "
                                     f"{b!r} beside its attention / MLP but is neither one of them nor a norm, so it "
                                     f"would receive a sequence-split input it was not written for. Use "
                                     f"sequence_parallel=False for this model.")
    return plan


def find_vocab_head(module: nn.Module, plan: TensorPlan) -> tuple[str | None, str | None]:
    """The output head (an ``nn.Linear`` outside every pair that writes the vocabulary) and its token embedding.

    The head is the ``nn.Linear`` whose weight is tied to an ``nn.Embedding`` or else the last registered
    one shaped like an embedding transposed; the embedding is the tied one, or the only one of the
    head's shape (several of that shape: none, it stays replicated).
    """
    modules = dict(module.named_modules())
    embeddings = {n: m for n, m in modules.items() if isinstance(m, nn.Embedding)}
    head = emb = None
    for name, m in modules.items():
        if not isinstance(m, nn.Linear) or name in plan.styles or name in plan.replicated:
            continue
        tied = [e for e, em in embeddings.items() if em.weight is m.weight]
        shaped = [e for e, em in embeddings.items()
                  if (em.num_embeddings, em.embedding_dim) == (m.out_features, m.in_features)]
        if tied:
            return name, tied[0]
        if shaped:
            head, emb = name, (shaped[0] if len(shaped) == 1 else None)
    return head, emb


def add_loss_parallel(plan: TensorPlan, module: nn.Module, tp_size: int) -> TensorPlan:
    """Under ``loss_parallel=True``: the head writes vocabulary-sharded logits and the token embedding is
    vocabulary-parallel (required when the two share their weight)."""
    head, emb = find_vocab_head(module, plan)
    if head is None:
        raise ValueError("loss_parallel=True: found no output head (an nn.Linear outside the attention / MLP pairs "
                         "shaped like an nn.Embedding transposed, or tied to one). Set loss_parallel=False.")
    modules = dict(module.named_modules())
    _check_shardable(head, modules[head], "colwise", tp_size)
    plan.styles[head] = VOCAB_HEAD
    if emb is not None:
        _check_shardable(emb, modules[emb], "rowwise", tp_size)
        plan.styles[emb] = VOCAB_EMBEDDING
    return plan


def finalize(plan: TensorPlan, module: nn.Module, tp_size: int, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> TensorPlan:
    """Add ``prepare`` for the region of every column-wise layer (:func:`_region_for`), leave
    ``nn.MultiheadAttention`` (and anything inside it) replicated, add the islands (:func:`add_islands`), and
    check that every sharded dimension and head count divides by ``tp_size``.

    [Note: prepare the block input once]
    Column-wise layers that read the same input (q, k, v; gate, up) each turn their replicated input into a
    DTensor and, in backward, all-reduce that input's gradient on their own: 3 + 1 all-reduces per
    attention instead of Megatron's 1 + 1. Making the *parent's* input a replicated DTensor once lets the
    partial gradients of q, k and v sum locally and be reduced once, at the parent's boundary.
    """
    modules = dict(module.named_modules())
    for mha in multihead_attention_modules(module):
        for name in list(plan.styles):
            if (name == mha or name.startswith(mha + ".")) and plan.styles[name] != "replicate":
                del plan.styles[name]
                plan.replicated.setdefault(name, "inside nn.MultiheadAttention, which stays replicated")
                if name != mha:
                    warnings.warn(f"tensor parallel: {name!r} is inside nn.MultiheadAttention {mha!r}, whose weights "
                                  "go to a functional kernel; the whole module is left replicated.", stacklevel=3)
        warnings.warn(f"tensor parallel: nn.MultiheadAttention {mha!r} is left replicated (its fused in_proj_weight "
                      "and out_proj.weight are used by a functional kernel, not by calling submodules).", stacklevel=3)
    holds_row = _ancestors(n for n, s in plan.styles.items() if s == "rowwise")
    stacks = {n for n, m in modules.items() if _is_container(m)}
    holds_stack = stacks | _ancestors(stacks)  # a region never spans a stack of blocks
    for name, style in list(plan.styles.items()):
        if name not in modules:
            raise ValueError(f"plan entry {name!r} names no module.")
        if style in _COLUMN + ("rowwise",):
            if style == FUSED:
                _check_fused(name, modules[name], plan.parts[name], tp_size)
            else:
                _check_shardable(name, modules[name], style, tp_size)
            region = _region_for(name, modules, holds_row, holds_stack)
            if style in _COLUMN and region and plan.styles.get(region) is None:
                plan.styles[region] = PREPARE
    add_islands(plan, module)
    for name in modules:  # every region and what runs sharded in it (BERT keeps its head count one level down)
        if plan.styles.get(name) == PREPARE or (plan.region_of(name) is not None and name not in plan.islands
                                                 and not under(name, plan.islands)):
            _check_heads(name, modules[name], tp_size)
    if sequence_parallel:
        add_sequence_parallel(plan, module)
    if loss_parallel:
        add_loss_parallel(plan, module, tp_size)
    # parents first: parallelize_module applies them in this order
    plan.styles = dict(sorted(plan.styles.items(), key=lambda kv: (kv[0].count("."), kv[0])))
    return plan


def _region_for(column: str, modules: dict, holds_row: set, holds_stack: set) -> str:
    """The region of a column-wise layer: its nearest ancestor that also holds a row-wise layer (the pair's
    smallest common module: the parent when both are its children, BERT's ``attention`` for ``self.query`` and
    ``output.dense``), never one holding a block stack or container; else its parent (``""``: none)."""
    name = column
    while name:
        name = name.rpartition(".")[0]
        if name in holds_stack:
            break
        if name in holds_row:
            return name
    parent = column.rpartition(".")[0]
    return parent if parent and not isinstance(modules[parent], _NOT_A_BLOCK) else ""


def _is_container(m: nn.Module) -> bool:
    """A ModuleList / ModuleDict, or a Sequential of two or more modules of one class (a stack of blocks)."""
    return isinstance(m, _NOT_A_BLOCK) or (isinstance(m, nn.Sequential) and len(m) >= 2
                                            and len({type(c) for c in m}) == 1)


def _ancestors(names) -> set[str]:
    """Every proper ancestor of the modules ``names`` (``""``, the root, included)."""
    found = set()
    for name in names:
        while name:
            name = name.rpartition(".")[0]
            if name in found:
                break
            found.add(name)
    return found


def add_islands(plan: TensorPlan, module: nn.Module) -> TensorPlan:
    """Inside every region, the topmost modules that hold parameters or buffers and nothing sharded become
    islands: they run on plain tensors, entered and left as replicated DTensors.

    [Note: one layout per region]
    A sharded module's output must reach every consumer in a layout the consumer takes, in backward too:
    a replicated nn.MultiheadAttention or LayerNorm beside a sharded FFN (nn.TransformerEncoderLayer), or a
    row-wise ``value`` whose plain output meets head-sharded q and k in attention (BERT), mix plain tensors
    and DTensors, and DTensor refuses the mix ("got mixed torch.Tensor and DTensor") when the backward
    pass, outside the module's call, reaches them. So every region (a ``prepare`` module: the smallest one
    holding a column-wise layer and its row-wise partner) holds one layout throughout: its inputs enter as DTensors, every sharded module
    in it hands DTensors on (row-wise ones too), each module left replicated in it is an island (plain
    inside, its outputs replicated DTensors again), parameters the region's own code uses directly become
    replicated DTensors, and only the region's outputs leave as plain tensors. Backward runs under
    implicit replication, so constants a region's code builds itself (masks, ``torch.arange``) count as
    replicated there too. Whatever this does not foresee is caught at setup by :mod:`.probe`.
    """
    modules = dict(module.named_modules())
    busy = {n for n, s in plan.styles.items() if s not in (None, "replicate")}
    holds_busy = _ancestors(busy)  # every ancestor of a sharded module (or a region)
    plan.islands = {}
    for name, m in modules.items():  # parents come before their children
        region = plan.region_of(name)
        if region is None or name in busy or name in holds_busy or under(name, plan.islands):
            continue
        if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
            plan.islands[name] = region
            plan.styles.pop(name, None)  # a user's "replicate" inside a region is an island
    return plan


def under(name: str, names) -> bool:
    """Whether an ancestor of module ``name`` is in ``names``."""
    while name:
        name = name.rpartition(".")[0]
        if name in names:
            return True
    return False


def _check_shardable(name: str, m: nn.Module, style: str, t: int) -> None:
    features = linear_features(m) if not isinstance(m, nn.Linear) else (m.in_features, m.out_features)
    if features is not None:
        dim, what = (features[1], "out_features") if style == "colwise" else (features[0], "in_features")
    elif isinstance(m, nn.Embedding):
        dim, what = (m.embedding_dim, "embedding_dim") if style == "colwise" else (m.num_embeddings, "num_embeddings")
    else:
        raise ValueError(f"plan entry {name!r}: style {style!r} applies to nn.Linear (or a transposed linear such "
                         f"as Hugging Face's Conv1D) or nn.Embedding, not {type(m).__name__}. Give it 'replicate' "
                         f"(or 'sequence' for a norm) instead.")
    if dim % t:
        raise ValueError(f"module {name!r} ({type(m).__name__}) has {what}={dim}, which is not divisible by "
                         f"tensor_parallel_size={t}; {style} sharding needs it to be. Choose a tensor_parallel_size "
                         f"that divides {dim}, or map {name!r} to 'replicate' in `plan`.")


def _check_fused(name: str, m: nn.Module, parts: int, t: int) -> None:
    out_features = linear_features(m)[1]
    width = out_features // parts
    if width % t:
        raise ValueError(f"module {name!r} fuses {parts} projections of width {width} (out_features="
                         f"{out_features}); each is split across ranks, so {width} must be divisible by "
                         f"tensor_parallel_size={t}. Choose a tensor_parallel_size that divides {width}, or map "
                         f"{name!r} and its output projection to 'replicate' in `plan`.")


def head_counts(m: nn.Module) -> dict[str, int]:
    """Head counts a module stores as attributes or in its ``config`` (attention modules)."""
    found = {}
    for owner in (m, getattr(m, "config", None)):
        if owner is None:
            continue
        for attr in _HEAD_ATTRS + _KV_HEAD_ATTRS:
            v = getattr(owner, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and attr not in found:
                found[attr] = v
    return found


def query_heads(m: nn.Module) -> int | None:
    """The query-head count ``m`` stores (see :func:`head_counts`), or ``None``."""
    counts = head_counts(m)
    return next((counts[a] for a in _HEAD_ATTRS if counts.get(a, 0) > 0), None)


def _check_heads(name: str, m: nn.Module, t: int) -> None:
    for attr, n in head_counts(m).items():
        if n % t:
            raise ValueError(f"module {name!r} ({type(m).__name__}) has {attr}={n}, which is not divisible by "
                             f"tensor_parallel_size={t}: attention heads are split across tensor-parallel ranks. "
                             f"Choose a tensor_parallel_size that divides {n}, or map the module's projections to "
                             f"'replicate' in `plan`.")


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
    plan = finalize(plan, module, tp_size, sequence_parallel, loss_parallel)
    if not plan.sharded() and not any(s.startswith("vocab") for s in plan.styles.values()):
        warnings.warn(f"tensor parallel: the plan shards no module of {type(module).__name__} (no attention / MLP "
                      f"pair of nn.Linear layers was found); every rank computes the whole model. Give a `plan` "
                      f"{{module_glob: style}} to split it.", stacklevel=2)
    return plan
