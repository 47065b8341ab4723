"""What a pipeline stage writes into a checkpoint.

[Note: what a stage writes] The first replica's stages each write what they own (their blocks; outside the
blocks, the parameters they own per [Note: shared parameters] and, on the first stage, the buffers), and the
optimizer state of those parameters; copies a stage never trains are stale and never written. The
checkpoint (one file or a DCP directory, :mod:`lightning_par.checkpoint`) is keyed by the unchanged
module's names, so it loads under any layout.
"""
from __future__ import annotations

from typing import Callable

import torch


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
