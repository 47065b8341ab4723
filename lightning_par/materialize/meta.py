"""Parameters on the meta device: building a module with them, telling them apart, turning owned-elsewhere
parameters of a plainly built module into them.

[Note: meta parameters, real buffers]
Under our strategies ``trainer.init_module(empty_init=True)`` (and ``configure_model``) builds the module
inside :func:`meta_parameters`: every parameter is turned into a meta tensor the moment it is registered
(torch's global parameter-registration hook, removed when the context exits), so the weights take no
memory and the module's own init code (``reset_parameters`` in ``__init__``, ``self.apply(self._init_weights)``)
runs on meta tensors for free. Buffers are built for real, by the module's own code: the values of
non-persistent buffers (rotary ``inv_freq``, causal masks) come from ``__init__`` and no weights file holds
them, so rebuilding them later would need the constructor's arguments. They are small; the pipeline frees
those of other stages' blocks with the blocks. Each parameter is allocated (uninitialized) before the hook
replaces it, one at a time: the transient cost is the largest parameter, and ``torch.empty`` touches no
pages. A module that loads values into its parameters inside the context (``from_pretrained``) loses them:
pass ``weights=`` to the strategy instead, or build with ``empty_init=False``.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def is_meta(t: torch.Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local shard) holds no storage."""
    return (t.to_local() if isinstance(t, DTensor) else t).is_meta


def meta_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters and buffers on the meta device (tied ones under each name)."""
    tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return [n for n, t in tensors if t is not None and is_meta(t)]


def has_meta(module: nn.Module) -> bool:
    return any(is_meta(t) for t in list(module.parameters()) + list(module.buffers()))


def _meta_parameter(param: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Inside: every parameter a module registers becomes a meta parameter (see [Note: meta parameters, real
    buffers]); buffers stay as built.

    Example:
        >>> with meta_parameters():
        ...     bn = torch.nn.BatchNorm1d(3)
        >>> bn.weight.device.type, bn.running_var.device.type, bn.running_var.tolist()
        ('meta', 'cpu', [1.0, 1.0, 1.0])
    """
    def hook(module, name, param):
        if param is None or is_meta(param):
            return None  # already meta (a tied parameter registered a second time keeps its identity)
        return _meta_parameter(param)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def free_parameters(module: nn.Module, names: Iterable[str]) -> int:
    """Replace the parameters ``names`` of ``module`` by meta parameters of the same shape (tied ones stay
    tied, under every name they have); return the bytes freed (what nothing else references is released)."""
    wanted = set(names)
    ids = {id(p) for n, p in module.named_parameters(remove_duplicate=False) if n in wanted and not is_meta(p)}
    new: dict[int, nn.Parameter] = {}
    freed = 0
    for mod in module.modules():
        for attr, p in list(mod._parameters.items()):
            if p is None or id(p) not in ids:
                continue
            if id(p) not in new:
                new[id(p)] = _meta_parameter(p)
                freed += p.numel() * p.element_size()
            mod._parameters[attr] = new[id(p)]
    return freed


def release(module: nn.Module) -> None:
    """Drop the storage of every parameter, gradient and buffer of ``module`` (a scratch copy: they become meta
    tensors), now rather than when the garbage collector finds the copy: a parallelized module refers to itself
    (its wrapped ``forward`` holds the bound method), so dropping the last name of it frees nothing until a
    collection runs."""
    for mod in module.modules():
        for store in (mod._parameters, mod._buffers):
            for attr, t in list(store.items()):
                if t is None:
                    continue
                t.grad = None
                if not is_meta(t):
                    empty = torch.empty(t.shape, dtype=t.dtype, device="meta")  # a DTensor's too: full shape
                    store[attr] = nn.Parameter(empty, t.requires_grad) if store is mod._parameters else empty
