"""The setup check of a rewritten block: the block as the user wrote it and the block as a strategy rewrote it
(tensor-parallel shards, a context-parallel attention, experts placed over ranks) run forward and backward on
the same recorded inputs, and their outputs, input gradients and parameter gradients must agree.

[Note: the setup check]
A rewrite is only known to be right by running it: a family nobody tried can compute something else on shards
than on the whole (a tensor built with a stored head count, a head-interleaved fused projection) or hit an op
the rewrite has no rule for. Three things the first probe ([Note: the region probe] in tensor/probe.py) did not
do, each of which lets such a difference through:

- *Non-zero parameters.* Hugging Face initializes every bias to zero and every norm weight to one, so a forward
  that adds a bias once per rank, or skips it, looks right at init. :func:`perturb_` adds seeded noise to every
  parameter of the copy the check runs (half of the tensor's own root-mean-square, or 0.05 where that is 0)
  before the reference and the rewritten copy are made from it; the two copies hold the same values.
- *Recorded inputs.* A block's forward often needs more than a hidden state (rotary tables, ALiBi, masks, a
  residual); called with a random hidden state alone it fails, and was trusted unchecked. :func:`record_inputs`
  keeps the positional and keyword inputs of the first call of each named block during one run of the user's
  step on one micro-batch (the pipeline's setup trace, or the SPMD engine's one micro-batch at setup); the
  check runs the block on exactly those. A random hidden state remains the fallback where no step could be run.
  A meta-built module runs its step on the meta device (no weights, no memory): that records the inputs'
  shapes, dtypes and the objects beside them, and :func:`realize` gives each meta tensor seeded values
  (floating point: standard normal, rotary tables and additive masks included; integers: positions along the
  last dimension; booleans: true). Both runs get the same values, so a split that computes something else on
  them is caught as on recorded values; a block that indexes with such an integer beyond its range raises in
  the whole run and is reported not checked.
- *A tolerance from the arithmetic.* Two correct computations of a block differ by rounding only: a sum of
  ``n`` products rounds by about ``sqrt(n)`` units of the format's epsilon relative to its magnitude, and a
  block chains a few such sums (projections, attention, the output projection) and their backward.
  :func:`tolerance` allows ``16 · sqrt(n) · eps · (1 + max|reference|)``, ``n`` the block's width: 1.1e-5
  relative at fp32 width 32, 1.2e-4 at 4096. A missing or doubled bias of the perturbed size (~0.05 and up)
  is three orders above it (measured: a row-wise bias added once per rank, 9.8e-2 against 1.2e-5).

What is compared is every floating-point output, the gradient of every floating-point input and of every
parameter, under a fixed random weighting of the outputs (each output element gets its own gradient), in eval
mode (no dropout: the two runs must agree). Cost: one forward and backward of the whole block and one of the
rewritten block per kind of block, on one micro-batch, before the rank's share is materialized; the copies are
freed on the way out.

:func:`apply_setup_check` is the building block (no Lightning): the tensor plan calls it per region kind and
leaves a region that differs replicated ([Note: the region probe]); context parallelism calls it on one block of
the stack and expert parallelism runs its pieces (:func:`run_block`, :func:`compare`) on one MoE layer per kind
([Note: the setup check of an expert-parallel MoE layer] in experts/verify.py); both refuse at setup naming the
module and the difference.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

Inputs = tuple[tuple, dict]  # (args, kwargs) of one call


@dataclass
class Verdict:
    """What :func:`apply_setup_check` found: ``ok``, and otherwise what differs (``key``), by how much (``error``)
    against the allowance (``allowed``), or what the rewritten block raised (``raised``)."""

    ok: bool
    key: str = ""
    error: float = 0.0
    allowed: float = 0.0
    raised: str = ""

    def describe(self, name: str = "") -> str:
        who = f"{name}: " if name else ""
        if self.ok:
            return f"{who}the rewritten block matches the original"
        if self.raised:
            return f"{who}the rewritten block raised {self.raised}"
        return (f"{who}the rewritten block's {self.key} differs from the original's by {self.error:.2e} "
                f"(rounding allows {self.allowed:.2e})")


# -- recorded inputs -----------------------------------------------------------------------------------

def record_inputs(module: nn.Module, names: Iterable[str], run: Callable[[], Any]) -> dict[str, Inputs]:
    """``run()`` (the user's step) without gradients, keeping the inputs of the first call of each submodule in
    ``names``: tensors detached and copied, other objects deep-copied where they can be (a cache object the
    forward would mutate). A step that raises records what it reached; the error is not this check's."""
    wanted = {module.get_submodule(n): n for n in names}
    found: dict[str, Inputs] = {}

    def pre(mod, args, kwargs):
        name = wanted.get(mod)
        if name is not None and name not in found:
            found[name] = (_snapshot(args), _snapshot(kwargs))

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in wanted]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            run()
    except Exception:  # noqa: BLE001 -- the blocks not reached keep the hidden-state fallback
        pass
    finally:
        for h in handles:
            h.remove()
    return found


def map_tensors(fn: Callable[[torch.Tensor], Any], obj, other: Callable[[Any], Any] = lambda o: o):
    """``obj`` with every tensor inside its plain tuples, lists and dicts replaced by ``fn(tensor)`` and every other
    leaf by ``other(leaf)`` (a named tuple is a leaf: its type would not take a generator)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(map_tensors(fn, o, other) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(fn, o, other) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v, other) for k, v in obj.items()}
    return other(obj)


def _copied(obj):
    try:
        return copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 -- kept as it is
        return obj


def _snapshot(obj):
    return map_tensors(lambda t: t.detach().clone(), obj, _copied)


def on_cpu(obj):
    """``obj`` with its tensors on the CPU (to send through ``all_gather_object`` / ``broadcast_object_list``)."""
    return map_tensors(lambda t: t.cpu(), obj)


def fresh(inputs: Inputs, device: Optional[torch.device] = None) -> tuple[tuple, dict, list[torch.Tensor]]:
    """A copy of recorded ``inputs`` to call a block with: floating-point tensors require gradients (returned
    too, in order, for their gradients), other objects are copied again (each run mutates its own)."""
    leaves: list[torch.Tensor] = []

    def go(obj):
        t = obj.detach().clone() if device is None else obj.detach().to(device, copy=True)
        if t.is_floating_point():
            t.requires_grad_(True)
            leaves.append(t)
        return t

    args, kwargs = inputs
    return map_tensors(go, args, _snapshot), map_tensors(go, kwargs, _snapshot), leaves


def realize(inputs: Inputs, device: Optional[torch.device] = None, seed: int = 0) -> Inputs:
    """``inputs`` recorded on a meta-built module with every meta tensor given seeded values on ``device``
    (see [Note: the setup check]); other tensors and objects as they are. The same values on every rank."""
    g = torch.Generator().manual_seed(seed)

    def go(obj):
        if not obj.is_meta:
            return obj
        if obj.is_floating_point():
            t = torch.randn(obj.shape, generator=g)
        elif obj.dtype == torch.bool:
            t = torch.ones(obj.shape, dtype=torch.bool)
        else:
            last = obj.shape[-1] if obj.dim() else 1
            t = torch.arange(last).expand(obj.shape) if obj.dim() else torch.tensor(0)
        return t.to(device or "cpu", obj.dtype)

    args, kwargs = inputs
    return map_tensors(go, args), map_tensors(go, kwargs)


# -- running and comparing -----------------------------------------------------------------------------

def perturb_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Add seeded noise to every floating-point parameter of ``module`` in place (see [Note: the setup check]):
    half its root-mean-square, or 0.05 where that is 0 (a zero bias). Drawn on the CPU: every rank draws the same."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if not p.is_floating_point() or p.is_meta:
                continue
            rms = p.detach().float().pow(2).mean().sqrt().item() if p.numel() else 0.0
            scale = 0.5 * rms if rms > 0 else 0.05
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))
    return module


def run_block(m: nn.Module, inputs: Inputs, *, plain: Callable[[Any], Any] = lambda o: o,
              after_backward: Callable[[nn.Module], None] = lambda m: None,
              context: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Optional[torch.Tensor]]:
    """``m`` forward and backward (eval mode) on a fresh copy of ``inputs``: its floating-point outputs, the
    gradient of each floating-point input and of each parameter (by name). ``plain`` turns the output into
    plain tensors (a DTensor's full tensor); ``after_backward`` settles the gradients (tensor parallel's
    partial sums); forward and backward run under ``context()``."""
    device = next((p.device for p in m.parameters() if not p.is_meta), None)
    args, kwargs, leaves = fresh(inputs, device)
    m.eval()
    m.zero_grad(set_to_none=True)
    with context(), torch.enable_grad(), \
            torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
        outputs = [t for t in tensors_in(plain(m(*args, **kwargs))) if t.is_floating_point() and t.requires_grad]
        if not outputs:
            raise ValueError("no floating-point output that depends on its inputs or parameters")
        g = torch.Generator().manual_seed(1)
        loss = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outputs)
        loss.backward()
    after_backward(m)
    found: dict[str, Optional[torch.Tensor]] = {f"output {i}": o.detach() for i, o in enumerate(outputs)}
    for i, t in enumerate(leaves):
        found[f"input gradient {i}"] = None if t.grad is None else t.grad.detach()
    for name, p in m.named_parameters():
        found[f"gradient of {name}"] = None if p.grad is None else p.grad.detach()
    return found


def tolerance(ref: torch.Tensor, dtype: torch.dtype, width: int) -> float:
    """The rounding allowance of ``ref``, computed in ``dtype`` by a block of width ``width`` ([Note: the setup
    check]): ``16 · sqrt(width) · eps · (1 + max|ref|)``."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    return 16 * math.sqrt(max(width, 1)) * eps * (1.0 + ref.float().abs().max().item())


def compare(whole: dict, got: dict, dtype: torch.dtype, width: int,
            local_part: Callable[[torch.Tensor, torch.Tensor], tuple] = lambda mine, ref: (mine, ref)) -> Verdict:
    """The first tensor of ``got`` (the rewritten block's) that differs from ``whole``'s beyond :func:`tolerance`;
    ``local_part(mine, ref)`` gives the part of each to compare (a rank's shard and the region of the whole it
    covers)."""
    worst = Verdict(ok=True)
    for key, ref in whole.items():
        if ref is None:
            continue
        mine = got.get(key)
        if mine is None or tuple(mine.shape) != tuple(ref.shape):
            return Verdict(ok=False, key=key, error=math.inf, raised=f"no {key} of shape {tuple(ref.shape)}")
        mine, part = local_part(mine, ref)
        err = (mine.float() - part.float()).abs().max().item() if part.numel() else 0.0
        allowed = tolerance(ref, dtype, width)
        if not err <= allowed:
            return Verdict(ok=False, key=key, error=err, allowed=allowed)
        if worst.ok and err > worst.error:
            worst.error, worst.key, worst.allowed = err, key, allowed
    return worst


def apply_setup_check(original: nn.Module, rewrite: Callable[[nn.Module], nn.Module], inputs: Inputs, *,
                      width: Optional[int] = None, plain: Callable[[Any], Any] = lambda o: o,
                      after_backward: Callable[[nn.Module], None] = lambda m: None,
                      local_part=lambda mine, ref: (mine, ref), perturb: bool = True, parameters: bool = True,
                      context: Callable[[], Any] = contextlib.nullcontext) -> Verdict:
    """[Note: the setup check]: a perturbed copy of ``original`` (left unchanged) run whole, and another copy
    after ``rewrite(copy)``, both on ``inputs`` (from :func:`record_inputs`); what differs, as a :class:`Verdict`.
    ``width``: the block's width for the tolerance (default: the largest last dimension of its inputs);
    ``parameters=False`` compares outputs and input gradients only (a rewrite whose parameters are other tensors).
    Every rank of a rewrite that communicates must call it alike."""
    base = copy.deepcopy(original)
    try:
        if perturb:
            perturb_(base)
        dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
        if width is None:
            width = max((t.shape[-1] for t in tensors_in(inputs) if t.is_floating_point() and t.dim()), default=1)
        whole = run_block(copy.deepcopy(base), inputs)
        try:
            rewritten = rewrite(base)
            got = run_block(rewritten, inputs, plain=plain, after_backward=after_backward, context=context)
        except Exception as e:  # noqa: BLE001 -- reported as what the rewrite does wrong
            return Verdict(ok=False, raised=first_line(e))
        if not parameters:
            whole = {k: v for k, v in whole.items() if not k.startswith("gradient of ")}
        return compare(whole, got, dtype, width, local_part)
    finally:
        del base
        gc.collect()


def refuse_if_different(verdict: Verdict, module_name: str, module: nn.Module, owner: str, fix: str) -> None:
    """What context and expert parallelism do with a block that differs: a ``ValueError`` at setup naming the
    module, the difference and ``fix`` (``owner``: the rewrite, e.g. ``"context parallel"``)."""
    if not verdict.ok:
        raise ValueError(f"{owner}: the setup check of {module_name!r} ({type(module).__name__}) failed: "
                         f"{verdict.describe()}. {fix} (verify=False skips this check for a model you know.)")


def _ratio(v: Verdict) -> float:
    if v.ok:
        return v.error / v.allowed if v.allowed > 0 else 0.0
    r = v.error / v.allowed if v.allowed > 0 and not v.raised else math.inf
    return math.inf if math.isnan(r) else max(r, 1.0 + 1e-6)


def agree(verdict: Verdict, group, device: torch.device) -> Verdict:
    """The verdict of ``group``: this rank's where every rank's passed, else the worst rank's (every rank alike, so
    every rank refuses or none does)."""
    import torch.distributed as dist

    worst = torch.tensor([_ratio(verdict)], dtype=torch.float32, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    if worst.item() <= 1.0:
        return verdict
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, verdict, group=group)
    return max(every, key=_ratio)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def tensors_in(obj):
    """Every tensor inside ``obj`` (tuples, lists, dicts and Hugging Face ``ModelOutput``s, depth first)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)
    elif hasattr(obj, "to_tuple"):  # a Hugging Face ModelOutput
        yield from tensors_in(obj.to_tuple())


__all__ = ["Inputs", "Verdict", "agree", "apply_setup_check", "compare", "first_line", "fresh", "map_tensors", "on_cpu",
           "perturb_", "record_inputs", "refuse_if_different", "run_block", "tensors_in", "tolerance"]
