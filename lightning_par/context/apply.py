"""Context parallelism for an unchanged module: its block stack runs on this rank's piece of every sequence.

    applied = apply_context_parallel(model, group)
    loss = loss_fn(model(idx), targets)                 # the same loss on every rank of the group
    loss.backward()                                     # then average the gradients over the group
    applied.remove()                                    # no hook, no mode left behind

[Note: where the sequence is cut]
The block stack is the pipeline's (:func:`~lightning_par.pipeline.discovery.find_blocks`). What enters a block from
outside the stack was computed by the module on the whole sequence (hidden states from the embeddings, rotary
cos/sin, position ids, masks), and what a block hands the next (its outputs, tracked by identity as the block
flow does, [Note: block flow]) is already this rank's piece. So every block's forward pre-hook cuts the tensors
it receives that are whole: the hidden state (the block's first argument) along ``seq_dim``; any other tensor along
its one dimension of the sequence's length ``S``; a square mask ``[..., S, S]`` along its query rows (dim −2), its
key columns kept whole for the attention to pick from; a key mask ``[..., 1, S]`` is kept whole. A tensor with
``S`` in several other dimensions (a batch size or a width equal to ``S``) is ambiguous and refused, naming the
block and the argument. While a block runs, its SDPA calls are routed to attention across the group ([Note:
routing SDPA]). The last block's forward hook gathers its output back to the whole sequence, so that what comes
after the stack (final norm, head, loss) runs unchanged, on every rank alike ([Note: gradients under context
parallelism]: average the gradients over the group). Positions and masks stay right without changing the module,
since it computed them on the whole sequence before cutting. A tensor is cut once, however many blocks receive it
(the rotary cos/sin): its piece is kept while the whole tensor lives, and a checkpoint's recompute takes the same
piece, so that it replays the forward's operations and no others (selective checkpointing checks that; there is no
collective in a cut; the gather is skipped in recompute, whose output is discarded).

[Note: context parallelism inside pipeline stages]
A pipeline stage runs a range of the stack's blocks (the others are ghosts), and ``ranges`` names the ranges this
rank runs. Each range is treated as a stack of its own: its first block receives whole tensors (the hidden state
from the previous stage, or the embeddings) and cuts them, its last block gathers, so what crosses a stage
boundary is the whole hidden state, as without cp: the stage's point-to-point transfers, their shapes and the
traced block flow stay as they are, and each rank of a cp group talks to the rank of the next stage with its cp
coordinate. (Keeping the pieces between stages would halve nothing that matters at these sizes and would make
every receive's shape depend on cp.) Only the stack's last block gathers with ``grad_scale = cp``; a range
that ends inside the stack gathers with ``1``: the gradient coming back from the next stage is that stage's cut's
backward, already scaled and zero outside this rank's positions, so scaling again would count ``cp`` twice. The
gather's hook must run after the block's other forward hooks (a tensor-parallel region's, which makes the output
plain) and before the stage's own, which sends and raises ``StopStage``: the stage registers its sending hooks
again after cp's (``StageRuntime.send_last``). As ``StopStage`` is a ``BaseException``, which a module's
always-call hooks do not see, the stage's step runs inside :meth:`ContextParallel.guard`, which leaves any routing
mode still entered.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_par._compat import attn_implementation, current_autograd_node
from lightning_par.context.attention import METHODS
from lightning_par.context.intercept import RouteAttention
from lightning_par.context.loss import ShardedCrossEntropy
from lightning_par.context.sharding import check_divisible, gather, shard
from lightning_par.context.ulysses import UlyssesRoute

CP_METHODS = (*METHODS, "ulysses")  # [Note: all-gather or ring], [Note: Ulysses]
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.pipeline.flow import hidden_name


def check_sdpa(module: nn.Module) -> None:
    """``ValueError`` naming a Hugging Face (sub)module whose attention implementation is not SDPA."""
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        impl = attn_implementation(config)
        if impl is not None and impl != "sdpa":
            raise ValueError(
                f"Context parallelism routes the blocks' `scaled_dot_product_attention` calls across the group, and "
                f"`{name or type(sub).__name__}` ({type(sub).__name__}) uses attn_implementation={impl!r}, whose "
                f"attention cannot be intercepted. Build the model with `attn_implementation=\"sdpa\"` (e.g. "
                f"`AutoModelForCausalLM.from_config(config, attn_implementation=\"sdpa\")`).")


def _hf_configs(block: nn.Module) -> list:
    """The configs of the Hugging Face attention modules inside ``block`` (each once)."""
    from lightning_par.context.probe import hf_attention_modules

    configs = {}
    for name in hf_attention_modules(block):
        config = block.get_submodule(name).config
        configs[id(config)] = config
    return list(configs.values())


def _in_backward() -> bool:
    return current_autograd_node() is not None


@dataclass
class ContextParallel:
    """What :func:`apply_context_parallel` installed: the stack's dotted name, its hooks, and :meth:`remove`."""

    path: str
    group: Any
    method: str
    seq_dim: int
    _handles: list = field(default_factory=list, repr=False)
    _modes: list = field(default_factory=list, repr=False)
    _local: dict = field(default_factory=dict, repr=False)   # id -> weakref of tensors that are this rank's piece
    _cuts: dict = field(default_factory=dict, repr=False)    # id -> (weakref of a whole tensor, its piece)
    _fresh: set = field(default_factory=set, repr=False)     # where the last forward cut (not from _cuts)
    _seq: int | None = None
    _lead: tuple = ()  # the whole sequence's leading shape ([B, S] batch first), for the loss's labels
    ends_stack: bool = True  # the hooks' last block is the stack's last (not a pipeline stage's)
    loss: Any = None  # sharded to the loss: check_sharded_loss's LossCheck ([Note: sharded to the loss])
    _loss_mode: Any = None  # the ShardedCrossEntropy of the step running, while sharded_loss() is entered

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def remove(self) -> None:
        """Take every hook out and exit any routing mode still entered (a forward interrupted between hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._leave(0)
        self._local.clear()
        self._cuts.clear()
        self._fresh.clear()

    def _leave(self, depth: int) -> None:
        while len(self._modes) > depth:
            self._modes.pop()[1].__exit__(None, None, None)

    @contextlib.contextmanager
    def sharded_loss(self, probe: bool = False):
        """While entered (the training step), the stack's output stays this rank's piece and a per-token
        cross-entropy of it runs on the pieces ([Note: sharded to the loss] in lightning_par/context/loss.py), where
        the setup check found it serves (``probe``: the check's own run, whatever it found); yields the mode
        (``calls``: the cross-entropies it served), None where the stack gathers."""
        if not self.ends_stack or not (probe or (self.loss is not None and self.loss.sharded)):
            yield None
            return
        depth = len(self._modes)
        self._loss_mode = ShardedCrossEntropy(self.group, (), self.seq_dim)
        try:
            yield self._loss_mode
        finally:
            self._loss_mode = None
            self._leave(depth)

    @contextlib.contextmanager
    def guard(self):
        """Leaves every routing mode entered inside it, whichever exception (a ``BaseException`` too) ends it
        ([Note: context parallelism inside pipeline stages])."""
        depth = len(self._modes)
        try:
            yield
        finally:
            self._leave(depth)

    # -- tracking --------------------------------------------------------------------------------------------
    def _is_local(self, t: torch.Tensor) -> bool:
        ref = self._local.get(id(t))
        return ref is not None and ref() is t

    def _mark_local(self, t: torch.Tensor) -> None:
        key = id(t)
        self._local[key] = weakref.ref(t, lambda _, key=key: self._local.pop(key, None))

    # -- cutting ---------------------------------------------------------------------------------------------
    def _cut(self, t: torch.Tensor, dim: int, where: str) -> torch.Tensor:
        """``t``'s piece: cut once while ``t`` lives; a recompute cuts again exactly where its forward cut (at
        ``where``: the block and the argument), so that it replays the forward's operations and no others."""
        key = id(t)
        hit = self._cuts.get(key)
        cached = hit is not None and hit[0]() is t
        if _in_backward():
            if cached and where not in self._fresh:
                return hit[1]
        elif cached:
            self._fresh.discard(where)
            return hit[1]
        piece = shard(t, dim, self.size, dist.get_rank(self.group))
        if not _in_backward():
            self._cuts[key] = (weakref.ref(t, lambda _, key=key: self._cuts.pop(key, None)), piece)
            self._fresh.add(where)
        self._mark_local(piece)
        return piece

    def _cut_dim(self, t: torch.Tensor, seq: int, where: str) -> int | None:
        """The dimension of ``t`` to cut, or None to keep it whole ([Note: where the sequence is cut])."""
        dims = [d for d, n in enumerate(t.shape) if n == seq]
        nd = t.dim()
        if not dims or (nd >= 3 and dims == [nd - 1] and t.shape[-2] == 1):
            return None
        if len(dims) == 1:
            return dims[0]
        if dims == [nd - 2, nd - 1]:
            return None if self.method == "ulysses" else nd - 2  # Ulysses attends over the whole mask
        raise ValueError(
            f"Context parallelism cuts what enters {where} along the sequence (length {seq}), and this tensor of "
            f"shape {tuple(t.shape)} has that length in dimensions {dims}: which one is the sequence is ambiguous. "
            f"Use a batch size and widths other than the sequence length {seq}.")

    def _cut_value(self, value, seq: int, where: str):
        if isinstance(value, torch.Tensor):
            if self._is_local(value) or value.dim() == 0:
                return value
            dim = self._cut_dim(value, seq, where)
            return value if dim is None else self._cut(value, dim, where)
        if type(value) in (tuple, list):
            return type(value)(self._cut_value(v, seq, f"{where}[{i}]") for i, v in enumerate(value))
        if type(value) is dict:
            return {k: self._cut_value(v, seq, f"{where}[{k!r}]") for k, v in value.items()}
        return value

    # -- hooks -----------------------------------------------------------------------------------------------
    def _pre(self, first: bool, name: str, block: nn.Module) -> Callable:
        hname = hidden_name(block)
        labels = [p.name for p in inspect.signature(block.forward).parameters.values()]

        def hook(block, args, kwargs):
            hidden = args[0] if args else kwargs.get(hname)
            if not isinstance(hidden, torch.Tensor):
                raise ValueError(f"Context parallelism cuts the hidden state of block `{name}`, its first argument "
                                 f"{'`' + hname + '` ' if hname else ''}; it received a {type(hidden).__name__}.")
            length = hidden.shape[self.seq_dim]
            if not first and (self._is_local(hidden) or (self._seq is not None and length * self.size == self._seq)):
                seq = length * self.size
            else:
                seq = length
                check_divisible(seq, self.size, f"the sequence entering `{name}` (dimension {self.seq_dim} of its "
                                                f"hidden state, shape {tuple(hidden.shape)})")
                if not _in_backward():
                    self._seq = seq
                    self._lead = tuple(hidden.shape[:self.seq_dim + 1])
                hidden = self._cut(hidden, self.seq_dim, f"`{name}`'s hidden state")
            new_args = [hidden if p == 0 else self._cut_value(
                a, seq, f"`{name}` as {labels[p] if p < len(labels) else f'positional argument {p}'}")
                for p, a in enumerate(args)]
            new_kwargs = {k: hidden if (not args and k == hname) else self._cut_value(v, seq, f"`{name}` as `{k}`")
                          for k, v in kwargs.items()}
            mode = UlyssesRoute(self.group, _hf_configs(block)) if self.method == "ulysses" else RouteAttention(
                self.group, self.method)
            mode.__enter__()
            self._modes.append((block, mode))
            return tuple(new_args), new_kwargs
        return hook

    def _post(self, name: str, last: bool, grad_scale: float) -> Callable:
        def hook(block, args, kwargs, output):
            if not self._modes or self._modes[-1][0] is not block:
                return None  # its pre-hook raised: no mode was entered
            mode = self._modes.pop()[1]
            mode.__exit__(None, None, None)
            if output is None:
                return None  # the forward raised (or a checkpoint's recompute stopped early)
            if mode.calls == 0:
                served = ("`torch.nn.functional.scaled_dot_product_attention` or a Hugging Face attention module"
                          if self.method == "ulysses" else "`torch.nn.functional.scaled_dot_product_attention`")
                raise RuntimeError(
                    f"Block `{name}` ({type(block).__name__}) ran without calling {served}: context parallelism "
                    f"(context_parallel_method={self.method!r}) routes only those calls across the group, so its "
                    f"attention (if it has any) would see this rank's piece of the sequence alone. Use an SDPA "
                    f"attention (`attn_implementation=\"sdpa\"` for Hugging Face models), or "
                    f"context_parallel_method='ulysses' for a Hugging Face attention of another implementation.")
            outs = list(output) if isinstance(output, (tuple, list)) else [output]
            if not last:
                for o in outs:
                    if isinstance(o, torch.Tensor):
                        self._mark_local(o)
                return None
            if _in_backward():
                return None  # a recompute's output is discarded
            mode = self._loss_mode
            if mode is not None and grad_scale != 1.0:  # [Note: sharded to the loss]: the pieces go on
                mode.lead = self._lead
                if all(m is not mode for _, m in self._modes):
                    mode.__enter__()
                    self._modes.append((None, mode))
                for o in outs:
                    if isinstance(o, torch.Tensor):
                        self._mark_local(o)
                return None
            piece = (self._seq or 0) // self.size

            def cut(k, o):  # the hidden state, and any other output of this rank's length
                return isinstance(o, torch.Tensor) and o.dim() > self.seq_dim and (
                    k == 0 or o.shape[self.seq_dim] == piece)

            done = [gather(o, self.seq_dim, self.group, grad_scale=grad_scale) if cut(k, o) else o
                    for k, o in enumerate(outs)]
            return type(output)(done) if isinstance(output, (tuple, list)) else done[0]
        return hook


def apply_context_parallel(module: nn.Module, group, *, blocks: str | None = None, method: str = "ring",
                           seq_dim: int = 1, ranges: list[tuple[int, int]] | None = None) -> ContextParallel:
    """Run ``module``'s block stack on this rank's piece of every sequence, attention across ``group`` ([Note: where
    the sequence is cut]); ``blocks``: the stack's dotted name (None: found); ``method``: [Note: all-gather or ring];
    ``seq_dim``: the sequence dimension of the hidden state (1: batch first); ``ranges``: the ``(lo, hi)`` block
    ranges this rank runs, a pipeline stage's (None: the whole stack; [Note: context parallelism inside pipeline
    stages]). Refuses, by name, a module without a
    block stack and a Hugging Face attention that is not SDPA; a forward refuses a sequence length that ``2·cp``
    does not divide, an ambiguous block input and a block that calls no SDPA. Gradients: average over ``group``."""
    if method not in CP_METHODS:
        raise ValueError(f"context parallel `method={method!r}`: choose one of {CP_METHODS}.")
    try:
        path, stack = find_blocks(module, blocks)
    except ValueError as err:
        raise ValueError(f"Context parallelism cuts the sequence inside a block stack, and {err}") from None
    if method != "ulysses":
        check_sdpa(module)
    applied = ContextParallel(path=path, group=group, method=method, seq_dim=seq_dim, ends_stack=ranges is None)
    cp = float(dist.get_world_size(group))
    for lo, hi in ranges if ranges is not None else [(0, len(stack))]:
        for i in range(lo, hi):
            block, name = stack[i], f"{path}.{i}" if path else str(i)
            applied._handles.append(block.register_forward_pre_hook(
                applied._pre(i == lo, name, block), with_kwargs=True))
            applied._handles.append(block.register_forward_hook(
                applied._post(name, i == hi - 1, cp if hi == len(stack) else 1.0), with_kwargs=True,
                always_call=True))
    return applied


def apply_context_parallel_to_block(block: nn.Module, name: str, group, *, method: str = "ring",
                                    seq_dim: int = 1) -> ContextParallel:
    """``block`` alone as a stack of one block under context parallelism (the hooks :func:`apply_context_parallel`
    installs on a stack's first and last block): it cuts what it receives, routes its attention across ``group`` and
    gathers its output back to the whole sequence, the gather's gradient scaled by the group's size. What the setup
    check runs ([Note: the setup check of a context-parallel block] in :mod:`lightning_par.context.verify`)."""
    if method not in CP_METHODS:
        raise ValueError(f"context parallel `method={method!r}`: choose one of {CP_METHODS}.")
    if method != "ulysses":
        check_sdpa(block)
    applied = ContextParallel(path=name, group=group, method=method, seq_dim=seq_dim)
    applied._handles.append(block.register_forward_pre_hook(applied._pre(True, name, block), with_kwargs=True))
    applied._handles.append(block.register_forward_hook(
        applied._post(name, True, float(dist.get_world_size(group))), with_kwargs=True, always_call=True))
    return applied


__all__ = ["ContextParallel", "apply_context_parallel", "apply_context_parallel_to_block", "check_sdpa"]
