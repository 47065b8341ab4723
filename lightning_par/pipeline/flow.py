"""What the blocks of a stack hand each other, learned at setup by tracing one step of the user's code.

[Note: block flow] A stage boundary sends the last block's hidden state, but blocks may hand more to the
blocks after them: Hugging Face T5's first block computes the relative position bias and returns it as
output 1, and the stack passes it to every later block as ``position_bias``. A stage that does not hold
block 0 would never see it (its ghosts return ``None`` there) and trains silently wrong. So at setup,
while every rank still holds the whole module, the user's step runs once on one micro-batch (no grad)
with hooks on every block that record, by identity, what each block returns and what each block takes.
An object first seen as output ``e`` of block ``p`` and taken by a later block ``j`` (other than block
``p + 1``'s hidden state) must travel across every boundary between them: it has to be output ``e'`` of
each block ``b - 1`` before a boundary ``b`` in ``p+1..j`` (T5's blocks return the bias they were given),
and a tensor. Such slots are *carried*: they travel with the hidden state (and their gradients back), and
the ghost standing in for the previous stage's last block returns them where that block would have. What
carrying cannot serve is refused here, naming the blocks and the output: a value that skips a block that
does not return it, or one that is not a tensor. The trace also checks that one step calls each block
at most once, in order from block 0 (a sliced stack ``layers[:k]`` is fine), and finds a second block
stack (T5's decoder, ``nn.Transformer``'s decoder layers), which is not pipelined: it runs whole on the
stages that reach it, and the strategy says so.

The step runs once more than the user asked; its side effects are undone where they are state of the
module: buffers (batch-norm statistics) are restored, torchmetrics objects reset, ``self.log`` captured
by the caller, the RNG restored by the caller.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sysconfig
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import lightning
import lightning_par
from lightning_par.pipeline.discovery import other_stacks
from lightning_par.pipeline.stand_ins import StandIns

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


@dataclass(frozen=True)
class BlockFlow:
    """What one traced step showed of a block stack.

    ``arity[i]``: 0 if block ``i`` returns a tensor, else the length of the tuple it returns; ``carried``:
    the output slots (≥ 1) that travel with the hidden state across stage boundaries; ``warnings``: what
    the strategy should tell the user (a second stack that stays whole); ``hidden_shape``: the shape of block
    0's hidden state in the traced step (``None`` if not a tensor).
    """

    arity: tuple[int, ...]
    carried: tuple[int, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    hidden_shape: tuple[int, ...] | None = None

    def check_stages(self, path: str, bounds: list[tuple[int, int]]) -> None:
        """``ValueError`` unless every stage but the last ends with a block the step calls (a step that runs
        only ``layers[:k]`` leaves the blocks from ``k`` on to the last stage)."""
        called = len(self.arity)
        for k, (lo, hi) in enumerate(bounds[:-1]):
            if hi > called:
                raise ValueError(
                    f"The step calls only the first {called} blocks of `{path}` (of {bounds[-1][1]}), but pipeline "
                    f"stage {k} would end at block {hi - 1}, which never runs, so the stages after it would never "
                    f"receive an activation. Pass `balance=[...]` (blocks per stage) so that the uncalled blocks "
                    f"are on the last stage, or `blocks=` naming the blocks the step uses."
                )


def hidden_name(block: nn.Module) -> str | None:
    """The name of a block's first parameter (the hidden state when passed by keyword)."""
    params = list(inspect.signature(block.forward).parameters.values())
    return params[0].name if params and params[0].kind != params[0].VAR_POSITIONAL else None


def trace_flow(root: nn.Module, path: str, container: nn.Module, step: Callable[[], Any],
               stand_ins: StandIns | None = None) -> BlockFlow:
    """Run ``step`` once (no grad) with hooks on every block of ``container`` (``root``'s ``path``) and
    return the :class:`BlockFlow`; raise ``ValueError`` for what a pipeline cannot run (see [Note: block flow]).
    ``stand_ins``: active during the step, for a meta-built module ([Note: tracing a meta-built module])."""
    calls: list[_Call] = []
    stacks = other_stacks(root, path)
    events: list[tuple[str, int]] = []  # ("block", i) / ("stack", k) in call order

    def pre(i: int, block: nn.Module):
        names = [p.name for p in inspect.signature(block.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        hname = hidden_name(block)

        def hook(module, args, kwargs):
            inputs = [(f"`{names[p]}`" if p < len(names) else f"positional argument {p}", a)
                      for p, a in enumerate(args)]
            inputs += [(f"`{k}`", v) for k, v in kwargs.items()]
            calls.append(_Call(i, inputs, args[0] if args else kwargs.get(hname)))
            events.append(("block", i))
        return hook

    def post(module, args, kwargs, output):
        calls[-1].returns_tuple = isinstance(output, (tuple, list))
        calls[-1].outputs = list(output) if calls[-1].returns_tuple else [output]

    handles = []
    for i, block in enumerate(container):
        handles.append(block.register_forward_pre_hook(pre(i, block), with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    for k, (_, stack) in enumerate(stacks):
        handles.append(stack[0].register_forward_pre_hook(lambda *_, k=k: events.append(("stack", k))))
    try:
        with kept_state(root), torch.no_grad(), no_mha_fastpath(), stand_ins or contextlib.nullcontext():
            step()
    except Exception as error:
        raise RuntimeError(
            f"Pipeline setup runs the step once on one micro-batch, without gradients, to learn what the blocks of "
            f"`{path}` hand each other (see [Note: block flow] in lightning_par/pipeline/flow.py); it raised "
            f"{type(error).__name__}: {error}{failed_line(error, meta=stand_ins is not None)}"
        ) from error
    finally:
        for h in handles:
            h.remove()
    return _analyse(path, len(container), calls, [(n, len(s), type(s[0]).__name__) for n, s in stacks], events)


@dataclass
class _Call:
    """One traced call of block ``index``: its inputs (label, value), its hidden-state argument, its outputs."""

    index: int
    inputs: list
    hidden: Any
    outputs: list = field(default_factory=list)
    returns_tuple: bool = False


def _analyse(path: str, n: int, calls: list[_Call], stacks: list, events: list) -> BlockFlow:
    order = [c.index for c in calls]
    if not order or order != list(range(len(order))):
        shown = order if len(order) <= 12 else order[:12] + ["..."]
        raise ValueError(
            f"One step of the user's code called the blocks of `{path}` in the order {shown}; a pipeline needs "
            f"each block called at most once, in order from block 0 (a sliced stack `layers[:k]` is fine; a block "
            f"called twice or out of order cannot live on one stage). Pass `blocks=` naming a stack that the "
            f"step runs straight through."
        )
    # ids stay unique: `calls` holds every traced object until the analysis ends
    producer: dict[int, tuple[int, int]] = {}  # id of an object first seen as output slot e of block p
    known: set[int] = set()
    carried: set[int] = set()
    outputs = [c.outputs for c in calls]
    for call in calls:
        j = call.index
        for label, value in call.inputs:
            for obj in _flatten(value):
                if id(obj) in producer:
                    p, e = producer[id(obj)]
                    if not (p == j - 1 and e == 0 and obj is call.hidden):
                        carried |= _route(path, obj, p, e, j, label, outputs)
                known.add(id(obj))
        for e, obj in enumerate(call.outputs):
            for o in _flatten(obj):
                if id(o) not in known:
                    producer[id(o)] = (j, e if o is obj else -1)
                    known.add(id(o))
    arity = tuple(len(c.outputs) if c.returns_tuple else 0 for c in calls)
    first = next(k for k, (kind, _) in enumerate(events) if kind == "block")
    last = max(k for k, (kind, _) in enumerate(events) if kind == "block")
    warnings = []
    for k, (name, count, cls) in enumerate(stacks):
        at = [pos for pos, ev in enumerate(events) if ev == ("stack", k)]
        if not at:
            continue
        where = ("runs on every stage, before the pipelined blocks (its compute repeats there; its gradients "
                 "are summed over the stages)" if at[0] < first else
                 "runs whole on the last stage, after the pipelined blocks" if at[0] > last else
                 "runs between pipelined blocks, on the stage of the block after it")
        warnings.append(
            f"`{name}` ({count} × {cls}) is a second block stack: pipeline parallelism splits only `{path}`, and "
            f"`{name}` is not split: it {where}. Pass `blocks='{name}'` to pipeline that stack instead."
        )
    hidden = calls[0].hidden
    return BlockFlow(arity=arity, carried=tuple(sorted(carried)), warnings=tuple(warnings),
                     hidden_shape=tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else None)


def _route(path: str, obj: Any, p: int, e: int, j: int, label: str, outputs: list) -> set[int]:
    """The output slots that carry ``obj`` (output ``e`` of block ``p``, taken by block ``j`` as ``label``)
    across every boundary between them; ``ValueError`` where it cannot travel."""
    what = f"output {e}" if e >= 0 else "a value nested in an output"
    if not isinstance(obj, torch.Tensor):
        raise ValueError(
            f"Block `{path}.{j}` takes {label} = {what} of block `{path}.{p}` (a {type(obj).__name__}); only "
            f"tensors can travel between pipeline stages. Return a tensor there, or compute the value before the "
            f"blocks (every stage runs that code itself)."
        )
    slots = set()
    for b in range(p + 1, j + 1):
        slot = next((s for s, o in enumerate(outputs[b - 1]) if o is obj), None)
        if slot is None:
            raise ValueError(
                f"Block `{path}.{j}` takes {label} = {what} of block `{path}.{p}`, which block `{path}.{b - 1}` "
                f"does not return: a stage boundary before block {b} could not carry it (only what the block "
                f"before a boundary returns travels with the hidden state). Return it from every block in "
                f"between, or compute it before the blocks."
            )
        if slot:
            slots.add(slot)
    return slots


def _flatten(value: Any) -> list:
    """The objects in ``value`` whose identity can be followed: tensors and other objects, inside tuples,
    lists and dicts (not numbers, strings, ``None``, dtypes or devices)."""
    if isinstance(value, _ATOMS):
        return []
    if isinstance(value, (tuple, list)):
        return [o for v in value for o in _flatten(v)]
    if type(value) is dict:
        return [o for v in value.values() for o in _flatten(v)]
    return [value]


class no_mha_fastpath:
    """[Note: MHA fast path] Without grad (evaluation), ``nn.TransformerEncoder`` may pack its input into a
    nested tensor when its first layer allows the fast path, and its layers then run on nested tensors: a
    stage would have to send one, and a stage whose layer 0 is a ghost would drop the padding mask. Torch's
    switch for that path is off while a pipeline stage runs the user's step (restored after it); the regular
    path computes the same values (within float rounding). With grad (training) the fast path never runs."""

    def __enter__(self):
        self.was = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)

    def __exit__(self, *exc):
        torch.backends.mha.set_fastpath_enabled(self.was)


@contextlib.contextmanager
def kept_state(root: nn.Module):
    """Undo what a run of the user's step at setup leaves in the module: its buffers (batch-norm statistics)
    are restored and its torchmetrics objects reset."""
    buffers = {name: b.detach().clone() for name, b in root.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in root.named_buffers():
                if name in buffers and buffers[name].shape == b.shape:
                    b.copy_(buffers[name])
        _reset_metrics(root)


_INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, lightning, lightning_par))
_STDLIB = tuple(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib"))
_PACKAGES = tuple(sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib"))


def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_INTERNAL) or (path.startswith(_STDLIB) and not path.startswith(_PACKAGES))


def failed_line(error: BaseException, *, meta: bool) -> str:
    """[Note: the line that failed] The innermost frame of ``error``'s traceback outside torch, lightning_par
    and Python's library: the line of the user's module (or of a library it calls, such as transformers) whose
    operation failed, as ``, at FILE:LINE in FUNC: CODE``, then the workaround for a meta-built module (``meta``:
    its parameters were zeros in the trace, see [Note: tracing a meta-built module]); "" without such a frame."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not _internal(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    text = f", at {f.filename}:{f.lineno} in `{f.name}`: `{(f.line or '').strip()}`."
    if meta:
        text += (" The module was built on the meta device, so the trace computed with zero-filled stand-ins of "
                 "its parameters (values from the batch are real; see [Note: tracing a meta-built module] in "
                 "lightning_par/pipeline/stand_ins.py). If that line needs a value computed from the weights, make "
                 "it depend on the batch only, or build the module with real weights "
                 "(`trainer.init_module(empty_init=False)`; `weights=` is read into it as before).")
    return text


def _reset_metrics(root: nn.Module) -> None:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover
        return
    for m in root.modules():
        if isinstance(m, Metric):
            m.reset()
