"""Activation checkpointing of a module's block stacks: each chosen block keeps only its inputs in forward and
recomputes its forward in backward.

    >>> check_activation_checkpointing("full"), check_activation_checkpointing(2)
    ('full', 2)
    >>> applied = apply_activation_checkpointing(model, "full")     # doctest: +SKIP
    >>> applied.blocks                                               # doctest: +SKIP
    ['transformer.h.0', 'transformer.h.1']
    >>> applied.undo()                                               # doctest: +SKIP

Values (the strategies' ``activation_checkpointing=``):

- ``None``: nothing recomputes.
- ``"full"``: every block of every stack.
- an int ``k >= 1``: the blocks whose index in their stack is a multiple of ``k`` (``k = 1`` is ``"full"``); the
  index counts per stack (T5's encoder and decoder each from 0), never per pipeline stage.
- ``"selective"``: every block, op by op: the outputs of matrix products, attention kernels and reducing
  collectives are kept from forward, the rest (norms, activations, softmax, dropout, adds) is recomputed
  ([Note: the selective policy]).

The stacks are the pipeline's ([Note: which blocks] below). The mechanism is torch's composable, non-reentrant
checkpoint: forward hooks on each block, no wrapper module, so parameter names and checkpoints are unchanged;
dropout draws the same masks in recompute (the RNG state is saved at the block's entry); keyword and non-tensor
arguments pass through; under ``torch.no_grad`` (validation, predict) nothing is saved and nothing recomputes.

[Note: which blocks]
The block stack is the one the pipeline cuts (:func:`lightning_par.pipeline.discovery.find_blocks`, ``blocks=`` to
name it), plus every other stack of blocks that have submodules (:func:`~lightning_par.pipeline.discovery.
other_stacks`: T5's decoder beside its encoder). A pipeline's ghosts (other stages' blocks) hold nothing to
recompute and are skipped. A block is a unit of recompute: what lies between blocks (embeddings, the head, the
loss) is kept as always.

[Note: the selective policy]
torchtitan's op-level selective checkpointing (``_op_sac_save_list``) keeps the outputs of ``mm``, the fused
attention kernels and ``reduce_scatter``, and recomputes everything else; we keep the same ops and the other
matrix products a Linear with bias or a batched attention dispatches to on CPU (``addmm``, ``bmm``, ``baddbmm``),
the CPU flash-attention kernel, tensor parallelism's all-reduce and context parallelism's attention ops (keeping
their outputs spares recomputing a collective, [Note: one op for activation checkpointing]). Unlike torchtitan we
keep every matmul output, not every second one: "selective" sits between off and full on both memory and time;
"every k-th block" is the finer knob. ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with this
policy is passed as the composable checkpoint's ``context_fn`` (checked on torch 2.13: the saved ops are not run
again in backward).

[Note: no key-value cache while recomputing]
A Hugging Face model called in training with its default ``use_cache=True`` builds a key-value cache in forward
(T5 appends each layer's keys and values); a checkpointed block's recompute appends them again, so torch's
checkpoint sees a different number of saved tensors and raises ``CheckpointError`` in the first backward. Hugging
Face's own ``gradient_checkpointing_enable()`` turns ``use_cache`` off while training, with one warning; so do we:
every module of the tree that has a ``config.use_cache`` and takes ``use_cache`` gets a forward pre-hook that, in
training mode with gradients on, calls it with ``use_cache=False`` (one warning per application), removed with the
checkpointing (:func:`use_cache_off`). Evaluation and generation keep the cache.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import lightning_par.context.attention  # noqa: F401  - registers the context-parallel attention ops listed below
from lightning_par._compat import composable_checkpoint, is_checkpointed
from lightning_par.pipeline.discovery import find_blocks, other_stacks
from lightning_par.pipeline.ghost import Ghost

MODES = ("full", "selective")
Value = Union[None, int, str]


def check_activation_checkpointing(value: Any) -> Value:
    """``value`` if it is an ``activation_checkpointing`` setting (None, "full", "selective" or an int >= 1), else a
    ValueError naming it and the choices.

        >>> check_activation_checkpointing(0)
        Traceback (most recent call last):
        ...
        ValueError: `activation_checkpointing=0` is not a setting: choose None (off), 'full' (every block recomputes \
its forward in backward), an int k >= 1 (blocks whose index % k == 0) or 'selective' (keep matmul and attention \
outputs, recompute the rest).
    """
    if value is None or (isinstance(value, str) and value in MODES):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(
        f"`activation_checkpointing={value!r}` is not a setting: choose None (off), 'full' (every block recomputes "
        f"its forward in backward), an int k >= 1 (blocks whose index % k == 0) or 'selective' (keep matmul and "
        f"attention outputs, recompute the rest).")


def _ops(*names: str) -> frozenset:
    """The ``torch.ops`` overloads named ``namespace.op.overload`` that this build of torch has."""
    found = set()
    for name in names:
        ns, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None) if hasattr(torch.ops, ns) else None
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


# [Note: the selective policy]
SAVED_OPS = _ops(
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default", "aten._scaled_mm.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_reduce.default",
    "lightning_par.context_attention_allgather.default", "lightning_par.context_attention_ring.default",
)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The forward and recompute contexts of one checkpointed call under the selective policy (nothing under
    ``torch.no_grad``: nothing is saved there)."""
    if not torch.is_grad_enabled():
        return contextlib.nullcontext(), contextlib.nullcontext()
    return create_selective_checkpoint_contexts(_policy)


@dataclass
class Checkpointed:
    """What :func:`apply_activation_checkpointing` did: the blocks it checkpointed (dotted names) and the undo."""

    mode: Value = None
    blocks: list[str] = field(default_factory=list)
    _undos: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def undo(self) -> None:
        """Take checkpointing out of every block (the module computes as before it was applied)."""
        while self._undos:
            self._undos.pop()()
        self.blocks = []


def block_stacks(module: nn.Module, blocks: Optional[str] = None, *, value: Value = "full",
                 owner: str = "the strategy") -> list[tuple[str, nn.Module]]:
    """The stacks whose blocks checkpointing applies to ([Note: which blocks]); a ValueError naming ``blocks=``
    when there is none."""
    try:
        path, stack = find_blocks(module, blocks)
    except ValueError as err:
        raise ValueError(
            f"`activation_checkpointing={value!r}` recomputes the blocks of a repeated block stack, and {err} "
            f"Name the stack with `blocks='...'` ({owner}'s option: the dotted name of an nn.ModuleList / "
            f"nn.Sequential of the model's layers), or set activation_checkpointing=None.") from None
    return [(path, stack), *other_stacks(module, path)]


def apply_activation_checkpointing(module: nn.Module, value: Value, *, blocks: Optional[str] = None,
                                   owner: str = "the strategy") -> Checkpointed:
    """Checkpoint the blocks of ``module``'s stacks as ``value`` says (see the module docstring); returns what was
    done, with its undo. ``blocks``: the main stack's dotted name (None: found). Call it before FSDP wraps the
    blocks, and after a pipeline stage installs its hooks (they then run first: a block's RNG state is saved
    after the stage reseeds it)."""
    value = check_activation_checkpointing(value)
    done = Checkpointed(mode=value)
    if value is None:
        return done
    context_fn = selective_contexts if value == "selective" else None
    every = value if isinstance(value, int) else 1
    for path, stack in block_stacks(module, blocks, value=value, owner=owner):
        for i, block in enumerate(stack):
            if i % every or isinstance(block, Ghost):
                continue
            name = f"{path}.{i}" if path else str(i)
            if is_checkpointed(block):
                done.undo()
                raise RuntimeError(f"Block {name} of {type(module).__name__} is checkpointed already (by another "
                                   f"run that did not take it out); build a fresh module.")
            done._undos.append(composable_checkpoint(block, context_fn))
            done.blocks.append(name)
    done._undos.append(use_cache_off(module))  # [Note: no key-value cache while recomputing]
    return done


def use_cache_off(module: nn.Module) -> Callable[[], None]:
    """[Note: no key-value cache while recomputing]: Hugging Face modules in ``module`` are called with
    ``use_cache=False`` in training (one warning); returns the undo."""
    import inspect
    import warnings

    warned: list[bool] = []

    def pre(mod, args, kwargs):
        if not (mod.training and torch.is_grad_enabled()):
            return None
        asked = kwargs.get("use_cache")
        if asked is False or (asked is None and not getattr(mod.config, "use_cache", False)):
            return None
        if not warned:
            warned.append(True)
            warnings.warn(f"activation checkpointing: {type(mod).__name__} is called with use_cache=True, which is "
                          f"incompatible with recomputing its blocks; it runs with use_cache=False while training "
                          f"(as Hugging Face's gradient_checkpointing_enable() does). Pass use_cache=False to "
                          f"silence this.", stacklevel=2)
        return args, {**kwargs, "use_cache": False}

    handles = []
    for m in module.modules():
        if not isinstance(getattr(getattr(m, "config", None), "use_cache", None), bool):
            continue
        try:
            takes = "use_cache" in inspect.signature(m.forward).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))

    def undo():
        for h in handles:
            h.remove()
    return undo


__all__ = ["MODES", "SAVED_OPS", "Checkpointed", "apply_activation_checkpointing", "block_stacks",
           "check_activation_checkpointing", "selective_contexts", "use_cache_off"]
