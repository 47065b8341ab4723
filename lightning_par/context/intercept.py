"""The interception point: ``F.scaled_dot_product_attention`` calls routed to context-parallel attention.

    >>> with RouteAttention(group):                                        # doctest: +SKIP
    ...     y = F.scaled_dot_product_attention(q, k, v, is_causal=True)    # this rank's piece of the whole

[Note: routing SDPA]
A module's attention is its own code; what the blocks of every family here share is the call of
``torch.nn.functional.scaled_dot_product_attention`` (Hugging Face's ``attn_implementation="sdpa"``, the reference
GPT, ``nn.MultiheadAttention`` without weights). A ``torch.overrides.TorchFunctionMode`` sees that call (a Python
or a C++ caller alike) and nothing else is changed: no attribute of torch or of the module is patched, the mode is
entered by a block's forward pre-hook and left by its forward hook (``always_call``: also when the block raises),
so it is active only while a block runs and nothing remains once the hooks are removed. Every other function
passes through untouched. The mode counts the calls it routed, so that a block that ran no SDPA (attention of its
own: eager attention) is refused after its first call instead of training silently wrong.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_par.context.attention import context_attention

_SDPA = (F.scaled_dot_product_attention,)
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class RouteAttention(TorchFunctionMode):
    """Routes SDPA to :func:`~lightning_par.context.attention.context_attention` over ``group`` ([Note: routing
    SDPA]); ``calls``: how many it routed since entered."""

    def __init__(self, group, method: str = "allgather"):
        super().__init__()
        self.group, self.method, self.calls = group, method, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA:
            return func(*args, **kwargs)
        self.calls += 1
        named = dict(zip(_NAMES, args), **kwargs)
        return context_attention(**named, group=self.group, method=self.method)


__all__ = ["RouteAttention"]
