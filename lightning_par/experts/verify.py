"""The setup check of expert parallelism: one MoE layer of each kind run whole on one process and with its experts
divided over the expert-parallel group (tokens sent by all-to-all; or over the tensor-parallel group alone), on the
same recorded inputs; a layer that differs is refused at setup.

    >>> kept = keep_moe_layers(model, find_experts(model))  # before the experts are divided   # doctest: +SKIP
    >>> inputs = record_inputs(model, list(kept), lambda: model(sample))       # doctest: +SKIP
    >>> applied = apply_experts(model, topology, rank, expert_parallel_size=2)  # doctest: +SKIP
    >>> check_expert_layers(kept, inputs, applied)                             # doctest: +SKIP
    ValueError: expert parallel (expert_parallel_size=2): the setup check of 'model.layers.0.moe' (RenormMoE) ...

[Note: the setup check of an expert-parallel MoE layer]
Expert parallelism changes how an MoE layer computes: its router runs as written, but the experts module is called
on the (token, expert) pairs a rank received, as top-1 routing with the pair's weight ([Note: the dispatch of one
MoE layer] in experts/dispatch.py), or a per-expert loop is recorded and replayed ([Note: record and replay of a
per-expert loop] in experts/replay.py). An experts module that looks at more than one pair of a token at once (it
renormalizes its top-k weights itself, adds its k outputs in another way, reads the token's position in the batch)
computes something else there, silently. So the rewrite is run as [Note: the setup check] in lightning_par/verify.py
runs every rewrite: the MoE layer (the module holding the router and the experts container, e.g. a decoder layer's
``mlp``), the first of each class, is copied whole before step 6 divides the experts (:func:`keep_moe_layers`),
its inputs recorded on one micro-batch of the user's step; after step 6 a perturbed copy of it runs whole, and
another copy of the same perturbed layer has its experts divided over the same expert-parallel group as the module
(:func:`~lightning_par.experts.apply.apply_expert_parallel` on the copy, the container named relative to it), both
on the recorded inputs. Compared: every floating-point output, every input gradient, every dense parameter's
gradient (the router's, a shared expert's), and each rank's own experts' gradients against the same experts of the
whole copy (a fused tensor's rows ``[r E/ep, (r+1) E/ep)``, a per-expert list's modules under their own names),
within the tolerance derived there. Every rank runs the same inputs (broadcast from the group's first rank with the
layer's state), so each expert's holder receives every pair ``ep`` times and its gradient is ``ep`` times the
whole's: it is divided by ``ep`` (the experts' :meth:`~lightning_par.experts.ExpertParallel.finish_gradients` with
``ep`` replicas and no replica group). The ranks agree on the verdict (an all-reduce of the largest difference
relative to its allowance over the group, as context parallel's check does): every rank raises the same
``ValueError`` naming the layer, the difference and the fix, or none does. Every collective is one of the group
the experts are divided over (ep, or tp), under its timeout.

Cost: per kind of MoE layer, one forward and backward of the whole layer and one of the divided layer (its
all-to-alls included) on one micro-batch, plus one run of the user's step without gradients to record the inputs,
and one copy of one MoE layer per kind held from step 6 to 7. Before compile and before the rank's share is
materialized. A meta-built module (no weights to run) is not checked: :func:`check_expert_layers` is not called and
the summary says so. The experts divided over the tensor-parallel group alone ([Note: experts divided over the
tensor-parallel group] in experts/dispatch.py: ``expert_parallel_size=1``) are checked the same way over that group
(no division of gradients there: every rank holds the same tokens, and each expert's gradient is whole on its
holder; :meth:`~lightning_par.experts.ExpertParallel.finish_gradients` does nothing under ``tp``).
"""
from __future__ import annotations

import copy
import gc
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.experts.apply import ExpertParallel, apply_expert_parallel, apply_tensor_experts
from lightning_par.experts.discovery import ExpertContainer
from lightning_par.verify import (Inputs, Verdict, agree, compare, first_line, on_cpu, perturb_, run_block,
                                  tensors_in)


def moe_layer_name(c: ExpertContainer) -> Optional[str]:
    """The qualified name of the MoE layer of container ``c``: the module whose forward routes tokens to it (its
    parent), or None for a container with no parent."""
    return c.name.rsplit(".", 1)[0] if "." in c.name and c.parent is not None else None


def keep_moe_layers(module: nn.Module, containers: list[ExpertContainer]) -> dict[str, tuple[nn.Module, str]]:
    """A whole copy of the first MoE layer of each class (before the experts are divided): {layer name: (copy, the
    container's name relative to the layer)}."""
    kept, seen = {}, set()
    for c in containers:
        name = moe_layer_name(c)
        if name is None or type(c.parent) in seen:
            continue
        seen.add(type(c.parent))
        kept[name] = (copy.deepcopy(c.parent), c.name[len(name) + 1:])
    return kept


def check_expert_layers(kept: dict[str, tuple[nn.Module, str]], inputs: Optional[dict[str, Inputs]],
                        applied: ExpertParallel) -> dict[str, Verdict]:
    """[Note: the setup check of an expert-parallel MoE layer]: each layer of ``kept`` (from :func:`keep_moe_layers`)
    whole against the layer with its experts divided as ``applied`` divides the module's, on ``inputs`` (from
    :func:`lightning_par.verify.record_inputs`); ``ValueError`` naming the layer, the largest difference and the
    fix where one differs, on every rank of the group alike. Collective over ``applied.group``. A layer the step
    did not reach (no recorded inputs on the group's first rank) is not checked. Returns the verdicts."""
    group, ep = applied.group, applied.ep
    divided = {c.name for c in applied.containers}
    kept = {n: v for n, v in kept.items() if f"{n}.{v[1]}" in divided}  # the layers whose experts the step divided
    src = dist.get_global_rank(group, 0)
    box = [on_cpu({n: v for n, v in (inputs or {}).items() if n in kept})]
    dist.broadcast_object_list(box, src=src, group=group)  # every rank checks the same inputs
    inputs = box[0]
    verdicts = {}
    for name in sorted(inputs):
        layer, rel = kept[name]
        cls = type(layer)
        try:
            with torch.no_grad():
                for t in layer.state_dict().values():  # the same layer on every rank
                    dist.broadcast(t, src=src, group=group)
            verdict = _check_layer(layer, rel, inputs[name], applied)
        finally:
            kept[name] = (None, rel)  # the copy freed once checked
            del layer
            gc.collect()
        device = next((t.device for t in tensors_in(inputs[name])), torch.device("cpu"))
        verdicts[name] = agree(verdict, group, device)
        if not verdicts[name].ok:
            how = (f"expert_parallel_size={ep}" if applied.axis == "ep" else
                   f"expert_parallel_size=1, the experts divided over tensor_parallel_size={ep}")
            fix = ("Train it with expert_parallel_size=1, or name" if applied.axis == "ep" else
                   "Train it with tensor_parallel_size=1, or name")
            raise ValueError(
                f"expert parallel ({how}): the setup check of {name!r} ({cls.__name__}) failed: "
                f"{verdicts[name].describe()}. `{name}` computes something else with its experts divided over ranks "
                f"than whole (its experts module is called on the (token, expert) pairs a rank serves, one pair a "
                f"row with its routing weight: an experts forward that looks at a token's k choices together, e.g. "
                f"renormalizes its top-k weights itself, sees one). {fix} the containers expert parallelism may "
                f"divide with experts='<glob>' (leaving this one out); verify=False skips this check for a model "
                f"you know.")
    return verdicts


def _check_layer(layer: nn.Module, rel: str, inputs: Inputs, applied: ExpertParallel) -> Verdict:
    """One layer: a perturbed copy whole, and the same copy with its experts divided as ``applied``'s are."""
    base = copy.deepcopy(layer)
    perturb_(base)
    dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
    width = max((t.shape[-1] for t in tensors_in(inputs) if t.is_floating_point() and t.dim()), default=1)
    whole = run_block(copy.deepcopy(base), inputs)
    made: list[ExpertParallel] = []
    try:
        # the same division as the module's, over the same group; each holder's gradient divided by ep (every rank
        # sent the same tokens), no replica group
        if applied.axis == "ep":
            made.append(apply_expert_parallel(base, applied.group, None, ep=applied.ep, rank=applied.rank,
                                              replicas=applied.ep, experts=rel, timeout=applied.timeout))
        else:  # over the tp group: every rank holds the same tokens; each gradient is whole on its rank already
            made.append(apply_tensor_experts(base, applied.group, size=applied.ep, rank=applied.rank, experts=rel,
                                             timeout=applied.timeout))
        got = run_block(base, inputs, after_backward=lambda m: made[0].finish_gradients())
    except Exception as e:  # noqa: BLE001 -- reported as what the rewrite does wrong
        return Verdict(ok=False, raised=first_line(e))
    finally:
        for m in made:
            m.remove()
    # a per-expert list's experts held by other ranks are not in this rank's copy: their gradients are theirs
    whole = {k: v for k, v in whole.items() if k in got or not k.startswith(f"gradient of {rel}.")}

    def local_part(mine: torch.Tensor, ref: torch.Tensor):
        if isinstance(mine, DTensor):  # a fused expert tensor: this rank's rows of the whole's
            local = mine.to_local()
            lo = applied.rank * local.shape[0]
            return local, ref[lo:lo + local.shape[0]]
        return mine, ref

    return compare(whole, got, dtype, width, local_part)


def describe_check(verdicts: Optional[dict[str, Verdict]], verify: bool, meta: bool) -> str:
    """The plan summary's line on the check: what it checked and how close, or why it did not run."""
    if not verify:
        return "setup check: off (verify=False)"
    if meta:
        return "setup check: not run (a meta-built module has no weights to run its MoE layers on)"
    if verdicts is None:
        return ("setup check: not run (no micro-batch to record the MoE layers' inputs on, or no module around the "
                "experts container to run)")
    if not verdicts:
        return "setup check: not run (the step reached no MoE layer)"
    worst = max(v.error / v.allowed if v.allowed > 0 else 0.0 for v in verdicts.values())
    return (f"setup check: {', '.join(sorted(verdicts))} divided match whole (largest difference "
            f"{worst:.2g} of the rounding allowance)")


__all__ = ["check_expert_layers", "describe_check", "keep_moe_layers", "moe_layer_name"]
