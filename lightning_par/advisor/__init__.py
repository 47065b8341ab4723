"""The advisor: predict per-device memory and communication of every layout, and choose one.

Example::

    from lightning_par.advisor import advise_module
    advice = advise_module(GPT(), example_batch, devices=8, device_memory=80 * 2**30)
    print(advice.table())
"""
from __future__ import annotations

from lightning_par import patches
from lightning_par.advisor.choose import Advice, Candidate, advise, candidate_layouts
from lightning_par.advisor.memory import (Estimate, Layout, estimate, korthikanti_bytes_per_layer,
                                          korthikanti_stack_bytes)
from lightning_par.advisor.profile import ModuleProfile, measure

__all__ = ["Advice", "Candidate", "Estimate", "Layout", "ModuleProfile", "advise", "advise_module",
           "candidate_layouts", "estimate", "korthikanti_bytes_per_layer", "korthikanti_stack_bytes", "measure",
           "profile_lightning_module"]


def profile_lightning_module(module, batch, blocks=None, precision: str = "32-true") -> ModuleProfile:
    """Profile a LightningModule by running its own ``training_step`` once on ``batch`` (one micro-batch).

    ``blocks`` is the repeated block container (found automatically when None, as the pipeline does).
    Under a mixed ``precision`` the probe runs in the same autocast as training, so the activations
    have the sizes training will see; under ``bf16-true``/``16-true`` a copy of the module runs in that dtype.
    Logging calls inside ``training_step`` are silenced for the probe.
    """
    import copy
    from contextlib import nullcontext

    import torch

    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
             "16-true": torch.float16}.get(precision)
    device = next(module.parameters()).device
    context = nullcontext()
    if precision.endswith("-mixed"):
        context = torch.autocast(device.type, dtype=dtype)
    elif dtype is not None:
        module = copy.deepcopy(module).to(dtype)

    container = _blocks(module, blocks)
    size = next(t for t in _leaves(batch) if isinstance(t, torch.Tensor)).shape[0]
    module.log = lambda *args, **kwargs: None  # the probe's step logs nothing (a patch of lightning_par.patches)
    take_out = patches.record("module-log", lambda: module.__dict__.pop("log", None))
    was_training = module.training
    module.train()
    try:
        def step():
            with context:
                out = module.training_step(batch, 0)
            return out["loss"] if isinstance(out, dict) else out
        return measure(module, container, step, size)
    finally:
        take_out()
        module.train(was_training)


def _blocks(module, blocks):
    """The block stack the pipeline finds, except that a per-expert MoE's experts list (often the longest list of
    one class) gives way to the longest stack outside every experts container (the transformer layers)."""
    from torch import nn

    from lightning_par.experts.discovery import find_experts
    from lightning_par.pipeline.discovery import find_blocks

    path, container = find_blocks(module, blocks)
    experts = [c.name for c in find_experts(module)] if blocks is None else []
    if any(path == e or path.startswith(f"{e}.") for e in experts):
        outside = [c for n, c in module.named_modules() if isinstance(c, (nn.ModuleList, nn.Sequential))
                   and len(c) >= 2 and len({type(b) for b in c}) == 1
                   and not any(n == e or n.startswith(f"{e}.") for e in experts)]
        if outside:
            container = max(outside, key=len)  # the first of the longest
    return container


def advise_module(module, batch, devices: int, device_memory: int, batch_size: int | None = None, **kwargs) -> Advice:
    """Profile ``module`` on ``batch`` and advise for a global batch of ``batch_size`` (default: ``batch``'s size)."""
    import torch

    profile = profile_lightning_module(module, batch, precision=kwargs.get("precision", "32-true"))
    size = batch_size or next(t for t in _leaves(batch) if isinstance(t, torch.Tensor)).shape[0]
    return advise(profile, devices, device_memory, size, **kwargs)


def _leaves(batch):
    from lightning_par._compat import tree_flatten

    return tree_flatten(batch)[0]
