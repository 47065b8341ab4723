"""The setup check of context parallelism's rewrite: each kind of block of the stack run whole on one process and
run under context parallelism over the group, on the same recorded inputs; a block that differs is refused.

    >>> inputs = record_inputs(model, block_kinds(model), lambda: model(sample))          # doctest: +SKIP
    >>> check_context_blocks(model, inputs, cp_group, method="ring")                       # doctest: +SKIP
    ValueError: context parallel (context_parallel_method='ring'): the setup check of 'blocks.0' (MeanMixer) ...

[Note: the setup check of a context-parallel block]
Context parallelism runs a block on this rank's piece of the sequence ([Note: where the sequence is cut]) and routes
only its attention across the group. Anything else in the block that mixes positions (a mean or a cumulative sum
over the sequence, a causal convolution over time, a position's own table looked up by index) sees this rank's
piece alone and computes something else, silently; the probe ([Note: the setup check of context parallelism] in
context/probe.py) only sees that the block calls an attention the method serves. So the rewrite is run as [Note:
the setup check] in lightning_par/verify.py runs every rewrite: a perturbed copy of the first block of each class,
whole, against a copy with the hooks of a one-block stack (:func:`apply_context_parallel_to_block`: it cuts what
enters in the load-balanced layout, routes attention over the group, gathers the output back to the whole
sequence), on the inputs recorded from one micro-batch of the user's step, comparing every output, input gradient
and parameter gradient within the tolerance derived there. The gathered output is whole on every rank; the
gradients are each rank's share times ``cp`` (the gather's scale), so their mean over the group, what training's
average over the group computes ([Note: gradients under context parallelism]), is what is compared. The copy and
the recorded inputs are broadcast from the group's first rank, so every rank runs the same check (the module's
weights are broadcast only later, and a rank's first batch could differ), and the ranks agree on the verdict with
an all-reduce of the largest difference relative to its allowance before any raises: every rank raises the same
``ValueError`` (the worst rank's, gathered), naming the block, the difference and the fix, or none does. Every
collective is one of the group's, under its timeout.

Cost: per kind of block, one forward and backward of the whole block and one of the rewritten block (its
attention's communication included) on one micro-batch, plus one more run of the user's step without gradients to
record the inputs; on the eager blocks, before activation checkpointing, tensor parallelism and compile, the
module untouched. A meta-built module (no weights to run) or a setup with no batch to draw is not checked.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.context.apply import apply_context_parallel_to_block
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.verify import Inputs, Verdict, agree, apply_setup_check, on_cpu, refuse_if_different, tensors_in


def block_kinds(module: nn.Module, blocks: Optional[str] = None) -> list[str]:
    """The dotted name of the first block of each class in ``module``'s block stack (``blocks``: its name, None:
    found)."""
    path, stack = find_blocks(module, blocks)
    names, seen = [], set()
    for i, block in enumerate(stack):
        if type(block) not in seen:
            seen.add(type(block))
            names.append(f"{path}.{i}" if path else str(i))
    return names


def check_context_blocks(module: nn.Module, inputs: Optional[dict[str, Inputs]], group, *, method: str = "ring",
                         seq_dim: int = 1) -> dict[str, Verdict]:
    """[Note: the setup check of a context-parallel block]: each block named in ``inputs`` (from
    :func:`lightning_par.verify.record_inputs`) whole against the block under context parallelism over ``group``
    with ``method``; ``ValueError`` naming the block, the largest difference and the fix where one differs, on
    every rank of ``group`` alike. Collective: every rank of ``group`` calls it together. Returns the verdicts."""
    src = dist.get_global_rank(group, 0)
    box = [on_cpu(inputs or {})]  # sent through the CPU: each rank's check moves them to its block's device
    dist.broadcast_object_list(box, src=src, group=group)  # every rank checks the same inputs
    inputs = box[0]
    cp = dist.get_world_size(group)
    verdicts = {}
    for name in sorted(inputs):
        block = module.get_submodule(name)
        synced = copy.deepcopy(block)
        try:
            with torch.no_grad():
                for t in synced.state_dict().values():  # the same block on every rank
                    if not t.is_meta:
                        dist.broadcast(t, src=src, group=group)
            leaves: list[torch.Tensor] = []

            def keep_leaves(mod, args, kwargs):
                leaves.extend(t for t in tensors_in((args, kwargs)) if t.is_leaf and t.requires_grad)

            def rewrite(b):
                b.register_forward_pre_hook(keep_leaves, with_kwargs=True)  # runs before cp's cut
                apply_context_parallel_to_block(b, name, group, method=method, seq_dim=seq_dim)
                return b

            def average(b):  # each rank's share × cp, averaged over the group: the whole gradient
                for t in [*leaves, *b.parameters()]:
                    if t.grad is None:
                        t.grad = torch.zeros_like(t)
                    dist.all_reduce(t.grad, group=group)
                    t.grad.div_(cp)

            verdict = apply_setup_check(synced, rewrite, inputs[name], after_backward=average)
        finally:
            del synced
        verdicts[name] = agree(verdict, group, next((p.device for p in block.parameters()), torch.device("cpu")))
        refuse_if_different(
            verdicts[name], name, block, f"context parallel (context_parallel_method={method!r})",
            f"`{name}` computes something else on this rank's piece of the sequence than on the whole (an operation "
            f"that mixes positions outside its attention, e.g. a mean or cumulative sum over the sequence or a "
            f"convolution over time, sees one piece only): train it with context_parallel_size=1, or try another "
            f"context_parallel_method.")
    return verdicts


__all__ = ["block_kinds", "check_context_blocks"]
