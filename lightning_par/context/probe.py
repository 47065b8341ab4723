"""What context parallelism needs of a module, seen on one sample before any collective: the check made at setup.

    >>> check_context_parallel(model, lambda: model(sample), method="ring")      # doctest: +SKIP
    ValueError: Context parallelism (context_parallel_method='ring') ... no method serves it ...

[Note: the setup check of context parallelism]
Context parallelism cuts every block's hidden state along its sequence dimension and routes the blocks' attention
across the group ([Note: where the sequence is cut], [Note: routing SDPA]). What a module does is only seen by
running it, so the check runs the module on one sample, on this process alone, up to the end of the stack's first
block (a ``BaseException`` raised from that block's forward hook ends the run there: the head and the loss never
run), and records what the block received and called: the hidden state's shape, the
``F.scaled_dot_product_attention`` calls (what the ring and the all-gather route) and the Hugging Face attention
modules inside the block with their ``attn_implementation`` (what Ulysses serves, whichever it is). It refuses,
naming the module, the block, what was seen and the method that would serve it:

- a hidden state with no sequence dimension to cut (fewer than three dimensions: ``[batch, features]``, an MLP);
- a block whose attention the chosen method does not serve: no SDPA call under ``"ring"`` / ``"allgather"``
  (eager attention: Ulysses serves a Hugging Face one), or neither an SDPA call nor a Hugging Face attention module
  under ``"ulysses"`` (a module's own ``softmax(q kᵀ) v``, Bloom's ALiBi added with ``baddbmm``);
- a block with no attention at all.

The run leaves the module as it found it (its buffers restored, the random state forked) and needs no gradient.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_par._compat import (attn_implementation, hf_attention_function, hf_register_attention,
                                   hf_set_attention_implementation)
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.pipeline.flow import hidden_name, kept_state

SDPA_METHODS = ("ring", "allgather")  # the methods that route F.scaled_dot_product_attention


class _Stop(BaseException):
    """Ends the probe's run after the first block."""


class _CountSdpa(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@dataclass
class BlockSeen:
    """What the first block of the stack received and called."""

    name: str
    kind: str
    hidden_shape: tuple | None = None
    sdpa_calls: int = 0
    hf_attention: dict = field(default_factory=dict)  # dotted name -> attn_implementation
    hf_calls: int = 0  # calls through Hugging Face's attention interface

    def served_by(self) -> tuple[str, ...]:
        """The methods that serve this block's attention (empty: none)."""
        if self.hidden_shape is None or len(self.hidden_shape) < 3:
            return ()
        if self.sdpa_calls:
            return ("ring", "allgather", "ulysses")
        if self.hf_calls:
            return ("ulysses",)
        return ()

    def seen(self) -> str:
        shape = "no tensor" if self.hidden_shape is None else f"a hidden state of shape {list(self.hidden_shape)}"
        calls = f"{self.sdpa_calls} call(s) of F.scaled_dot_product_attention"
        hf = (f", {self.hf_calls} call(s) through Hugging Face's attention interface (" + ", ".join(
            f"`{n}`, attn_implementation={i!r}" for n, i in self.hf_attention.items()) + ")"
              if self.hf_attention else "")
        return f"received {shape} and made {calls}{hf}"


def hf_attention_modules(block: nn.Module) -> dict:
    """The Hugging Face attention modules inside ``block`` (a submodule whose ``config`` names an
    ``_attn_implementation`` and that has no such submodule itself), by dotted name, with their implementation."""
    found = {}
    for name, sub in block.named_modules():
        impl = attn_implementation(getattr(sub, "config", None))
        if impl is not None and "attention" in type(sub).__name__.lower():
            found[name] = impl
    return found


def hf_attention_configs(blocks) -> dict:
    """``{id(config): config}`` of the Hugging Face attention modules inside ``blocks``
    (:func:`hf_attention_modules`)."""
    return {id(c): c for b in blocks for n in hf_attention_modules(b) if (c := b.get_submodule(n).config) is not None}


@contextlib.contextmanager
def hf_attention_through(configs: dict, name: str, fn: Callable):
    """While entered, the Hugging Face attention ``configs`` (:func:`hf_attention_configs`) name ``fn``, registered
    in the attention interface as ``name``; yields ``{id(config): its own implementation}``, which ``fn`` calls
    through (``hf_attention_function``). Restored on exit."""
    hf_register_attention(name, fn)
    originals = {key: attn_implementation(config) for key, config in configs.items()}
    for config in configs.values():
        hf_set_attention_implementation(config, name)
    try:
        yield originals
    finally:
        for key, config in configs.items():
            hf_set_attention_implementation(config, originals[key])


def probe_first_block(module: nn.Module, run: Callable[[], object], *, blocks: str | None = None,
                      seq_dim: int = 1) -> BlockSeen:
    """Run ``run`` (the module on one sample) up to the end of the stack's first block and record it ([Note: the
    setup check of context parallelism])."""
    path, stack = find_blocks(module, blocks)
    block = stack[0]
    seen = BlockSeen(name=f"{path}.0" if path else "0", kind=type(block).__name__,
                     hf_attention=hf_attention_modules(block))
    hname = hidden_name(block)
    counter = _CountSdpa()
    configs = hf_attention_configs([block])
    routed = contextlib.ExitStack()  # the block's attention modules through _hf_probe, from its start on

    def pre(_, args, kwargs):
        hidden = args[0] if args else kwargs.get(hname)
        seen.hidden_shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else None
        if configs:
            _PROBING.append((seen, routed.enter_context(hf_attention_through(configs, _PROBE, _hf_probe))))
            routed.callback(_PROBING.pop)
        counter.__enter__()

    def post(*_):
        counter.__exit__(None, None, None)
        seen.sdpa_calls = counter.calls
        raise _Stop()

    handles = [block.register_forward_pre_hook(pre, with_kwargs=True), block.register_forward_hook(post)]
    try:
        with torch.no_grad(), torch.random.fork_rng(), kept_state(module):
            run()
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
        routed.close()
    return seen


_PROBE = "lightning_par_probe"  # counts the calls through Hugging Face's attention interface
_PROBING: list = []


def _hf_probe(module, query, key, value, attention_mask, **kwargs):
    seen, originals = _PROBING[-1]
    seen.hf_calls += 1
    fn = hf_attention_function(module, originals[id(module.config)])
    return fn(module, query, key, value, attention_mask, **kwargs)



def check_context_parallel(module: nn.Module, run: Callable[[], object] | None, *, method: str,
                           blocks: str | None = None, seq_dim: int = 1) -> BlockSeen | None:
    """``ValueError`` naming the module, what its first block received and called, and the method that would serve
    it, where context parallelism with ``method`` cannot serve it ([Note: the setup check of context
    parallelism]); ``run``: the module on one sample (None: nothing to check against)."""
    if run is None:
        return None
    try:
        seen = probe_first_block(module, run, blocks=blocks, seq_dim=seq_dim)
    except ValueError as err:
        raise ValueError(f"Context parallelism cuts the sequence inside a block stack, and {err}") from None
    served = seen.served_by()
    if method in served:
        return seen
    what = f"`{type(module).__name__}`'s block `{seen.name}` ({seen.kind}), which {seen.seen()}"
    if seen.hidden_shape is None or len(seen.hidden_shape) < 3:
        why = ("it has no sequence dimension to cut (context parallelism needs a hidden state [batch, sequence, "
               "features])")
    elif not served:
        why = ("no method serves its attention: the ring and the all-gather route F.scaled_dot_product_attention, "
               "Ulysses that or a Hugging Face attention module; an attention of the module's own (softmax(q kᵀ) v, "
               "a bias added with baddbmm) or none at all is not served")
    else:
        why = f"its attention is served by context_parallel_method={' or '.join(map(repr, served))}"
    fix = (f"Use context_parallel_method={served[-1]!r}" if served else
           "Use data, tensor or pipeline parallelism for this module, and context_parallel_size=1")
    raise ValueError(f"Context parallelism (context_parallel_method={method!r}) cannot serve {what}: {why}. {fix}.")


__all__ = ["BlockSeen", "check_context_parallel", "hf_attention_configs", "hf_attention_modules",
           "hf_attention_through", "probe_first_block"]
