"""One checkpoint file for a pipeline: the module's state assembled from the stages, and every rank's
optimizer state under the layout that wrote it.

[Note: consolidated checkpoint] The first replica's stages each contribute what they own (their blocks;
outside the blocks, the parameters they own per [Note: shared parameters] and, on the first stage, the
buffers); rank 0 assembles them in the unchanged module's key order, so the file loads strictly into the
module on one device. Optimizer states stay per rank: every rank's state is gathered into the file with
the layout, and a resumed run under the same layout takes its own rank's back.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

LAYOUT_KEY = "pipeline_parallel"


def owned_state(module: torch.nn.Module, *, block_prefix: str, owns: Callable[[torch.nn.Parameter, str], bool],
                first_replica: bool, first_stage: bool) -> dict[str, torch.Tensor]:
    """The entries of the module's state dict this rank writes (none on replicas other than the first)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    canonical = {id(p): n for n, p in module.named_parameters()}
    mine = {}
    if first_replica:
        for k, v in module.state_dict().items():
            if k.startswith(block_prefix):
                keep = True  # only this stage's blocks have entries here
            elif k in params:
                keep = owns(params[k], canonical[id(params[k])])
            else:
                keep = first_stage  # buffers outside the blocks: the first stage's copy
            if keep:
                mine[k] = v.detach()
    return mine


def consolidate(mine: dict[str, torch.Tensor], keys: Sequence[str], *, is_rank_zero: bool) -> dict[str, Any]:
    """Every rank's ``mine`` gathered; on rank 0 the whole state dict in the order of ``keys`` (the module's
    own), elsewhere empty. Every rank calls it."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: v.detach().cpu() for k, v in mine.items()})
    merged: dict[str, Any] = {}
    for part in everyone:
        for k, v in part.items():
            merged.setdefault(k, v)
    missing = [k for k in keys if k not in merged]
    if missing:
        raise RuntimeError(f"Consolidating the pipeline's state dict lost {missing[:5]}.")
    return {k: merged[k] for k in keys} if is_rank_zero else {}


def gather_optimizer_state(state: dict[str, Any], layout: Sequence[int]) -> dict[str, Any]:
    """Every rank's optimizer ``state`` together with the (pp, dp, tp) ``layout``. Every rank calls it."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state)
    return {LAYOUT_KEY: {"layout": list(layout), "ranks": everyone}}


def optimizer_state_of(state: dict[str, Any], layout: Sequence[int], rank: int) -> dict[str, Any]:
    """This ``rank``'s optimizer state from what :func:`gather_optimizer_state` wrote (a plain state as it is)."""
    if LAYOUT_KEY not in state:
        return state
    saved = state[LAYOUT_KEY]
    if list(saved["layout"]) != list(layout):
        raise ValueError(
            f"The checkpoint's optimizer states were saved under the layout (pp, dp, tp) = "
            f"{tuple(saved['layout'])}; this run has {tuple(layout)}. Resume with the same "
            f"sizes, or load only the weights (`Module.load_from_checkpoint`) and start a new fit."
        )
    return saved["ranks"][rank]
