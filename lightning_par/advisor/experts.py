"""The advisor under expert parallelism: what ``expert_parallel_size`` changes in a layout's estimate
(:func:`lightning_par.advisor.memory.stage_estimates` calls these).

[Note: the advisor under expert parallelism]
With ``expert_parallel_size = ep`` (its ranks borrowed from dp × cp, :mod:`lightning_par.experts`) a stage's
routed-expert parameters E_s (the profile's ``block_expert_params``) are held ``/ ep`` and whole (never tp-split);
the rest of its block parameters keep the tensor-parallel share of the dense linears. Gradients follow the
parameters; ZeRO-1 divides the dense optimizer state by dp and the experts' by their holders ``h = dp·cp/ep``
(ZeRO-2 / 3 with ep are refused by the strategy). Communication per rank and step: the dense gradients' ring
all-reduce over dp and the experts' over h (ZeRO-1: the updated shards' broadcast the same way), and per MoE
block and micro-batch the all-to-all of ``tokens × hidden × top-k × (ep−1)/ep`` elements, out and back, in forward
and in backward (4 times; tokens: the micro-batch's rows on the rank, ``/ cp``). The routing weights and counts
(1/hidden of that, E integers) and the token imbalance of a real router are left out: the benchmark measures
them (benchmarks/expert_parallel.py). Activations are the probe's (the received rows are transient).
"""
from __future__ import annotations

from lightning_par.advisor.profile import ModuleProfile


def check_layout(layout) -> None:
    """What the strategy allows of ``layout.expert_parallel_size`` (at the layout's construction)."""
    ep = layout.expert_parallel_size
    if ep < 1 or (layout.data_parallel_size * layout.context_parallel_size) % ep:
        raise ValueError(f"expert_parallel_size={ep} must be a positive integer dividing data_parallel_size × "
                         f"context_parallel_size ({layout.data_parallel_size} × {layout.context_parallel_size}).")
    if ep > 1 and layout.zero_stage >= 2:
        raise ValueError(f"expert_parallel_size={ep} with zero_stage={layout.zero_stage} is refused by the "
                         f"strategy: use zero_stage 0 or 1.")


def dense_shard_share(profile: ModuleProfile, ep: int, shard_share: float) -> float:
    """The tensor-parallel share of the blocks' parameters that tp splits: under ep > 1 the dense linears' share
    of the dense parameters (the experts stay whole); ``shard_share`` otherwise. Refuses a module ep cannot
    divide."""
    if ep == 1:
        return shard_share
    if not profile.moe_blocks:
        raise ValueError(f"expert_parallel_size={ep}: the module has no routed experts.")
    if profile.num_experts % ep:
        raise ValueError(f"expert_parallel_size={ep} does not divide the {profile.num_experts} experts of a layer.")
    dense_total = (sum(profile.block_params) - sum(profile.block_expert_params)) or 1
    return (profile.shardable_block_params - profile.expert_linear_params) / dense_total


def held_experts(profile: ModuleProfile, blocks, ep: int) -> float:
    """Routed-expert parameters of ``blocks`` one rank holds (0 at ep = 1: they count with the blocks)."""
    return sum(profile.block_expert_params[i] for i in blocks) / ep if ep > 1 else 0.0


def expert_comm(profile: ModuleProfile, layout, blocks, experts: float, *, boundary: float, m: int,
                g_bytes: int, p_bytes: int) -> float:
    """Bytes a rank sends per step for its ``experts`` (held parameters): their gradient ring over the holders
    (ZeRO-1: and the updated shards), and the all-to-all of each MoE block of ``blocks`` per micro-batch
    (``boundary``: one micro-batch's hidden states on the rank before cp divides them)."""
    ep, c = layout.expert_parallel_size, layout.context_parallel_size
    if ep == 1:
        return 0.0
    holders = layout.data_parallel_size * c // ep
    grad = 2 if layout.comm_hook in ("fp16", "bf16") else g_bytes
    ring = (2 * grad + (layout.zero_stage == 1) * p_bytes) * (holders - 1) / holders * experts
    moe = sum(1 for i in blocks if profile.block_expert_params[i])
    return ring + 4 * moe * m * boundary / c * max(profile.expert_top_k, 1) * (ep - 1) / ep
