"""Sharding rules DTensor lacks (or gets wrong) for head-parallel attention.

Attention is independent per head (dim 1 of ``(B, H, L, E)``), so q, k, v, the output and the log-sum-exp
may all be sharded by head, or all be replicated. A mask (additive bias) that broadcasts over heads stays
replicated; one with a row per head is sharded with them (:func:`mask_placement`).

[Note: attention kernels under head parallelism]
``F.scaled_dot_product_attention`` dispatches to one of these kernels; what DTensor (torch 2.13) does with
head-sharded q, k, v on each, checked by propagating fake specs (tests/unit/test_attention_rules.py):

- ``_scaled_dot_product_flash_attention_for_cpu`` (+ backward), the CPU kernel: DTensor has no strategy
  at all; the rules here are registered for it. Its mask is a keyword argument, and DTensor never
  redistributes keyword arguments: the rules offer only layouts that keep the mask where it is (a mask
  with a row per head is split before the call by :class:`SplitAttentionMasks`; one still replicated
  there makes q, k and v gather), and the all-replicated option only for a replicated mask (offered
  beside a split one, torch reports the re-sharded output's strides wrongly and a later ``.view`` fails).
- ``_scaled_dot_product_flash_attention`` (+ backward), CUDA: torch's strategy shards by head; the kernel
  takes no mask. Nothing is added.
- ``_scaled_dot_product_efficient_attention`` (+ backward), CUDA: torch's strategy shards by head and the
  bias with them. SDPA expands any mask to ``(B, H, L, S)`` before calling this kernel (``preprocess_mask``),
  so a replicated mask is cut by head locally, without communication. Nothing is added.
- ``_scaled_dot_product_cudnn_attention``, CUDA: torch's head-sharded strategy (and its batch one) list no
  placement for ``attn_bias``, so with a mask every call fails in DTensor (``input_specs(3) !=
  strategies(4)``; torch 2.14's single-dim strategy replicates q, k, v and the output instead). SDPA hands cuDNN the mask unexpanded — ``(L, S)``, ``(B, 1, L, S)`` or ``(B, H, L, S)``
  — so the bias is placed by :func:`mask_placement`. Without a mask torch's strategy answers.
- its backward: torch's head-sharded strategy shards ``attn_bias`` on dim 1, which a mask broadcasting
  over heads cannot be; DTensor then falls back to replicating all of q, k, v, out and the gradients
  (correct, but gathers them on every layer). With a mask the rule here places it as the forward does.

The cuDNN rules answer only their case and hand every other call to torch's strategy (:func:`.rules.wrap_strategy`).

A KV cache that starts empty (Hugging Face's ``DynamicLayer``: ``torch.cat([torch.tensor([]), keys],
dim=-2)``, which a model builds even in training unless called with ``use_cache=False``) concatenates a
legacy 1-D empty tensor, which ``cat`` skips, with head-sharded keys; torch's strategy tries to shard the
empty tensor like the keys and fails. The rule here lets the empty one stay replicated and the result
keep the keys' placement.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from lightning_par.tensor.rules import (install_strategy, only_spec, remember, restore_rules, strategy_of,
                                       wrap_strategy)

HEADS = Shard(1)  # (B, H, L, E)
_registered = False

#: ``(output placements, input placements)`` alternatives, as ``register_sharding`` takes them.
Shardings = list[tuple[list, list]]


def mask_placement(mask, heads: int):
    """Where a mask of ``mask.shape`` goes next to q, k, v sharded over ``heads`` heads: split on its head
    dim (the third from the right) when it holds one row per head, replicated when it broadcasts over
    heads; ``None`` without a mask.

    Example::

        >>> import torch
        >>> [mask_placement(torch.empty(s), 4) for s in [(8, 8), (2, 1, 8, 8), (2, 4, 8, 8), (4, 8, 8)]]
        [Replicate(), Replicate(), Shard(dim=1), Shard(dim=0)]
    """
    if mask is None:
        return None
    head_dim = head_dim_of_mask(tuple(mask.shape))
    return Replicate() if head_dim is None or heads == 1 else Shard(head_dim)


def head_dim_of_mask(shape) -> int | None:
    """The dim of an attention mask that lines up with the heads of ``(B, H, L, S)`` (masks broadcast from the
    right), or ``None`` when the mask has no such dim or size 1 there (it broadcasts over heads)."""
    return len(shape) - 3 if len(shape) >= 3 and shape[-3] > 1 else None


def _keyword_mask_options(mask, heads: int) -> tuple[bool, bool]:
    """Whether the all-replicated and the head-split alternatives may be offered for a keyword ``mask``
    (see the CPU kernel in [Note: attention kernels under head parallelism]): each only where the mask already
    has the placement that alternative gives it. Specs without placements (the unit tests' shapes) allow both."""
    current = tuple(getattr(mask, "placements", ())) if mask is not None else ()
    if mask is None or not current:
        return True, True
    return current == (Replicate(),), current == (mask_placement(mask, heads),)


def _inputs(args: Sequence, placements: dict[int, object]) -> list:
    """One placement per argument: ``placements[i]`` for the tensors named there, ``Replicate()`` for other
    tensors (philox seeds, sequence offsets), ``None`` for non-tensors (floats, flags, absent tensors)."""
    return [placements.get(i, Replicate()) if hasattr(a, "shape") else None for i, a in enumerate(args)]


# -- the rule functions: pure, on anything with a ``shape`` (DTensorSpecs at run time) -----------------

def cpu_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None) -> Shardings:
    """``_scaled_dot_product_flash_attention_for_cpu`` → ``(output, logsumexp)``: all replicated, or by head.
    The keyword ``attn_mask`` counts after the positional arguments (as DTensor orders them)."""
    args = (query, key, value, dropout_p, is_causal, attn_mask)
    heads = {0: HEADS, 1: HEADS, 2: HEADS, 5: mask_placement(attn_mask, query.shape[1])}
    replicated, split = _keyword_mask_options(attn_mask, query.shape[1])
    return ([([Replicate()] * 2, _inputs(args, {}))] if replicated else []) + \
        ([([HEADS] * 2, _inputs(args, heads))] if split else [])


def cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                 scale=None) -> Shardings:
    """``_scaled_dot_product_flash_attention_for_cpu_backward`` → ``(grad_q, grad_k, grad_v)``."""
    args = (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask)
    heads = {**dict.fromkeys(range(6), HEADS), 8: mask_placement(attn_mask, query.shape[1])}
    replicated, split = _keyword_mask_options(attn_mask, query.shape[1])
    return ([([Replicate()] * 3, _inputs(args, {}))] if replicated else []) + \
        ([([HEADS] * 3, _inputs(args, heads))] if split else [])


def cudnn_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                  return_debug_mask=False, *, scale=None) -> Shardings | None:
    """``_scaled_dot_product_cudnn_attention`` with a mask (``None`` without one: torch's strategy answers).
    Outputs ``(output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset,
    debug_attn_mask)``, placed as torch's strategy places them."""
    if attn_bias is None:
        return None
    args = (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask)

    def outputs(p):
        return [p, p if compute_log_sumexp else Replicate()] + [None] * 6 + [p if return_debug_mask else None]

    bias = mask_placement(attn_bias, query.shape[1])
    return [(outputs(Replicate()), _inputs(args, {})),
            (outputs(HEADS), _inputs(args, {0: HEADS, 1: HEADS, 2: HEADS, 3: bias}))]


def cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                   cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None) -> Shardings | None:
    """``_scaled_dot_product_cudnn_attention_backward`` with a mask (``None`` without: torch's strategy)."""
    if attn_bias is None:
        return None
    args = (grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
            cum_seq_k, max_q, max_k, dropout_p, is_causal)
    heads = {**dict.fromkeys(range(6), HEADS), 8: mask_placement(attn_bias, query.shape[1])}
    return [([Replicate()] * 3, _inputs(args, {})), ([HEADS] * 3, _inputs(args, heads))]


# -- registration ----------------------------------------------------------------------------------

def _strategy(rule: Callable[..., Shardings | None], op_schema):
    """DTensor's ``OpStrategy`` for ``rule``'s alternatives (what ``register_sharding`` builds), or ``None``."""
    from lightning_par._compat import OpStrategy, TupleStrategy, expand_to_full_mesh_op_strategy, op_returns

    def spec(s):
        if isinstance(s, OpStrategy):
            return s.strategies[0].output_spec
        return tuple(spec(c) for c in s.children) if isinstance(s, TupleStrategy) else s

    found = rule(*map(spec, op_schema.args_schema), **{k: spec(v) for k, v in op_schema.kwargs_schema.items()})
    if found is None:
        return None
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema,
                                           [list(outs) + list(ins) for outs, ins in found],
                                           input_index=op_returns(op_schema.op))


def rules() -> dict:
    """``{op: rule}`` for this torch build: the kernels of [Note: attention kernels under head parallelism]
    that need a rule here (a build without CUDA kernels still has their schemas)."""
    aten = torch.ops.aten
    names = {"_scaled_dot_product_flash_attention_for_cpu": cpu_forward,
             "_scaled_dot_product_flash_attention_for_cpu_backward": cpu_backward,
             "_scaled_dot_product_cudnn_attention": cudnn_forward,
             "_scaled_dot_product_cudnn_attention_backward": cudnn_backward}
    return {getattr(aten, n).default: rule for n, rule in names.items() if hasattr(aten, n)}


def register_attention_rules() -> None:
    """Register the KV-cache and attention-kernel rules once per process (idempotent); undone, with every
    other rule of ours, by :func:`.rules.restore_rules`."""
    global _registered
    if _registered:
        return
    from lightning_par._compat import RuntimeSchemaInfo

    remember(_forget_registration)
    wrap_strategy(torch.ops.aten.cat.default, _cat_onto_empty,
                  "concatenating head-sharded keys onto an empty KV cache may fail in DTensor "
                  "(call the model with use_cache=False)")
    for op, rule in rules().items():
        strategy = lambda op_schema, rule=rule: _strategy(rule, op_schema)  # noqa: E731
        if strategy_of(op) is None:  # no strategy in DTensor (the CPU kernel): ours is the only one
            # [Note: keyword masks in the sharding cache] DTensor caches a decision by the arguments its
            # schema info names; naming no keyword, a call with a split ``attn_mask`` would reuse the decision
            # made for a replicated one (same q, k, v): the mask and the scale are part of the key.
            install_strategy(op, strategy, RuntimeSchemaInfo(static_argnum=100, static_kwargkey=["attn_mask", "scale"],
                                                             needs_pytree=True))
        else:  # ours answers its case, torch's every other
            wrap_strategy(op, strategy, "with a mask, this cuDNN attention kernel may fail in DTensor or "
                          "gather q, k and v")
    _registered = True


def _forget_registration() -> None:
    global _registered
    _registered = False


#: Give DTensor back every strategy the rules here (and the other rules of ours) replaced.
unregister_attention_rules = restore_rules


def _cat_onto_empty(op_schema):
    from lightning_par._compat import DTensorSpec, OpSpec, OpStrategy, TupleStrategy, generate_redistribute_costs

    args = op_schema.args_schema
    if not isinstance(args[0], TupleStrategy):
        return None
    children = args[0].children
    specs = [only_spec(c) for c in children]
    if any(s is None for s in specs):
        return None
    empty = [tuple(s.shape) == (0,) for s in specs]
    rest = [s for s, e in zip(specs, empty) if not e]
    if not any(empty) or not rest or any(s.placements != rest[0].placements for s in rest):
        return None
    placements, ndim = rest[0].placements, len(rest[0].shape)
    dim = (args[1] if len(args) > 1 else 0) % ndim
    if any(p.is_partial() or p.is_shard(dim) for p in placements):
        return None
    mesh = rest[0].mesh
    inputs = [DTensorSpec(mesh, (Replicate(),), tensor_meta=s.tensor_meta) if e else s for s, e in zip(specs, empty)]
    return OpStrategy([OpSpec(output_specs=DTensorSpec(mesh, placements), input_specs=tuple(inputs),
                              redistribute_cost=[generate_redistribute_costs(c, i) for c, i in zip(children, inputs)])])


class SplitAttentionMasks(torch.overrides.TorchFunctionMode):
    """Active while a region runs (:class:`~lightning_par.tensor.parallelize.PrepareBlockInput`): before
    ``F.scaled_dot_product_attention`` with head-split q, a mask with a head dim (T5's position bias, a plain
    tensor the region built or a replicated DTensor) is split by head too, differentiably, so the kernel runs on
    each rank's heads (see the top of this module: DTensor would not split it, a keyword argument)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            args, kwargs = _split_mask(list(args), kwargs)
        return func(*args, **kwargs)


def _split_mask(args: list, kwargs: dict):
    from torch.distributed.tensor import DTensor

    query = args[0] if args else kwargs.get("query")
    in_args = len(args) > 3
    mask = args[3] if in_args else kwargs.get("attn_mask")
    if not isinstance(query, DTensor) or tuple(query.placements) != (Shard(1),) or not isinstance(mask, torch.Tensor):
        return args, kwargs
    d = head_dim_of_mask(tuple(mask.shape))
    if d is None or (isinstance(mask, DTensor) and tuple(mask.placements) == (Shard(d),)):
        return args, kwargs
    if not isinstance(mask, DTensor):
        mask = DTensor.from_local(mask, query.device_mesh, (Replicate(),), run_check=False)
    if tuple(mask.placements) != (Replicate(),):
        return args, kwargs  # some other layout: left to the rule (which then gathers)
    mask = mask.redistribute(query.device_mesh, (Shard(d),))
    if in_args:
        args[3] = mask
    else:
        kwargs["attn_mask"] = mask
    return args, kwargs
