"""The last layer of a tensor-parallel plan (:func:`finalize`): the regions (``prepare`` entries) of the
column-wise layers and the islands inside them, the block styles of sequence parallelism, the vocabulary
styles of loss parallelism, and every sharded dimension and head count checked against the tensor-parallel
size. Pure, as :mod:`.plan`."""
from __future__ import annotations

import warnings

from torch import nn

from lightning_par.tensor.layers import (_check_fused, _check_heads, _check_shardable, is_norm,
                                         multihead_attention_modules)
from lightning_par.tensor.plan import (_COLUMN, _NOT_A_BLOCK, BLOCK, FUSED, LAST_BLOCK, PREPARE, VOCAB_EMBEDDING,
                                       VOCAB_HEAD, TensorPlan, _natural, under)


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
