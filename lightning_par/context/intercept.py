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

[Note: DTensor attention]
Under tensor parallelism (and on a tensor-parallel mesh of one rank) q, k and v are DTensors, sharded by head
(``Shard(1)``) or replicated. Attention mixes positions, never heads, so each rank runs the context-parallel
attention on its local heads (``to_local``, differentiable) and the result takes the query's placements again
(``from_local``): the cp group and the tp group are different axes of the mesh and never meet in one collective.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightning_par.context.attention import context_attention

_SDPA = (F.scaled_dot_product_attention,)
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class RouteAttention(TorchFunctionMode):
    """Routes SDPA to :func:`~lightning_par.context.attention.context_attention` over ``group`` ([Note: routing
    SDPA]); ``calls``: how many it routed since entered."""

    def __init__(self, group, method: str = "ring"):
        super().__init__()
        self.group, self.method, self.calls = group, method, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA:
            return func(*args, **kwargs)
        self.calls += 1
        named = dict(zip(_NAMES, args), **kwargs)
        q = named["query"]
        if not isinstance(q, DTensor):
            return context_attention(**named, group=self.group, method=self.method)
        # [Note: DTensor attention]: heads are independent, so each tensor-parallel rank attends with its local heads
        layout = (q.device_mesh, q.placements)
        for name in ("key", "value", "attn_mask"):
            t = named.get(name)
            if isinstance(t, DTensor) and (t.device_mesh, t.placements) != layout:
                raise ValueError(f"Context-parallel attention takes the query, key and value on one layout; the "
                                 f"query is {q.placements} and the {name} {t.placements} on the mesh.")
        local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in named.items()}
        out = context_attention(**local, group=self.group, method=self.method)
        return DTensor.from_local(out, *layout, run_check=False)


__all__ = ["RouteAttention"]
