"""Column-wise and row-wise styles that also split linear layers storing their weight transposed, ``[in, out]``
(Hugging Face's ``Conv1D``: GPT-2's ``c_attn``, ``c_proj``, ``c_fc``; see [Note: transposed linear layers]).

For an ``nn.Linear`` they are torch's ``ColwiseParallel`` / ``RowwiseParallel`` unchanged. For a transposed
layer, ``x @ weight + bias`` with ``weight`` ``[in, out]``:

- column-wise: ``weight`` ``Shard(1)``, ``bias`` ``Shard(0)`` (each rank writes ``out / t`` features);
- row-wise: ``weight`` ``Shard(0)``, ``bias`` replicated (each rank reads ``in / t`` features and the
  partial sums are reduced, the bias added once).

The layer's own forward then runs on DTensors (``torch.addmm(bias, x.view(-1, in), weight)`` and a view with
the global ``nf``), so nothing of it is rewritten; the input and output layouts are torch's.
"""
from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel as _TorchColwise
from torch.distributed.tensor.parallel import RowwiseParallel as _TorchRowwise

from lightning_par.tensor.layers import is_transposed_linear


def output_dim(module: nn.Module, param_name: str) -> int:
    """The dim of ``module.<param_name>`` that indexes the layer's output features (a bias: 0)."""
    return 1 if param_name == "weight" and is_transposed_linear(module) else 0


def _distribute(style, module: nn.Module, device_mesh, placement_of) -> None:
    # placements first: they read the module's parameters, which are replaced one by one below
    params = [(pname, param, placement_of(pname)) for pname, param in module.named_parameters(recurse=False)]
    for pname, param, placement in params:
        dist = distribute_tensor(param, device_mesh, [placement], src_data_rank=style.src_data_rank)
        module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))


class _Transposed:
    """What the two styles below add to torch's: ``distribute_module`` with torch's own input / output
    functions, around a partition that knows transposed weights."""

    def _apply_transposed(self, module: nn.Module, device_mesh, partition_fn, desired_input_layouts):
        self.desired_input_layouts = desired_input_layouts
        return distribute_module(module, device_mesh, partition_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class ColwiseParallel(_Transposed, _TorchColwise):
    """torch's ``ColwiseParallel``, plus transposed linear layers; each parameter is split along its output
    dim with :meth:`placement` (a subclass may choose another placement there, see :mod:`.fused`)."""

    def placement(self, module: nn.Module, param_name: str) -> Placement:
        return Shard(output_dim(module, param_name))

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(self, module, device_mesh, lambda pname: self.placement(module, pname))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not is_transposed_linear(module):
            return super()._apply(module, device_mesh)
        return self._apply_transposed(module, device_mesh, self._partition_linear_fn, (Replicate(),))


class RowwiseParallel(_Transposed, _TorchRowwise):
    """torch's ``RowwiseParallel``, plus transposed linear layers (weight ``Shard(0)``, bias replicated)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not is_transposed_linear(module):
            return super()._apply(module, device_mesh)

        def partition(name, mod, mesh):
            _distribute(self, mod, mesh, lambda pname: Shard(0) if pname == "weight" else Replicate())

        return self._apply_transposed(module, device_mesh, partition, (Shard(-1),))
