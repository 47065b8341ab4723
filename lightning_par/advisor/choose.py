"""The seeds' rule for choosing a layout, applied to estimated memory.

"选择数据并行还是模型并行，核心判断依据是'单卡是否能够容纳完整模型'": the model fits on one device →
data parallel over every device (sharding the optimizer state with ZeRO-1 when only that makes it fit);
it does not → pipeline across layers first (clear boundaries, little communication), tensor parallel
when one layer alone does not fit, and data parallel over the devices left.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lightning_par.advisor.memory import Estimate, Layout, estimate
from lightning_par.advisor.profile import ModuleProfile

GiB = 1024**3


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    estimate: Estimate
    fits: bool
    reason: str


@dataclass(frozen=True)
class Advice:
    """The recommended layout, why, and every candidate considered (one line of reasoning each)."""

    choice: Candidate | None
    why: str
    candidates: list[Candidate] = field(default_factory=list)
    devices: int = 1
    device_memory: int = 0

    def table(self) -> str:
        head = (f"{'layout':34s} {'params':>9s} {'grads':>9s} {'optim':>9s} {'activ':>9s} {'total':>9s} "
                f"{'comm/step':>10s}  fits  why")
        rows = [head, "-" * len(head)]
        for c in self.candidates:
            e = c.estimate
            mark = "*" if self.choice is not None and c.layout == self.choice.layout else " "
            rows.append(
                f"{mark}{c.layout.name:33s} {_fmt(e.param_bytes)} {_fmt(e.grad_bytes)} {_fmt(e.optimizer_bytes)} "
                f"{_fmt(e.activation_bytes)} {_fmt(e.total_bytes)} {_fmt(e.comm_bytes, 10)}  "
                f"{'yes ' if c.fits else 'no  '}  {c.reason}"
            )
        rows.append(f"recommended: {self.choice.layout.name if self.choice else 'none fits'} — {self.why}")
        return "\n".join(rows)


def _fmt(nbytes: float, width: int = 9) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:{width - 4}.1f} {unit}"
    return f"{int(nbytes):{width - 2}d} B"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(profile: ModuleProfile, devices: int, batch_size: int, schedule: str = "1f1b",
                      microbatches: int | None = None) -> list[Layout]:
    """Every (pp, tp, dp) that multiplies to ``devices`` and that the model and batch allow."""
    layouts = []
    for pp in _divisors(devices):
        if pp > profile.n_blocks:
            continue
        for tp in _divisors(devices // pp):
            if tp > 1 and (profile.hidden_size % tp or (profile.num_heads and profile.num_heads % tp)):
                continue
            dp = devices // (pp * tp)
            m = 1
            if pp > 1:
                per_replica = batch_size // dp
                m = microbatches or min(2 * pp, per_replica)
                if m < 1 or per_replica % m:
                    continue
            if batch_size % (dp * m):
                continue
            for zero in ((0, 1) if dp > 1 else (0,)):
                layouts.append(Layout(dp, pp, tp, zero, schedule, m))
    return layouts


def advise(profile: ModuleProfile, devices: int, device_memory: int, batch_size: int,
           precision: str = "32-true", optimizer: str = "adamw", schedule: str = "1f1b",
           microbatches: int | None = None) -> Advice:
    """Estimate every candidate layout and pick one by the seeds' rule (see the module docstring)."""
    if devices < 1 or device_memory <= 0:
        raise ValueError(f"devices={devices} and device_memory={device_memory} must be positive.")
    layouts = candidate_layouts(profile, devices, batch_size, schedule, microbatches)
    if not layouts:
        raise ValueError(f"No layout of {devices} devices divides batch_size={batch_size}: choose a batch "
                         f"divisible by the device count.")
    ests = {lay: estimate(profile, lay, batch_size, precision, optimizer) for lay in layouts}

    def fits(lay: Layout) -> bool:
        return ests[lay].total_bytes <= device_memory

    def smallest(pred) -> Layout | None:
        chosen = [lay for lay in layouts if pred(lay) and fits(lay)]
        return min(chosen, key=lambda lay: (lay.pipeline_parallel_size * lay.tensor_parallel_size,
                                            lay.zero_stage, ests[lay].comm_bytes)) if chosen else None

    dp_only = lambda lay: lay.pipeline_parallel_size == 1 and lay.tensor_parallel_size == 1  # noqa: E731
    pipeline = lambda lay: lay.tensor_parallel_size == 1 and lay.pipeline_parallel_size > 1  # noqa: E731
    model_parallel = lambda lay: lay.tensor_parallel_size > 1  # noqa: E731

    pick, why = None, ""
    if (pick := smallest(lambda lay: dp_only(lay) and lay.zero_stage == 0)) is not None:
        why = "the model fits on one device: data parallel over every device (simplest, easiest recovery)"
    elif (pick := smallest(dp_only)) is not None:
        why = "the model fits once the optimizer state is sharded: data parallel with ZeRO-1"
    elif (pick := smallest(pipeline)) is not None:
        why = (f"the model does not fit on one device: pipeline across layers over {pick.pipeline_parallel_size} "
               f"devices, data parallel over the {pick.data_parallel_size} replicas left")
    elif (pick := smallest(model_parallel)) is not None:
        why = (f"even one pipeline stage does not fit: tensor parallel inside layers over "
               f"{pick.tensor_parallel_size} devices, then pipeline and data parallel over the rest")
    else:
        why = "no layout fits: reduce the batch, use lower precision or a lighter optimizer, or add devices"

    candidates = []
    for lay in layouts:
        e = ests[lay]
        verdict = (f"needs {_fmt(e.total_bytes).strip()} of {_fmt(device_memory).strip()}" if not fits(lay)
                   else f"fits, {e.total_bytes / device_memory:.1%} of memory")
        if dp_only(lay):
            kind = "data parallel" + (" + sharded optimizer state" if lay.zero_stage else "")
        elif pipeline(lay):
            kind = "pipeline across layers"
        else:
            kind = "tensor parallel inside layers"
        candidates.append(Candidate(lay, e, fits(lay), f"{kind}: {verdict}"))
    choice = next((c for c in candidates if c.layout == pick), None)
    return Advice(choice, why, candidates, devices, device_memory)
