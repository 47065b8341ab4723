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
Where the layouts differ (a query replicated after a per-head norm beside values sharded by head, a mask
replicated beside queries sharded: Gemma-3, StarCoder2), a mesh of one rank holds the same local tensors whatever
the placements; on a larger mesh a replicated key, value or mask with the query's heads is sliced to this rank's
heads (a local slice), one with a single head or none is broadcast as SDPA broadcasts it, other layouts are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
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
        mesh = q.device_mesh
        head = Shard(q.dim() - 3)
        placements = q.placements
        if mesh.size() > 1 and any(isinstance(t, DTensor) and tuple(t.placements) == (Shard(t.dim() - 3),)
                                   for t in (q, named["key"], named["value"])):
            placements = (head,)  # some of q, k, v are sharded by head: all of them are, for this call
        local = {k: _local_heads(k, v, placements) if isinstance(v, DTensor) else v for k, v in named.items()}
        out = context_attention(**local, group=self.group, method=self.method)
        return DTensor.from_local(out, mesh, placements, run_check=False)


def _local_heads(name: str, t: DTensor, placements) -> torch.Tensor:
    """This tensor-parallel rank's part of ``t`` for the local heads of the layout ``placements`` ([Note: DTensor
    attention])."""
    mesh = t.device_mesh
    if mesh.size() == 1 or tuple(placements) == (Replicate(),) and tuple(t.placements) == (Replicate(),):
        return t.to_local()  # a mesh of one rank holds the same local tensor whatever the placements
    heads = t.shape[-3] if t.dim() >= 3 else 1
    if tuple(t.placements) == (Shard(t.dim() - 3),):
        return t.to_local()
    if tuple(t.placements) == (Replicate(),):
        if heads == 1:
            return t.to_local()  # broadcast over the heads, as SDPA broadcasts it
        if heads % mesh.size() == 0:
            return t.redistribute(mesh, (Shard(t.dim() - 3),)).to_local()  # a local slice, no collective
    raise ValueError(
        f"Context-parallel attention takes q, k, v and the mask sharded by head over the tensor-parallel mesh (or "
        f"broadcast over heads); the {name} is {t.placements} of shape {tuple(t.shape)}, its heads not divisible "
        f"by the mesh's {mesh.size()} ranks. Give the attention's key/value heads a multiple of "
        f"tensor_parallel_size, or run with tensor_parallel_size=1.")


__all__ = ["RouteAttention"]
