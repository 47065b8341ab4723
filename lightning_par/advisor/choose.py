"""The seeds' rule for choosing a layout, applied to estimated memory, and the cheapest plan when it does not fit.

"选择数据并行还是模型并行，核心判断依据是'单卡是否能够容纳完整模型'": the model fits on one device →
data parallel over every device. It does not → every plan that fits is priced in step time and the cheapest
wins ([Note: the time cost of a plan]): a higher ZeRO stage (communication), activation checkpointing
(recompute, timed by the probe), pipeline stages (the bubble), tensor shards or sequence shards (context
parallelism, for a module whose blocks call SDPA: communication).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lightning_par.advisor.memory import CHECKPOINTING, Estimate, Layout, estimate, recompute_share
from lightning_par.advisor.profile import ModuleProfile

GiB = 1024**3


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    estimate: Estimate
    fits: bool
    reason: str
    time_cost: float = 0.0  # estimated extra step time over the ideal compute per device, a fraction
    cost_detail: str = ""   # what it is made of (recompute, bubble, communication)


@dataclass(frozen=True)
class Advice:
    """The recommended layout, why, and every candidate considered (one line of reasoning each)."""

    choice: Candidate | None
    why: str
    candidates: list[Candidate] = field(default_factory=list)
    devices: int = 1
    device_memory: int = 0

    def table(self) -> str:
        """One row per candidate; activation-checkpointing rows only where the same layout without it does not
        fit (where it does, checkpointing only costs time)."""
        head = (f"{'layout':44s} {'params':>9s} {'grads':>9s} {'optim':>9s} {'activ':>9s} {'total':>9s} "
                f"{'comm/step':>10s} {'time':>6s}  fits  why")
        rows = [head, "-" * len(head)]
        plain_fits = {_without_ac(c.layout) for c in self.candidates
                      if c.fits and c.layout.activation_checkpointing is None}
        for c in self.candidates:
            if c.layout.activation_checkpointing is not None and _without_ac(c.layout) in plain_fits:
                continue
            e = c.estimate
            mark = "*" if self.choice is not None and c.layout == self.choice.layout else " "
            rows.append(
                f"{mark}{c.layout.name:43s} {_fmt(e.param_bytes)} {_fmt(e.grad_bytes)} {_fmt(e.optimizer_bytes)} "
                f"{_fmt(e.activation_bytes)} {_fmt(e.total_bytes)} {_fmt(e.comm_bytes, 10)} "
                f"{c.time_cost:+6.0%}  {'yes ' if c.fits else 'no  '}  {c.reason}"
            )
        rows.append(f"recommended: {self.choice.layout.name if self.choice else 'none fits'} — {self.why}")
        return "\n".join(rows)


def _fmt(nbytes: float, width: int = 9) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:{width - 4}.1f} {unit}"
    return f"{int(nbytes):{width - 2}d} B"


def _without_ac(layout: Layout) -> Layout:
    return dataclasses.replace(layout, activation_checkpointing=None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_sizes(profile: ModuleProfile, devices: int, schedule: str, context: bool = True) -> list[int]:
    """The context-parallel sizes the advisor tries: 1, and, for a module whose every block's attention a method
    serves (:attr:`ModuleProfile.context_methods`), each divisor ``c`` of ``devices`` with ``2c`` dividing the
    sequence (the strategy's own conditions); none under the interleaved schedule, which the strategy refuses with
    cp."""
    if not context or not profile.context_methods or schedule == "interleaved_1f1b":
        return [1]
    return [c for c in _divisors(devices) if c == 1 or profile.seq_len % (2 * c) == 0]


def candidate_layouts(profile: ModuleProfile, devices: int, batch_size: int, schedule: str = "1f1b",
                      microbatches: int | None = None, zero_stages=(0, 1, 2, 3),
                      checkpointing=CHECKPOINTING, context: bool = True) -> list[Layout]:
    """Every (pp, cp, tp, dp) that multiplies to ``devices`` and that the model and batch allow, at each of
    ``zero_stages`` (with more than one replica) and each activation ``checkpointing`` mode; cp > 1 only where
    :func:`context_sizes` allows it (``context=False``: never), and not with a pipeline at ZeRO-2 / 3 (refused by
    the strategy). A module with routed experts also gets each ``expert_parallel_size`` > 1 dividing dp × cp and
    its experts, at ZeRO 0 and 1 (what the strategy runs with ep). cp uses the ring where it serves the module,
    else Ulysses (where cp divides each tensor-parallel rank's query heads)."""
    layouts = []
    method = "ring" if "ring" in profile.context_methods else "ulysses"
    for pp in _divisors(devices):
        if pp > profile.n_blocks:
            continue
        for cp in context_sizes(profile, devices // pp, schedule, context):
            for tp in _divisors(devices // (pp * cp)):
                if tp > 1 and (profile.hidden_size % tp or (profile.num_heads and profile.num_heads % tp)):
                    continue
                if cp > 1 and method == "ulysses" and ((profile.num_heads or 0) // tp) % cp:
                    continue
                dp = devices // (pp * cp * tp)
                m = 1
                if pp > 1:
                    per_replica = batch_size // dp
                    m = microbatches or min(2 * pp, per_replica)
                    if m < 1 or per_replica % m:
                        continue
                if batch_size % (dp * m):
                    continue
                eps = [e for e in _divisors(dp * cp) if profile.moe_blocks and e > 1 and profile.num_experts % e == 0]
                for ep in [1, *eps]:
                    for zero in (zero_stages if dp > 1 else (0,)):
                        if (cp > 1 and pp > 1 and zero >= 2) or (ep > 1 and zero >= 2):
                            continue
                        for ac in checkpointing:
                            layouts.append(Layout(dp, pp, tp, zero, schedule, m, activation_checkpointing=ac,
                                                  context_parallel_size=cp, expert_parallel_size=ep,
                                                  context_parallel_method=method if cp > 1 else "ring"))
    return layouts


# [Note: the time cost of a plan]
# Each plan is priced as its extra step time over the ideal (the step's compute split evenly over the devices),
# as a fraction: activation checkpointing's recompute (the probe's timing, :func:`recompute_share`); the pipeline
# bubble, (p-1)/m of the ideal for GPipe and 1F1B (Narayanan et al.: the bubble is (p-1)/(m+p-1) of the step),
# half of that interleaved (two chunks per rank), two thirds of it zero-bubble; and communication, the
# estimate's bytes per rank over ``link_bytes_per_s``, counted as not overlapped (DDP and FSDP overlap part of it:
# an upper bound). The compute is the probe's forward + backward per sample × the samples per device; a profile
# that was not timed prices communication at zero (and recompute at a third of a step) and puts tensor
# shards after everything else, as the seeds' rule does.
def bubble_share(layout: Layout) -> float:
    """The pipeline bubble as a fraction of the ideal step time ([Note: the time cost of a plan])."""
    p, m = layout.pipeline_parallel_size, layout.microbatches
    if p == 1:
        return 0.0
    base = (p - 1) / m
    return {"interleaved_1f1b": base / 2, "zero_bubble": base * 2 / 3}.get(layout.schedule, base)


def time_cost(profile: ModuleProfile, layout: Layout, est: Estimate, batch_size: int,
              link_bytes_per_s: float) -> tuple[float, str]:
    """The extra step time of ``layout`` over its ideal compute, a fraction, and what it is made of."""
    parts = []
    recompute = recompute_share(profile, layout.activation_checkpointing)
    if recompute:
        parts.append(f"recompute {recompute:.0%}")
    bubble = bubble_share(layout)
    if bubble:
        parts.append(f"bubble {bubble:.0%}")
    compute_s = profile.step_s_per_sample * batch_size / layout.devices
    comm = est.comm_bytes / link_bytes_per_s / compute_s if compute_s > 0 else 0.0
    if comm >= 0.005:
        parts.append(f"comm {comm:.0%}")
    return recompute + bubble + comm, ", ".join(parts) or "none"


def _kind(lay: Layout) -> str:
    if lay.tensor_parallel_size > 1:
        kind = "tensor parallel inside layers"
    elif lay.pipeline_parallel_size > 1:
        kind = "pipeline across layers"
    elif lay.context_parallel_size > 1:
        kind = "context parallel across the sequence"
    else:
        kind = "data parallel" + (f" + ZeRO-{lay.zero_stage}" if lay.zero_stage else "")
    if lay.expert_parallel_size > 1:
        kind += " + experts divided"
    if lay.context_parallel_size > 1 and (lay.tensor_parallel_size > 1 or lay.pipeline_parallel_size > 1):
        kind += " + context parallel"
    return kind + (" + activation checkpointing" if lay.activation_checkpointing is not None else "")


def _family(lay: Layout) -> str:
    """What a plan adds to plain data parallel, for the comparison printed beside the choice."""
    if lay.activation_checkpointing is not None:
        return "activation checkpointing"
    if lay.expert_parallel_size > 1:
        return "expert parallel"
    if lay.tensor_parallel_size > 1:
        return "tensor shards"
    if lay.pipeline_parallel_size > 1:
        return "pipeline stages"
    if lay.context_parallel_size > 1:
        return "sequence shards"
    return "a higher ZeRO stage" if lay.zero_stage else "data parallel"


def advise(profile: ModuleProfile, devices: int, device_memory: int, batch_size: int,
           precision: str = "32-true", optimizer: str = "adamw", schedule: str = "1f1b",
           microbatches: int | None = None, zero_stages=(0, 1, 2, 3), checkpointing=CHECKPOINTING,
           link_bytes_per_s: float = 12.5e9, context: bool = True) -> Advice:
    """Estimate every candidate layout and pick one: plain data parallel when the model fits (the seeds' rule),
    else the plan that fits at the least time cost ([Note: the time cost of a plan]; ``link_bytes_per_s``: the
    bandwidth each rank sends at, 100 Gbit/s by default; ``context``: also context-parallel layouts, where the
    module allows them)."""
    if devices < 1 or device_memory <= 0:
        raise ValueError(f"devices={devices} and device_memory={device_memory} must be positive.")
    layouts = candidate_layouts(profile, devices, batch_size, schedule, microbatches, zero_stages, checkpointing,
                                context)
    if not layouts:
        raise ValueError(f"No layout of {devices} devices divides batch_size={batch_size}: choose a batch "
                         f"divisible by the device count.")
    candidates = []
    for lay in layouts:
        e = estimate(profile, lay, batch_size, precision, optimizer)
        fits = e.total_bytes <= device_memory
        verdict = (f"fits, {e.total_bytes / device_memory:.1%} of memory" if fits
                   else f"needs {_fmt(e.total_bytes).strip()} of {_fmt(device_memory).strip()}")
        cost, detail = time_cost(profile, lay, e, batch_size, link_bytes_per_s)
        candidates.append(Candidate(lay, e, fits, f"{_kind(lay)}: {verdict}; time: {detail}", cost, detail))
    fitting = [c for c in candidates if c.fits]

    def rank(c: Candidate):
        lay = c.layout
        # an untimed profile cannot price communication: the seeds' order first (a pipeline before tensor shards)
        tier = 0 if profile.step_s_per_sample else (lay.tensor_parallel_size > 1)
        model = lay.pipeline_parallel_size * lay.tensor_parallel_size * lay.context_parallel_size
        return (tier, round(c.time_cost, 6), model, lay.zero_stage,
                lay.activation_checkpointing is not None, c.estimate.comm_bytes)

    plain = [c for c in fitting if c.layout == Layout(data_parallel_size=devices, schedule=c.layout.schedule,
                                                      microbatches=c.layout.microbatches)]
    if plain:
        choice = plain[0]
        why = "the model fits on one device: data parallel over every device (simplest, easiest recovery)"
    elif fitting:
        choice = min(fitting, key=rank)
        why = (f"the model does not fit on one device as it is: {_kind(choice.layout)} is the cheapest plan that "
               f"fits, {choice.time_cost:+.0%} step time ({choice.cost_detail})")
        others = {}
        for c in sorted(fitting, key=rank):
            others.setdefault(_family(c.layout), c)
        compared = [f"{fam}: {c.layout.name} {c.time_cost:+.0%}" for fam, c in others.items()
                    if c is not choice]
        if compared:
            why += "; the cheapest of each other kind: " + "; ".join(compared)
    else:
        choice = None
        why = ("no layout fits: reduce the batch, use lower precision or a lighter optimizer, or add devices "
               "(activation checkpointing and ZeRO-3 included)")
    return Advice(choice, why, candidates, devices, device_memory)
