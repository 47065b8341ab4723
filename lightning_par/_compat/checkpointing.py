"""Private torch APIs of activation checkpointing (:mod:`lightning_par.memory.checkpointing`; part of
:mod:`lightning_par._compat`, which re-exports them)."""
from __future__ import annotations


# -- torch: composable activation checkpointing -----------------------------------------------------------
def composable_checkpoint(module, context_fn=None):
    """Apply ``torch.distributed._composable.checkpoint`` (non-reentrant activation checkpointing installed as
    forward hooks: no wrapper module, parameter names unchanged) to ``module``, with ``context_fn`` (a selective
    checkpoint policy's contexts) if given; returns the function that takes it out again.

    [Note: taking composable checkpointing out]
    torch's composable API has no undo: it registers two hooks without returning their handles and marks the
    module in its composable-API state (applying it twice is an error). The undo removes exactly the hooks this
    call added (the keys new in the module's hook dicts) and the mark, so a later run may apply it again, in
    another mode, or not at all."""
    import importlib

    from torch.distributed._composable import checkpoint

    contract = importlib.import_module("torch.distributed._composable.contract")
    dicts = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
             "_forward_hooks_always_called")
    before = {d: set(getattr(module, d)) for d in dicts}
    checkpoint(module, **({"context_fn": context_fn} if context_fn is not None else {}))
    added = {d: set(getattr(module, d)) - before[d] for d in dicts}

    def undo() -> None:
        for d, keys in added.items():
            for k in keys:
                getattr(module, d).pop(k, None)
        states = module.__dict__.get(contract.STATE_KEY, {})  # keyed by the undecorated function
        for key in [k for k in states if getattr(k, "__name__", None) == "checkpoint"]:
            del states[key]
        module.__dict__.get(contract.REGISTRY_KEY, {}).pop("checkpoint", None)

    return undo


def is_checkpointed(module) -> bool:
    """Whether composable activation checkpointing is applied to ``module`` now."""
    import importlib

    contract = importlib.import_module("torch.distributed._composable.contract")
    return "checkpoint" in module.__dict__.get(contract.REGISTRY_KEY, {})
