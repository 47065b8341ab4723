"""Zero bubble's split backward: input gradients now, weight gradients later.

[Note: split backward] torch.distributed.pipelining implements the split for its own schedules in the
private module ``torch.distributed.pipelining._backward``: ``stage_backward_input`` computes only the
stage input's gradient and keeps, per group of parameters, the gradients that reach the graph nodes
where the weights join; ``stage_backward_weight`` finishes the weights from those later. Only this
module touches that private API, so a change in torch is confined here. Parameters whose path to the
output never meets the stage input get no gradient from it; in a pipeline stage every trainable
parameter feeds the hidden state that comes from the previous stage (the first stage, which has no
such input, runs its whole backward in W instead).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_par._compat import is_view, pipelining_backward


def backward_input(outputs: list[torch.Tensor], grads: Optional[list[torch.Tensor]], stage_inputs: list[torch.Tensor],
                   weights: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """Set the ``.grad`` of each stage input; return what :func:`backward_weight` needs."""
    _backward = pipelining_backward()  # imported on first use: it pulls in much of torch

    # torch detaches the outputs in place afterwards, which a view refuses (T5's carried position bias is a
    # permuted view): a view goes in as a copy, through which the same gradient flows
    outputs = [o.clone() if is_view(o) else o for o in outputs]
    _, groups = _backward.stage_backward_input(outputs, None if grads is None else list(grads),
                                               list(stage_inputs), iter(weights))
    return groups


def backward_weight(weights: list[torch.nn.Parameter], groups: list[dict[str, Any]]) -> None:
    """Accumulate the weight gradients into ``.grad``."""
    _backward = pipelining_backward()

    _backward.stage_backward_weight(iter(weights), groups)
