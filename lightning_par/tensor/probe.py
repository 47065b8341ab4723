"""The setup check of a tensor-parallel plan: every kind of region is run once, sharded, on a copy, before
the real module is touched, and compared with the same copy unsharded.

[Note: the region probe]
The plan is built from the module tree alone; what a module's code does with its sharded outputs is only
known by running it. A family nobody tried can still meet an op DTensor has no rule for, mix plain
tensors and DTensors in a way [Note: one layout per region] does not foresee, or compute something else
on shards than on the whole (a tensor built with a stored head count). So at setup, before the real module is parallelized, :func:`check_regions` takes one region of each kind (same
class, parameter shapes and plan inside), copies it once, perturbs the copy's parameters (Hugging Face's zero
biases and unit norms would hide a bias handled wrong), runs it whole, shards it exactly as the plan would and
runs it again, forward and backward, on the inputs that region received in one run of the user's step on one
micro-batch (recorded by the engine: rotary tables, masks, ALiBi, a residual all as in training), in eval mode
(no dropout: the two runs must agree); see [Note: the setup check] in lightning_par/verify.py for the tolerance
(rounding of a sum of ``width`` terms) and what is compared. A meta-built module's step runs on the meta device
(no memory): its recorded inputs are shapes, given seeded values (``realize`` there). Where no step could be run
(outside fit) the region gets a small random hidden state ``(2, 4, width)`` (and another for each further required
positional input, such as a decoder layer's ``memory``); a region that cannot be called that way is trusted and
the plan says so (``TensorPlan.checked``). The sharded copy must not raise and must give the same outputs, input
gradients and parameter gradients as the whole one. A fused projection that fails split part by part is tried
split plain column-wise (whole heads: Bloom's ``query_key_value`` interleaves q, k and v head by head) and kept
so if that matches. Otherwise every region of that kind is left replicated, with a warning that names it and
the largest difference or what raised. Under ``sequence_parallel=True`` a failure is refused instead (a
replicated region cannot take a sequence-split residual stream). Every tensor-parallel rank runs the same check
and the verdicts are agreed with one all-reduce, so all ranks keep the same plan.

What it costs a rank is transient and comes before its share is materialized: one forward and backward of the
region whole and one sharded, per kind of region (plus, where inputs are recorded, one forward of the user's step
on one micro-batch without gradients); memory: the region's weights whole, their gradients (kept for the
comparison) and the shards and their gradients, about 2 × the region (the copy is sharded in place). Each rank
compares its own shard of the sharded gradients with the same region of the whole ones (nothing is gathered whole
again), and the copies are released on the way out: a parallelized copy refers to itself through its wrapped ``forward``,
so dropping it would free nothing until a garbage collection (measured: one whole MLP of HF Llama,
12 MiB of a 68 MiB share, held into training).
"""
from __future__ import annotations

import copy
import gc
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_par.materialize import has_meta, initialize, materialize, release
from lightning_par.tensor.mixed import reduce_partial_grads
from lightning_par.tensor.plan import FUSED, PREPARE, TensorPlan
from lightning_par.tensor.regions import add_islands
from lightning_par.tensor.trace import required_positional
from lightning_par.verify import compare, first_line, perturb_, realize, run_block
from lightning_par.weights.regions import dtensor_region, region_slices

PROBE_SHAPE = (2, 4)  # batch, sequence of the probe's hidden state
_OK, _TRUSTED, _FAILED = 0, 1, 2


def check_regions(module: nn.Module, plan: TensorPlan, mesh: DeviceMesh, *, sequence_parallel: bool = False,
                  inputs: Optional[dict] = None) -> TensorPlan:
    """Run [Note: the region probe] on ``module`` (unchanged) and update ``plan`` in place; returns it.
    ``inputs``: recorded inputs of regions ({region: (args, kwargs)}, :func:`lightning_par.verify.record_inputs`
    on :func:`probe_targets`); a kind without them is run on random hidden states."""
    kinds = region_kinds(module, plan)
    if not kinds:
        return plan
    inputs = inputs or {}
    groups = list(kinds.values())

    def agreed(verdicts):
        codes = torch.tensor([code for code, _ in verdicts], dtype=torch.int64, device=_device(module, mesh))
        if mesh.size() > 1:
            dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=mesh.get_group())
        return codes.tolist()

    def probe(p, regions):
        target = next((r for r in regions if r in inputs), regions[0])
        return _probe(module, p, target, mesh, inputs.get(target))

    verdicts = [probe(plan, regions) for regions in groups]
    codes = agreed(verdicts)
    # a fused projection that fails split part by part may be head-interleaved (Bloom's query_key_value: q, k, v
    # of head 0, then of head 1, ...): a plain column-wise split keeps whole heads, each with its q, k and v
    retry = [i for i, code in enumerate(codes)
             if code == _FAILED and any(plan.styles.get(n) == FUSED for n in _inside(plan, groups[i][0]))]
    if retry:
        tried = [_unfused(plan, groups[i]) for i in retry]
        again = agreed([probe(t, groups[i]) for t, i in zip(tried, retry)])
        for i, code in zip(retry, again):
            if code == _OK:
                for n in [n for r in groups[i] for n in _inside(plan, r) if plan.styles[n] == FUSED]:
                    plan.styles[n] = "colwise"
                    plan.parts.pop(n, None)
                codes[i] = _OK
                verdicts[i] = (_OK, MATCHES + " (its fused projection split by whole heads: the parts are "
                                              "interleaved head by head)")
    for (code, what), agreed_code, regions in zip(verdicts, codes, groups):
        if agreed_code == _FAILED and code != _FAILED:
            what = "failed on another tensor-parallel rank"
        for region in regions:
            plan.checked[region] = what
        if agreed_code == _FAILED:
            _leave_replicated(module, plan, regions, what, sequence_parallel)
    add_islands(plan, module)  # a region left replicated inside another one is now an island of it
    return plan


MATCHES = "sharded copy matches the whole one"


def region_kinds(module: nn.Module, plan: TensorPlan) -> dict[tuple, list[str]]:
    """The plan's regions grouped by kind (same class, parameter shapes and plan inside), plan order."""
    kinds: dict[tuple, list[str]] = {}
    for region in plan.regions():
        kinds.setdefault(_kind(module, plan, region), []).append(region)
    return kinds


def probe_targets(module: nn.Module, plan: TensorPlan) -> list[str]:
    """The regions the check runs (the first of each kind): the ones whose inputs to record."""
    return [regions[0] for regions in region_kinds(module, plan).values()]


def _inside(plan: TensorPlan, region: str) -> list[str]:
    return [n for n in plan.styles if n.startswith(region + ".")]


def _unfused(plan: TensorPlan, regions: list[str]) -> TensorPlan:
    """``plan`` with the fused projections inside ``regions`` split plain column-wise."""
    out = TensorPlan(styles=dict(plan.styles), parts=dict(plan.parts), source=plan.source)
    out.islands = dict(plan.islands)
    for r in regions:
        for n in _inside(plan, r):
            if out.styles[n] == FUSED:
                out.styles[n] = "colwise"
                out.parts.pop(n, None)
    return out


def _kind(module: nn.Module, plan: TensorPlan, region: str) -> tuple:
    m = module.get_submodule(region)
    inside = lambda names: tuple(sorted((n[len(region):], s) for n, s in names.items()  # noqa: E731
                                        if n.startswith(region + ".")))
    return (type(m).__qualname__, tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()),
            inside(plan.styles), inside(plan.islands))


def _sub_plan(plan: TensorPlan, region: str) -> TensorPlan:
    """The part of ``plan`` inside ``region``, with names relative to it (the region itself is ``""``)."""
    def rel(names):
        return {n[len(region) + 1:]: v for n, v in names.items() if n.startswith(region + ".")}

    sub = TensorPlan(styles={"": PREPARE, **rel(plan.styles)}, parts=rel(plan.parts), source=plan.source)
    sub.islands = {n: (r[len(region) + 1:] if r != region else "") for n, r in rel(plan.islands).items()}
    return sub


def _probe(module: nn.Module, plan: TensorPlan, region: str, mesh: DeviceMesh, inputs=None) -> tuple[int, str]:
    copies: list[nn.Module] = []  # released on the way out: a parallelized copy is a cycle (see release)
    try:
        return _probe_copies(module, plan, region, mesh, copies, inputs)
    finally:
        for c in copies:
            release(c)
        if copies:  # what the copies' sharding replaced (a whole weight) can sit in a cycle too: free it now
            gc.collect()


def _probe_copies(module: nn.Module, plan: TensorPlan, region: str, mesh: DeviceMesh, copies: list,
                  inputs) -> tuple[int, str]:
    """One private copy of the region, perturbed ([Note: the setup check] in lightning_par/verify.py), run whole,
    then sharded in place and run again on the same inputs."""
    from lightning_par.tensor.parallelize import backward_context, parallelize, to_plain

    m = module.get_submodule(region)
    copies.append(copy.deepcopy(m))
    m = copies[-1]
    if has_meta(m):  # a meta-built module: the copy of the region gets storage and init
        if initialize(m, materialize(m, torch.device(mesh.device_type)), seed=0):
            return _TRUSTED, "not checked (built on the meta device, and no init gives all of its weights)"
    perturb_(m)
    sub = _sub_plan(plan, region)
    first = next((n for n, s in sub.styles.items() if s in ("colwise", FUSED)), None)  # reads the region's input
    weight = getattr(m.get_submodule(first), "weight", None) if first else None
    width = getattr(m.get_submodule(first), "in_features", None) if first else None
    if weight is None or not isinstance(width, int):
        return _TRUSTED, "not checked (no input width found)"
    dtype, device = weight.dtype, weight.device
    del weight
    recorded = inputs is not None
    if recorded:  # recorded on a meta-built module: seeded values ([Note: the setup check])
        inputs = realize(inputs, device)
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(*PROBE_SHAPE, width, generator=g).to(device, dtype)
        # further required positional inputs (a decoder layer's ``memory``) get other random hidden states
        extra = [torch.randn(*PROBE_SHAPE, width, generator=g).to(x) for _ in range(required_positional(m) - 1)]
        inputs = ((x, *extra), {})
    try:
        whole = run_block(m, inputs)
    except Exception as e:  # noqa: BLE001 -- any failure means "cannot be called with a hidden state alone"
        if recorded:
            return _TRUSTED, f"not checked (the whole module raised on its recorded inputs: {first_line(e)})"
        return _TRUSTED, f"not checked (its forward needs more than a hidden state: {first_line(e)})"

    def settle(sharded):
        for name, p in sharded.named_parameters():
            if isinstance(p, DTensor) and p.grad is not None and not isinstance(p.grad, DTensor):
                raise RuntimeError(f"the DTensor parameter {name} got a plain gradient")
        reduce_partial_grads(sharded.parameters(), mesh.get_group())  # as the strategy does after backward

    try:
        sharded = parallelize(m, sub, mesh, check=False)
        got = run_block(sharded, inputs, plain=to_plain, after_backward=settle, context=backward_context)
    except Exception as e:  # noqa: BLE001 -- reported as the reason the region stays replicated
        return _FAILED, f"the sharded module raised {first_line(e)}"
    verdict = compare(whole, got, dtype, width, _local_part)
    if verdict.ok:
        return _OK, MATCHES
    return _FAILED, (f"the sharded module's {verdict.key} differs from the whole module's by {verdict.error:.2e} "
                     f"(rounding allows {verdict.allowed:.2e})")


def _leave_replicated(module: nn.Module, plan: TensorPlan, regions: list[str], what: str, sequence_parallel: bool):
    name = type(module.get_submodule(regions[0])).__name__
    if sequence_parallel:
        raise ValueError(f"tensor parallel: the setup check of {regions[0]!r} ({name}) failed: {what}. Under "
                         f"sequence_parallel=True it cannot be left replicated; use sequence_parallel=False (it is "
                         f"then left replicated), or give `plan` entries 'replicate' for its layers.")
    for region in regions:
        for n in [n for n in plan.styles if n == region or n.startswith(region + ".")]:
            del plan.styles[n]
            plan.parts.pop(n, None)
        for n in [n for n, r in plan.islands.items() if r == region or n.startswith(region + ".")]:
            del plan.islands[n]
        plan.replicated[region] = f"left replicated: the setup check failed ({what})"
    shown = ", ".join(repr(r) for r in regions[:3]) + (f" and {len(regions) - 3} more" if len(regions) > 3 else "")
    warnings.warn(f"tensor parallel: {shown} ({name}) left replicated: running it sharded on a copy at setup, "
                  f"{what}. Every rank computes it whole; give `plan` entries to shard it differently.", stacklevel=4)


def _local_part(mine: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DTensor's local shard and the region of the plain ``ref`` it covers (a strided shard, several blocks of
    the full tensor, is compared whole); plain tensors as they are."""
    if not isinstance(mine, DTensor):
        return mine, ref
    try:
        region = dtensor_region(mine)
    except ValueError:
        return mine.full_tensor(), ref
    return mine.to_local(), ref[region_slices(region)]


def _device(module: nn.Module, mesh: DeviceMesh) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None and not has_meta(module) else torch.device(mesh.device_type)
