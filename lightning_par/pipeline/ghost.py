"""Stand-ins for the blocks of other pipeline stages: a parameter-free :class:`Ghost` in each one's place
(so the names of this stage's parameters do not change), which answers what code reads of the block from a
meta-tensor shadow of it (:func:`shadow_of`, [Note: ghost shadow]). :mod:`.stage` installs them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_par.pipeline.stage import StageRuntime


class Ghost(nn.Module):
    """Stand-in for a block that lives on another stage: no parameters, passes the hidden state through,
    and answers what code reads of the block from its ``shadow`` (see [Note: ghost shadow])."""

    def __init__(self, runtime: "StageRuntime", index: int, shadow: nn.Module | None = None):
        super().__init__()
        object.__setattr__(self, "_runtime", runtime)  # plain references, not submodules
        object.__setattr__(self, "_shadow", shadow)
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._runtime.ghost_output(args, kwargs, self.index)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        shadow = self.__dict__.get("_shadow")
        if shadow is not None and not name.startswith("__") and hasattr(shadow, name):
            return getattr(shadow, name)
        raise AttributeError(
            f"'Ghost' object has no attribute {name!r}: block {self.__dict__.get('index')} of the pipelined stack "
            f"lives on another pipeline stage, and neither it nor the block it stands for has {name!r}."
        )

    def train(self, mode: bool = True) -> "Ghost":
        super().train(mode)
        if self._shadow is not None:
            self._shadow.train(mode)
        return self

    def extra_repr(self) -> str:
        return f"block {self.index}, held by another pipeline stage"


def shadow_of(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """[Note: ghost shadow] Code around a block stack may read its blocks: ``nn.TransformerEncoder.forward``
    inspects ``self.layers[0].self_attn.batch_first``, its weights and ``training`` to choose its fast path.
    A ghost answers such reads from a shadow of the block it replaced: an object of the same classes with the
    same attributes, whose parameters, buffers and tensor attributes are meta tensors (shape, dtype and
    ``requires_grad`` kept, no memory). The shadow is not a submodule, so the module's parameter names,
    state dict and optimizer are those of the stage; its ``training`` follows the ghost's. Code that
    computes with a ghost's tensors fails loudly (meta tensors hold no values) instead of using stale ones.
    The structure is copied one module at a time (not ``copy.deepcopy``, which would also copy whatever the
    block's attributes and hooks reference, up to the whole model)."""
    memo = {} if memo is None else memo

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            m = t.detach().to("meta")
            memo[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
        return memo[id(t)]

    clone = object.__new__(type(module))
    state = dict(module.__dict__)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            state[key] = meta(value)
    state["_parameters"] = {k: None if v is None else meta(v) for k, v in module._parameters.items()}
    state["_buffers"] = {k: None if v is None else meta(v) for k, v in module._buffers.items()}
    state["_modules"] = {k: None if v is None else memo[id(v)] if id(v) in memo else shadow_of(v, memo)
                         for k, v in module._modules.items()}
    clone.__dict__.update(state)
    memo[id(module)] = clone
    return clone
