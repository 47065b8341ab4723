"""Per-device memory and communication of a parallel layout, from a :class:`ModuleProfile`.

Everything here is arithmetic on counts (unit-tested on known cases); the published formulas it
follows are in DESIGN.md ("Numbers the field publishes"):

- parameters / gradients / optimizer state: bytes per element from the precision and the optimizer
  (Lightning's mixed precision keeps fp32 weights and gradients, so mixed-precision Adam costs
  4 + 4 + 8 = 16 bytes per parameter, the 16Ψ of the ZeRO paper); ZeRO-1 divides the optimizer state by
  the data-parallel size (4Ψ + 12Ψ/N in the paper's 16-bit accounting), ZeRO-2 the gradients as well,
  ZeRO-3 the parameters as well (FSDP2: each rank keeps 1/N of every sharded tensor);
- activations: the measured bytes per sample × the micro-batch × the micro-batches a stage holds at
  once (GPipe all ``m``, 1F1B ``min(p − stage, m)``); tensor parallel scales the blocks' share by
  Korthikanti et al.'s ``(10 + 24/t) / 34`` (``1/t`` with sequence parallel) — the ``5as/h`` score term
  is left out because fused attention kernels save no ``s × s`` matrix;
- communication (bytes each rank sends per optimizer step): ring all-reduce ``2(N−1)/N × bytes``;
  ZeRO-1 adds ``(N−1)/N`` of the parameters (broadcast of the updated shards); ZeRO-2 / 3 (FSDP2)
  reduce-scatter the gradients ``(N−1)/N × bytes`` and all-gather the parameters ``(N−1)/N × bytes`` once
  per step (ZeRO-2: kept gathered) or, for the blocks, twice (ZeRO-3: forward, and again in backward; the
  root unit stays gathered); a pipeline boundary
  carries ``b·s·h`` activations forward and as many gradients back per micro-batch; Megatron tensor
  parallel all-reduces ``b·s·h`` 4 times per layer per micro-batch (2 forward, 2 backward).
"""
from __future__ import annotations

from dataclasses import dataclass

from lightning_par.advisor.profile import ModuleProfile

# bytes per element of (parameters, gradients, each optimizer state) for Lightning's precision flags
PRECISION_BYTES = {
    "32-true": (4, 4, 4), "32": (4, 4, 4),
    "bf16-mixed": (4, 4, 4), "16-mixed": (4, 4, 4),
    "bf16-true": (2, 2, 2), "16-true": (2, 2, 2),
    "64-true": (8, 8, 8),
}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "rmsprop": 1, "adagrad": 1}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class Layout:
    """A parallel layout: sizes (pp × dp × tp devices), ZeRO stage and pipeline schedule."""

    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    zero_stage: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    sequence_parallel: bool = False

    @property
    def devices(self) -> int:
        return self.data_parallel_size * self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def name(self) -> str:
        parts = []
        if self.pipeline_parallel_size > 1:
            parts.append(f"PP{self.pipeline_parallel_size}({self.schedule}, m={self.microbatches})")
        if self.tensor_parallel_size > 1:
            parts.append(f"TP{self.tensor_parallel_size}" + ("+SP" if self.sequence_parallel else ""))
        if self.data_parallel_size > 1 or not parts:
            parts.append(f"DP{self.data_parallel_size}" if self.data_parallel_size > 1 else "single")
        if self.zero_stage:
            parts.append(f"ZeRO-{self.zero_stage}")
        return " × ".join(parts)


@dataclass(frozen=True)
class Estimate:
    """Bytes per device (the busiest rank) and bytes each rank sends per optimizer step."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    comm_bytes: int
    all_gathers: int = 0  # FSDP's all-gathers per step (one per unit gathered: ZeRO-2 / 3)

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def stage_blocks(n_blocks: int, stages: int, costs=None) -> list[range]:
    """The block ranges per stage the pipeline strategy itself chooses (:func:`partition_blocks`: balanced by
    ``costs``, its default ``balance="params"`` given the blocks' parameter counts; even without them).

    Example::

        >>> stage_blocks(5, 2)
        [range(0, 3), range(3, 5)]
        >>> stage_blocks(4, 2, costs=[1, 1, 1, 3])
        [range(0, 3), range(3, 4)]
    """
    from lightning_par.pipeline.partition import partition_blocks, stage_bounds

    if not 1 <= stages <= n_blocks:
        raise ValueError(f"stages={stages} must be between 1 and the number of blocks ({n_blocks}).")
    counts = partition_blocks(n_blocks, stages, balance="params" if costs else "uniform",
                              costs=[float(c) for c in costs] if costs else None)
    return [range(lo, hi) for lo, hi in stage_bounds(counts)]


def tp_activation_factor(t: int, sequence_parallel: bool) -> float:
    """Share of a block's activations one tensor-parallel rank holds (Korthikanti et al., no score term)."""
    if t == 1:
        return 1.0
    return (34 / t) / 34 if sequence_parallel else (10 + 24 / t) / 34


def estimate(profile: ModuleProfile, layout: Layout, batch_size: int, precision: str = "32-true",
             optimizer: str = "adamw") -> Estimate:
    """Per-device memory and per-rank communication of ``layout`` for a global batch of ``batch_size``."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} is not one of {sorted(PRECISION_BYTES)}.")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZER_STATES)}.")
    p, t, dp = layout.pipeline_parallel_size, layout.tensor_parallel_size, layout.data_parallel_size
    m = layout.microbatches if p > 1 else 1
    if batch_size % (dp * m):
        raise ValueError(f"batch_size={batch_size} must be divisible by data_parallel_size × microbatches "
                         f"({dp} × {m}).")
    p_bytes, g_bytes, s_bytes = PRECISION_BYTES[precision]
    states = OPTIMIZER_STATES[optimizer]
    micro = batch_size // (dp * m)
    total_block = sum(profile.block_params) or 1
    shard_share = profile.shardable_block_params / total_block
    elem = profile.dtype_bytes
    boundary = micro * profile.seq_len * profile.hidden_size * elem  # one activation message

    worst: Estimate | None = None
    for s, blocks in enumerate(stage_blocks(profile.n_blocks, p, costs=profile.block_params)):
        block_params = sum(profile.block_params[i] for i in blocks)
        params = block_params * (shard_share / t + (1 - shard_share))
        if s == 0:
            params += profile.first_params
        if s == p - 1:
            params += profile.last_params + (profile.tied_params if p > 1 else 0)
        held = m if layout.schedule == "gpipe" else min(p - s, m)
        acts = sum(profile.block_activation_bytes[i] for i in blocks) * tp_activation_factor(
            t, layout.sequence_parallel)
        acts += (profile.first_activation_bytes if s == 0 else 0) + (profile.last_activation_bytes if s == p - 1 else 0)
        ends = (profile.first_params if s == 0 else 0) + (profile.last_params if s == p - 1 else 0)  # root unit
        # FSDP2 all-gathers a unit's parameters into an unsharded buffer beside the shard: ZeRO-2 every unit,
        # kept for the step; ZeRO-3 one block at a time, beside the root unit (embeddings, head, final norm)
        gathered = 0.0
        if layout.zero_stage >= 2 and p > 1:  # a pipeline stage: gathered once per step, kept for all micro-
            # batches ([Note: FSDP under pipeline parallelism]); its whole gradients, which also accumulate during
            # the step, are not counted here (the recipes measure saved tensors and the state at rest)
            gathered = params
        elif layout.zero_stage == 2:
            gathered = params
        elif layout.zero_stage == 3:
            gathered = max((profile.block_params[i] for i in blocks), default=0) + ends
        zero = layout.zero_stage
        opt = params * states * s_bytes / (dp if zero >= 1 else 1)
        grads = params / (dp if zero >= 2 else 1)
        held_params = params / (dp if zero >= 2 else 1)  # FSDP2 keeps shards between steps at ZeRO-2 too

        if zero >= 2:  # FSDP2: reduce-scatter the gradients, all-gather the parameters (ZeRO-3: the blocks
            # again in backward; the root unit, embeddings / head / final norm, stays gathered for the step)
            again = params - ends if zero == 3 and p == 1 else 0  # a pipeline stage gathers once per step
            comm = (dp - 1) / dp * (params * (g_bytes + p_bytes) + again * p_bytes)
        else:
            comm = 2 * (dp - 1) / dp * params * g_bytes
        if zero == 1:
            comm += (dp - 1) / dp * params * p_bytes
        if p > 1:
            comm += m * boundary * ((s < p - 1) + (s > 0))
            if profile.tied_params and s in (0, p - 1):
                comm += profile.tied_params * g_bytes  # all-reduce of the tied weight over 2 ranks
        if t > 1:
            comm += len(blocks) * 4 * 2 * (t - 1) / t * m * boundary
        units = len(blocks) + 1  # FSDP units of the stage: its blocks, then the root (the ends)
        gathers = 0 if zero < 2 or dp == 1 else (units if zero == 2 or p > 1 else 2 * len(blocks) + 1)
        est = Estimate(int(held_params * p_bytes), int(grads * g_bytes), int(opt),
                       int(acts * micro * held + gathered * p_bytes), int(comm), gathers)
        if worst is None or est.total_bytes > worst.total_bytes:
            worst = est
    return worst  # type: ignore[return-value]


def korthikanti_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, t: int = 1,
                                sequence_parallel: bool = False) -> float:
    """Activation bytes of one transformer layer in 16-bit training (Korthikanti et al., 2022)."""
    sbh = seq_len * micro_batch * hidden
    score = 5 * heads * seq_len / (hidden * t)
    if sequence_parallel:
        return sbh * (34 / t + score)
    return sbh * (10 + 24 / t + score)
