"""Fused projections: one ``nn.Linear`` that computes ``k`` outputs side by side (nanoGPT's ``c_attn``:
q, k and v in a ``Linear(C, 3C)``; a fused gate/up ``Linear(C, 2I)``; GPT-2's ``c_attn``, a transposed
``Conv1D(3C, C)`` whose weight is ``[C, 3C]``), split across tensor-parallel ranks.

[Note: fused projections]
A plain column-wise split of ``Linear(C, 3C)`` gives rank 0 rows ``[0, 3C/t)``: all of q and part of k on
two ranks. User code then splits the output with the *global* width (``y.split(C, dim=2)``), so the split
must keep global semantics. Here the weight is a DTensor with ``_StridedShard(0, split_factor=k)``: the
rows are cut into the ``k`` parts first and each part is sharded, so rank ``r`` holds ``[q_r; k_r; v_r]``
and its output ``[q_r | k_r | v_r]`` is the same placement on the last dim (a transposed layer, GPT-2's
``Conv1D``, keeps its output features on dim 1 of the weight: ``_StridedShard(1, k)`` there). Being a
DTensor, every op on it is right whatever the user's code does next; two sharding rules make the usual
ones free:

- ``split`` / ``chunk`` of such a tensor into its ``k`` equal parts along that dim gives each part
  ``Shard(dim)`` (q, k and v sharded by head, as separate column-wise layers would give them); torch's
  default gathers the whole tensor first;
- ``cat`` of ``k`` equally shaped ``Shard(dim)`` tensors along ``dim`` gives ``_StridedShard(dim, k)``
  locally (the backward of that split); torch's default gathers every input.

DTensor already maps a view of the fused dim into ``(k, heads, head_dim)`` to a shard of the heads. Any
other use falls back to torch's strategies (a gather: correct, slower).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_par._compat import dtensor_spec, sharding_propagator
from lightning_par._compat import strided_shard_type
from lightning_par.tensor.rules import cannot_install, only_spec, remember, wrap_strategy
from lightning_par.tensor.transposed import ColwiseParallel, output_dim

_StridedShard = strided_shard_type()  # private in torch: reached through _compat

_registered = False


class FusedColwiseParallel(ColwiseParallel):
    """Column-wise parallel for a linear layer (``nn.Linear``, or a transposed one such as GPT-2's
    ``Conv1D``: there the output features are the weight's dim 1) whose output is ``parts`` outputs side
    by side (see [Note: fused projections]); the output stays a DTensor in that layout."""

    def __init__(self, parts: int):
        super().__init__(use_local_output=False)
        self.parts = parts

    def placement(self, module: nn.Module, param_name: str):
        return _StridedShard(output_dim(module, param_name), split_factor=self.parts)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        # ColwiseParallel would redistribute to Shard(-1), regrouping the parts across ranks: keep the layout
        return _PlainGradLayout.apply(outputs)


class _PlainGradLayout(torch.autograd.Function):
    """Identity whose backward re-wraps the incoming gradient with the same placements and no recorded
    shard order. A gradient that reaches the fused output through DTensor's view rules (``view(B, T, 3, H, D)``)
    carries a shard order, and torch's matmul strategy then gathers it instead of contracting the shards into
    a partial sum (2 all-gathers per layer); on a 1-D mesh the order says nothing, so dropping it is exact."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and getattr(dtensor_spec(grad), "shard_order", None) is not None and grad.device_mesh.ndim == 1:
            grad = DTensor.from_local(grad.to_local(), grad.device_mesh, grad.placements, run_check=False,
                                      shape=grad.shape, stride=grad.stride())
        return grad


def register_fused_rules() -> None:
    """Add the split and cat rules of [Note: fused projections] to DTensor's (once per process). Each rule
    answers only its own case and hands every other call to torch's strategy."""
    global _registered
    if _registered:
        return
    aten = torch.ops.aten
    prop = sharding_propagator()
    adjusters = getattr(prop, "op_to_scalar_shape_adjuster", None)
    remember(_forget_registration)
    split_without = ("splitting a fused q|k|v projection output gathers it first: correct, with more "
                     "communication")
    for op in (aten.split.Tensor, aten.split_with_sizes.default):
        # the split sizes are global; the op runs on the local parts, so they are rewritten to local ones
        if adjusters is None or op in adjusters:
            cannot_install(op, split_without, "DTensor has no free slot to make the split sizes local")
        elif wrap_strategy(op, _split_parts, split_without):
            adjusters[op] = _local_split_sizes
            remember(lambda op=op: adjusters.pop(op, None))
    wrap_strategy(aten.cat.default, _cat_parts,
                  "the backward of a fused projection's split gathers every part: correct, with more communication")
    _registered = True


def _forget_registration() -> None:
    global _registered
    _registered = False


def _parts_split(spec, args) -> tuple[int, int] | None:
    """``(dim, k)`` when ``split(args)`` cuts a ``_StridedShard(dim, k)`` tensor into its ``k`` parts."""
    placement = spec.placements[0] if spec.mesh.ndim == 1 else None
    if not isinstance(placement, _StridedShard):
        return None
    ndim = len(spec.shape)
    dim = (args[2] if len(args) > 2 else 0) % ndim
    if placement.dim % ndim != dim:
        return None
    n, k = spec.shape[dim], int(placement.split_factor)
    size = args[1]
    sizes = [size] * (n // size) + ([n % size] if n % size else []) if isinstance(size, int) else list(size)
    if len(sizes) != k or any(s != n // k for s in sizes) or (n // k) % spec.mesh.size():
        return None
    return dim, k


def _split_parts(op_schema):
    from lightning_par._compat import DTensorSpec, OpSpec, OpStrategy, generate_redistribute_costs

    args = op_schema.args_schema
    spec = only_spec(args[0])
    found = _parts_split(spec, args) if spec is not None else None
    if found is None:
        return None
    dim, k = found
    outputs = tuple(DTensorSpec(spec.mesh, (Shard(dim),)) for _ in range(k))
    return OpStrategy([OpSpec(output_specs=outputs, input_specs=(spec,),
                              redistribute_cost=[generate_redistribute_costs(args[0], spec)])])


def _local_split_sizes(input_specs, schema):
    """The split sizes of :func:`_split_parts`' case made local (each part is ``1/t`` on every rank);
    any other split keeps its arguments."""
    from lightning_par._compat import OpSchema

    args = list(schema.args_schema)
    found = _parts_split(input_specs[0], args)
    if found is not None:
        dim, k = found
        local = input_specs[0].shape[dim] // k // input_specs[0].mesh.size()
        args[1] = local if isinstance(args[1], int) else [local] * k
    return OpSchema(schema.op, tuple(args), schema.kwargs_schema)


def _cat_parts(op_schema):
    from lightning_par._compat import DTensorSpec, OpSpec, OpStrategy, TupleStrategy, generate_redistribute_costs

    args = op_schema.args_schema
    if not isinstance(args[0], TupleStrategy) or len(args[0].children) < 2:
        return None
    specs = [only_spec(c) for c in args[0].children]
    if any(s is None for s in specs):
        return None
    ndim = len(specs[0].shape)
    dim = (args[1] if len(args) > 1 else 0) % ndim
    mesh = specs[0].mesh
    if any(s.mesh != mesh or type(s.placements[0]) is not Shard or s.placements[0].dim != dim
           or s.shape != specs[0].shape for s in specs):
        return None
    output = DTensorSpec(mesh, (_StridedShard(dim, split_factor=len(specs)),))
    return OpStrategy([OpSpec(output_specs=output, input_specs=tuple(specs),
                              redistribute_cost=[generate_redistribute_costs(c, s) for c, s in zip(args[0].children, specs)])])
