"""Compiled blocks: each block of a module's block stacks runs a ``torch.compile``'d forward, one graph serving
every block of one configuration (torchtitan's per-block compile).

    >>> check_compile(True), check_compile("aot_eager"), check_compile({"mode": "max-autotune-no-cudagraphs"})
    (True, 'aot_eager', {'mode': 'max-autotune-no-cudagraphs'})
    >>> compile_keywords(True), compile_keywords("aot_eager"), compile_keywords(False)
    ({}, {'backend': 'aot_eager'}, None)
    >>> check_compile("inductr")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `compile='inductr'` is not a torch.compile backend ...
    >>> done = apply_compile(model, compile_keywords(True))   # doctest: +SKIP
    >>> done.blocks                                           # doctest: +SKIP
    ['transformer.h.0', 'transformer.h.1']

Values (the strategies' ``compile=``): ``False`` nothing compiled; ``True`` ``torch.compile``'s defaults
(inductor); a backend name (``"aot_eager"``: the same kernels as eager, traced); a dict of ``torch.compile``
keywords (``{"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "fullgraph": True}``).

[Note: what is compiled]
The unit is a block of the stacks activation checkpointing recomputes and FSDP shards (the pipeline's
:func:`~lightning_par.pipeline.discovery.find_blocks` stack, ``blocks=`` to name it, and every other stack:
[Note: which blocks] in :mod:`lightning_par.memory.checkpointing`). Each block's ``forward`` is replaced by an
instance attribute, the class's ``forward`` compiled and bound to the block; the module tree, the parameter names,
the state dict and the checkpoints are those of the eager module. The compiled function is one per block class, and
dynamo's cache is per code object, so the blocks of one class share one graph for one input configuration (shapes,
dtypes, grad mode): a family that alternates layer types (sliding and full attention) gets one graph per type,
not one per block. The block's ``__call__`` stays eager: the hooks this package puts on a block (activation
checkpointing's, a pipeline stage's, context parallel's) run around the compiled forward, not inside it, so they
need not be traceable and ``fullgraph=True`` holds; tensor parallelism's hooks on the linear layers inside a block
are torch's own (``distribute_module``) and are traced with it. The ends (embeddings, head, loss, the user's
``training_step`` and ``self.log``) stay eager: they run once a step, not once a block, and logging under compile
is where Lightning's users meet breakage.

[Note: a region in a compiled block]
A tensor plan's region (:class:`~lightning_par.tensor.parallelize.PrepareBlockInput`, the attention or the MLP of a
block) runs its code under DTensor's implicit replication and a torch function mode that splits attention masks by
head. Entered in the region's hooks, inside the compiled forward, the first is a graph break (dynamo cannot trace
the dispatcher's flag), two per region, so a block's graph falls into pieces. A block that holds a region therefore
runs its compiled forward inside both, entered eagerly around the compiled frame, and the hooks, seeing
``torch.compiler.is_compiling()``, enter nothing: dynamo traces the block's regions with the flag set and the mode
on its stack, and the graph it makes runs plain tensors (the DTensor code is traced away), whatever the flag.
Around a whole block rather than a region, both change nothing: code outside the regions meets no DTensor, and the
mode only acts on attention whose query is head-split.

[Note: the order]
torchtitan's: after the tensor plan, context parallel and activation checkpointing are applied, before FSDP2 or
DDP wrap the module. The tensor plan first, so the graph is traced on the DTensor blocks; FSDP2 last, so its
hooks (all-gather, reshard) stay eager around the compiled forwards; compilation itself is lazy (the first call
traces), so a meta-built module compiles after its weights are placed.

[Note: a module the user compiled]
A user compiles in one of two ways: blocks wrapped by ``torch.compile`` (an ``OptimizedModule`` in the block list,
its parameters renamed ``..._orig_mod...``) or ``trainer.fit(torch.compile(module))`` (Lightning's
``from_compiled`` keeps the module and compiles its forward and ``*_step`` methods). Neither survives a parallel
layout as it is: a tensor plan does not see through ``_orig_mod``, and a compiled ``training_step`` crashes under
DDP. :func:`take_user_compile` undoes both (the ``OptimizedModule`` replaced by the block it wraps, the
LightningModule's methods restored by the strategy) and returns the compiler the user built, keywords and all
(``torch.compile``'s own ``OptimizeContext``), which :func:`apply_compile` then applies per block, as
``compile=True`` does. The module is then parallelized as the uncompiled module would be, names and all.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from lightning_par._compat import (compile_backends, compile_modes, is_optimized_module, optimized_original,
                                   user_compiler)
from lightning_par.pipeline.discovery import find_blocks, other_stacks
from lightning_par.pipeline.ghost import Ghost
from lightning_par.tensor.parallelize import holds_region

Value = Union[bool, str, Mapping[str, Any]]
Compiler = Callable[[Callable], Callable]  # a function -> its compiled version


def _compile_keywords_taken() -> set[str]:
    return {n for n, p in inspect.signature(torch.compile).parameters.items() if p.kind == p.KEYWORD_ONLY}


def check_compile(value: Any) -> Value:
    """``value`` as the strategies keep it (a mapping as a plain dict), or a ValueError naming it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        _check_backend(value, value)
        return value
    if isinstance(value, Mapping):
        kwargs = {str(k): v for k, v in value.items()}
        taken = _compile_keywords_taken()
        unknown = sorted(set(kwargs) - taken)
        if unknown:
            raise ValueError(f"`compile={kwargs!r}`: torch.compile takes no keyword {unknown[0]!r}; it takes "
                             f"{', '.join(sorted(taken))}.")
        backend, mode = kwargs.get("backend"), kwargs.get("mode")
        if isinstance(backend, str):
            _check_backend(backend, kwargs)
        elif backend is not None and not callable(backend):
            raise ValueError(f"`compile={kwargs!r}`: `backend` must be a backend name or a callable, got "
                             f"{backend!r}.")
        if mode is not None and mode not in compile_modes():
            raise ValueError(f"`compile={kwargs!r}`: {mode!r} is not a torch.compile mode; choose one of "
                             f"{', '.join(repr(m) for m in compile_modes())}.")
        if mode is not None and kwargs.get("options") is not None:
            raise ValueError(f"`compile={kwargs!r}`: torch.compile takes `mode` or `options`, not both.")
        return kwargs
    raise ValueError(f"`compile={value!r}` must be False, True (torch.compile's defaults: inductor), a backend name "
                     f"(e.g. 'aot_eager') or a dict of torch.compile keywords (e.g. {{'mode': "
                     f"'max-autotune-no-cudagraphs'}}).")


def _check_backend(backend: str, value: Any) -> None:
    names = compile_backends()
    if backend not in names:
        raise ValueError(f"`compile={value!r}` is not a torch.compile backend here ({backend!r}); choose one of "
                         f"{', '.join(repr(n) for n in names)}.")


def compile_keywords(value: Value) -> Optional[dict[str, Any]]:
    """The ``torch.compile`` keywords ``value`` stands for (None: nothing compiled)."""
    value = check_compile(value)
    if value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, str):
        return {"backend": value}
    return dict(value)


def compiler_of(value: Value, user: Optional[Compiler] = None) -> Optional[Compiler]:
    """What compiles a block's forward: ``torch.compile`` with ``value``'s keywords, else the user's own compiler
    ([Note: a module the user compiled]), else None."""
    kwargs = compile_keywords(value)
    if kwargs is not None:
        return lambda fn: torch.compile(fn, **kwargs)
    return user


@dataclass
class UserCompile:
    """What :func:`take_user_compile` undid: the compiler (None: the user compiled nothing) and where it was."""

    compiler: Optional[Compiler] = None
    unwrapped: list[str] = field(default_factory=list)  # the OptimizedModules replaced by what they wrapped
    whole_module: bool = False  # the LightningModule itself (``trainer.fit(torch.compile(module))``)


def take_user_compile(module: nn.Module) -> UserCompile:
    """Undo the user's ``torch.compile`` inside ``module`` ([Note: a module the user compiled]): every
    ``OptimizedModule`` below it is replaced by the module it wraps. ``whole_module`` says the module itself was
    compiled through Lightning (its methods are the caller's to restore: ``to_uncompiled``)."""
    taken = UserCompile()
    ctx = user_compiler(module)
    if ctx is not None:
        taken.compiler, taken.whole_module = ctx, True
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if is_optimized_module(child):
                original = optimized_original(child)
                taken.compiler = taken.compiler or user_compiler(child)
                setattr(parent, name, original)
                taken.unwrapped.append(f"{parent_name}.{name}" if parent_name else name)
    return taken


@dataclass
class Compiled:
    """What :func:`apply_compile` did: the blocks whose forward is compiled (dotted names) and the undo."""

    blocks: list[str] = field(default_factory=list)
    _undos: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def undo(self) -> None:
        """The blocks' own (eager) forward back."""
        while self._undos:
            self._undos.pop()()
        self.blocks = []


_COMPILED = "_lightning_par_compiled"  # the mark on a block whose forward this module compiled


def is_compiled(block: nn.Module) -> bool:
    return _COMPILED in vars(block)


def compile_stacks(module: nn.Module, blocks: Optional[str] = None, *, what: str = "compile=True",
                   owner: str = "the strategy") -> list[tuple[str, nn.Module]]:
    """The stacks whose blocks are compiled ([Note: what is compiled]); a ValueError naming ``blocks=`` when there
    is none."""
    try:
        path, stack = find_blocks(module, blocks)
    except ValueError as err:
        raise ValueError(f"`{what}` compiles the blocks of a repeated block stack, and {err} Name the stack with "
                         f"`blocks='...'` ({owner}'s option: the dotted name of an nn.ModuleList / nn.Sequential of "
                         f"the model's layers), or leave compile off.") from None
    return [(path, stack), *other_stacks(module, path)]


def compile_what(value: Value, user: Optional[UserCompile] = None) -> str:
    """What a refusal names as the compile asked for: the keyword, or the user's own ``torch.compile``."""
    if value is not False or user is None:
        return f"compile={value!r}"
    return "torch.compile (the module's, which the strategy applies to each block)"


def apply_compile(module: nn.Module, compiler: Optional[Compiler], *, blocks: Optional[str] = None,
                  what: str = "compile=True", owner: str = "the strategy") -> Compiled:
    """Compile the forward of every block of ``module``'s stacks with ``compiler`` (:func:`compiler_of`), in place
    ([Note: what is compiled]); a block compiled before is compiled anew. Call it after the tensor plan, context
    parallel and activation checkpointing, before FSDP / DDP wrap the module ([Note: the order])."""
    done = Compiled()
    if compiler is None:
        return done
    by_class: dict[type, Callable] = {}
    for path, stack in compile_stacks(module, blocks, what=what, owner=owner):
        for i, block in enumerate(stack):
            if isinstance(block, Ghost):  # another pipeline stage's block: nothing runs here
                continue
            if is_compiled(block):
                uncompile_block(block)
            cls = type(block)
            if cls not in by_class:
                by_class[cls] = compiler(cls.forward)
            if holds_region(block):  # [Note: a region in a compiled block]
                block.forward = types.MethodType(_in_region_context(by_class[cls]), block)
            else:
                block.forward = types.MethodType(by_class[cls], block)
            setattr(block, _COMPILED, True)
            done._undos.append(lambda block=block: uncompile_block(block))
            done.blocks.append(f"{path}.{i}" if path else str(i))
    return done


def _in_region_context(compiled: Callable) -> Callable:
    """``compiled`` called under the tensor regions' context, entered eagerly around the compiled frame."""
    from lightning_par.tensor.parallelize import region_context

    def forward(self, *args, **kwargs):
        with region_context():
            return compiled(self, *args, **kwargs)

    return forward


def uncompile_block(block: nn.Module) -> None:
    for name in ("forward", _COMPILED):
        if name in vars(block):
            delattr(block, name)


__all__ = ["Compiled", "UserCompile", "apply_compile", "check_compile", "compile_keywords", "compile_stacks", "compile_what",
           "compiler_of", "is_compiled", "take_user_compile", "uncompile_block"]
