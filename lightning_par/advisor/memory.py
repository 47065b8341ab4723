"""Per-device memory and communication of a parallel layout, from a :class:`ModuleProfile`.

Everything here is arithmetic on counts (unit-tested on known cases); the published formulas it
follows are in DESIGN.md ("Numbers the field publishes"):

- parameters / gradients / optimizer state: bytes per element from the precision and the optimizer
  (Lightning's mixed precision keeps fp32 weights and gradients, so mixed-precision Adam costs
  4 + 4 + 8 = 16 bytes per parameter, the 16Ψ of the ZeRO paper); ZeRO-1 divides the optimizer state by
  the data-parallel size (4Ψ + 12Ψ/N in the paper's 16-bit accounting), ZeRO-2 the gradients as well,
  ZeRO-3 the parameters as well (FSDP2: each rank keeps 1/N of every sharded tensor);
- activations: the measured bytes per sample × the micro-batch × the micro-batches a stage holds at
  once (GPipe all ``m``, 1F1B ``min(p − stage, m)``); under tensor parallel a block keeps once what the
  probe found whole (its norms and their outputs; with sequence parallel only the column-parallel layers'
  gathered inputs) and the rest ``/ t`` ([Note: what tensor parallelism leaves whole] in
  :mod:`lightning_par.advisor.profile`); a profile without those counts takes Korthikanti et al.'s
  ``(10 + 24/t) / 34`` (``1/t`` with sequence parallel; the ``5as/h`` score term left out: fused attention
  kernels save no ``s × s`` matrix); activation checkpointing keeps less
  and recomputes one block at a time in backward ([Note: activations under activation checkpointing]);
- communication (bytes each rank sends per optimizer step): ring all-reduce ``2(N−1)/N × bytes``;
  ZeRO-1 adds ``(N−1)/N`` of the parameters (broadcast of the updated shards); ZeRO-2 / 3 (FSDP2)
  reduce-scatter the gradients ``(N−1)/N × bytes`` and all-gather the parameters ``(N−1)/N × bytes`` once
  per step (ZeRO-2: kept gathered) or, for the blocks, twice (ZeRO-3: forward, and again in backward; the
  root unit stays gathered); a pipeline boundary
  carries ``b·s·h`` activations forward and as many gradients back per micro-batch; Megatron tensor
  parallel all-reduces ``b·s·h`` 4 times per layer per micro-batch (2 forward, 2 backward);
- context parallelism (``context_parallel_size``): the blocks' activations ``/ cp``, the ring attention's K/V
  bytes, a pipeline stage's exit gather and the gradients' average over the group ([Note: the advisor under context
  parallelism] in :mod:`lightning_par.advisor.context`);
- expert parallelism (``expert_parallel_size``): the routed experts ``/ ep`` and their all-to-all ([Note: the
  advisor under expert parallelism] in :mod:`lightning_par.advisor.experts`).
"""
from __future__ import annotations

from lightning_par.advisor.context import (check_context, context_comm, freed_before_ring, output_copy_bytes,
                                           ring_working_bytes)
from lightning_par.advisor.experts import dense_shard_share, expert_comm, held_experts
from lightning_par.advisor.layout import (CHECKPOINTING, OPTIMIZER_STATES, PRECISION_BYTES,  # noqa: F401 (re-exported)
                                          SCHEDULES, Estimate, Layout, check_checkpointing, checkpointed)
from lightning_par.advisor.profile import ModuleProfile

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


def tp_block_bytes(profile: ModuleProfile, index: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes per sample block ``index`` saves on one tensor-parallel rank: what the probe found whole once (with
    sequence parallelism the column-parallel layers' gathered inputs and what is not from the block's input) and
    the rest / t ([Note: what tensor parallelism leaves whole] in :mod:`lightning_par.advisor.profile`);
    Korthikanti et al.'s share for a profile without those counts."""
    full = profile.block_activation_bytes[index]
    counts = profile.block_whole_sp_bytes if sequence_parallel else profile.block_whole_bytes
    if t > 1 and counts:
        whole = min(counts[index], full)
        return whole + (full - whole) / t
    return full * tp_activation_factor(t, sequence_parallel)


# [Note: activations under activation checkpointing]
# What a block keeps from its forward to its backward, per sample (A: what the probe measured it saving without
# checkpointing, × the tensor-parallel share; I: its input, s·h elements, 1/t of it with sequence parallel):
# - off: A.
# - full: I (the checkpoint holds the block's input and recomputes the rest in backward); Korthikanti et al.'s
#   2sbh in 16-bit.
# - every k-th: blocks whose index in the stack (not in the pipeline stage) is a multiple of k keep I, the others A.
# - selective (op-level, [Note: what selective checkpointing keeps]): I + S, S the outputs of the matmuls and the
#   attention kernel, measured by the probe. For a GPT block of width h with a 4h MLP the matmuls' outputs are
#   q, k, v (3sh), the attention output (sh), the output projection (sh), the MLP's up projection (4sh) and its
#   down projection (sh): S = 10sh elements, 20sbh bytes in 16-bit, so a layer keeps sbh(2 + 20) = 22sbh against
#   Korthikanti's 34sbh + 5as²b (the score, softmax and dropout of the attention are recomputed or never stored:
#   fused kernels). Under tensor parallel t the column-parallel outputs (q, k, v, attention, up: 8sh) are 1/t,
#   the row-parallel ones (output and down projections, partial sums before their all-reduce: 2sh) whole, and
#   the policy keeps the all-reduced outputs too (2sh; reduce-scattered with sequence parallel: 2sh/t), so
#   S_t = S · (8/t + 2 + 2) / 10 (measured: TP2 keeps as much as this, within 5%); the input is whole unless
#   sequence parallel splits it.
# A checkpointed block recomputes its forward in backward, one block at a time: while block j does, the stage holds
# A_j, less what j kept, beyond what the blocks up to j kept (those after j have freed theirs: backward runs from
# the last block down), for one micro-batch (:func:`recompute_peak`). fp32 doubles every 16-bit byte count
# (the probe measures bytes in the dtype training runs in); what backward adds beside it: [Note: a checkpointed
# backward's gradients]. Time: full runs the blocks' forward again (the
# probe times it against forward + backward, ~1/3 of a step, Korthikanti et al. report 30-40%); selective only
# the ops it does not keep (the probe's share of the blocks' forward time outside the matmuls and attention).
def block_kept_bytes(profile: ModuleProfile, index: int, mode, t: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes per sample block ``index`` keeps for backward under checkpointing ``mode`` (see the Note above)."""
    full = tp_block_bytes(profile, index, t, sequence_parallel)
    if not checkpointed(mode, index):
        return full
    inp = (profile.block_input_bytes or profile.seq_len * profile.hidden_size * profile.dtype_bytes)
    inp /= t if sequence_parallel else 1
    if mode != "selective":
        return min(inp, full)
    sel = profile.selective_bytes[index] if profile.selective_bytes else 10 * inp
    share = 1.0 if t == 1 else (8 / t + 2 + (2 / t if sequence_parallel else 2)) / 10
    return min(inp + sel * share, full)


def recompute_peak(kept, whole, marked, beside: float = 0.0) -> float:
    """What a stage holds beyond every block's ``kept`` bytes while backward recomputes a checkpointed block
    (``marked``): backward runs from the last block down, so when block ``j`` recomputes its ``whole`` activations
    the blocks after it have already freed what they kept; ``beside``: what that block's backward holds beside its
    activations ([Note: a checkpointed backward's gradients]).

    Example::

        >>> recompute_peak([1, 1, 1, 1], [10] * 4, [True] * 4)   # full: block 3 recomputes beside 0, 1, 2
        9.0
        >>> recompute_peak([1, 10, 1, 10], [10] * 4, [True, False] * 2)  # every 2nd: block 2 beside 0, 1
        0
    """
    held = peak = sum(kept)
    run = 0
    for k, w, m in zip(kept, whole, marked):
        run += k
        if m:
            peak = max(peak, run + w - k + beside)
    return peak - held


# [Note: a checkpointed backward's gradients]
# What backward allocates beside the saved tensors decides the step's peak. Two moments, per micro-batch of the
# stage that holds them:
# - the loss's backward, with or without checkpointing: every block's kept bytes, the head's saved tensors (the
#   probe's ``last_activation_bytes``) and one more tensor the size of the largest of them (``head_largest_bytes``:
#   a language model's log-softmax of the logits, whose gradient the loss's backward makes beside it; the logits
#   themselves, which nothing saves, are gone by then);
# - a block's recompute: the blocks' kept bytes up to it, its whole activations (:func:`recompute_peak`) and the
#   gradients its backward is handed and makes: the block output's gradient (one block input, 1/t with sequence
#   parallel) and the MLP's hidden gradients, counted as two block inputs / t. The loss's and the head's tensors are
#   freed by then (their backward ran first), so the two moments are not summed: the larger is the peak.
# Traced op by op (step 1 of GPT 4 × 128 at 256 tokens, 16 sequences, fp32; every allocation of 64 KiB or more,
# any thread, counted by a malloc interposer): off, every 2nd and selective peak at ``_log_softmax_backward_data``,
# 4.4 MiB above the saved tensors where one V-wide tensor is 4 MiB; full at the last block's recompute, at its
# MLP's first matmul. The advisor's activations are 0.96-1.00 of what the step allocated from its start to its
# peak, one device and TP2's rank 0, every mode. The recompute's gradients term is a measured size, not derived:
# the profiler's allocation events show the 4h hidden's whole gradient (4 block inputs) alive at that moment, the
# resident peaks fit two. Checked against the resident peaks that the memory recipe measures (single, DP2, PP2,
# TP2, TP2 with sequence parallel, CP2 × off / full / every 2nd / selective; recipes/memory/README.md) and at a size
# not used to choose the terms (GPT 4 × 192 at 384 tokens, 4 sequences, vocabulary 128).
def backward_gradient_bytes(profile: ModuleProfile, t: int = 1, c: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes per sample of gradients alive beside a checkpointed block's recompute ([Note: a checkpointed
    backward's gradients]): its output's gradient and its MLP's hidden gradients, ``1 + 2/t`` block inputs
    (``3/t`` with sequence parallel), ``/ c`` under context parallelism."""
    inp = profile.block_input_bytes or profile.seq_len * profile.hidden_size * profile.dtype_bytes
    return (inp / (t if sequence_parallel else 1) + 2 * inp / t) / c


def recompute_share(profile: ModuleProfile, mode, blocks=None) -> float:
    """The extra share of a step's forward + backward time that checkpointing ``mode`` spends recomputing, from
    the probe's timing ([Note: activations under activation checkpointing]); a third of a step (the forward run
    again, the backward taken as twice the forward) for a profile that was not timed."""
    blocks = range(profile.n_blocks) if blocks is None else blocks
    if mode is None or not blocks:
        return 0.0
    share = sum(checkpointed(mode, i) for i in blocks) / len(blocks)
    forward = (profile.block_forward_s_per_sample / profile.step_s_per_sample if profile.step_s_per_sample
               else 1 / 3)
    if mode == "selective":
        forward *= profile.selective_recompute_share if profile.step_s_per_sample else 0.2
    return share * forward


# [Note: what a pipeline stage holds beyond the model]
# Counted on a stage's busiest moment with a tensor meter (the profiler's allocation events on every rank of a PP2
# fit, GPT 4 x 128 at 256 tokens, 4 micro-batches of 2), a stage held a mode-independent ~2.9 MiB more than its
# parameters, gradients, AdamW state and saved activations; what it is:
# - the previous step's gradients: the schedule runs inside training_step and Lightning zeroes the gradients
#   after it, so until a stage's first backward of the step writes new ones the old ones stay alive beside the
#   new micro-batches' activations: one more gradient copy of the stage's parameters (as sharded as the
#   gradients are);
# - its sends: each send is a packed frame (the headers and the tensor, :func:`~lightning_par.pipeline.p2p.
#   send_bundle`) or the input's gradient, kept with its work until the step's end (``Stage.finish`` waits for
#   them all): up to ``m`` boundary messages (``micro x s x h``) a direction, downstream from every stage but the
#   last, upstream from every stage but the first;
# - its posted receive: one boundary message a direction, posted ahead ([Note: speculative receive]).
# Stage 0 of that fit: 1805 KiB of gradients + 5 x 256 KiB = 3085 KiB against 2950 measured in every mode (off,
# full, every 2). The resident peak of the same fits was higher still under checkpointing: the checkpoint
# machinery's own fixed cost, which the memory recipe cancels with a baseline per mode ([Note: a baseline per
# checkpointing mode] in lightning_par/recipes/memory.py).
def estimate(profile: ModuleProfile, layout: Layout, batch_size: int, precision: str = "32-true",
             optimizer: str = "adamw") -> Estimate:
    """Per-device memory and per-rank communication of ``layout`` for a global batch of ``batch_size``: its busiest
    pipeline stage's (:func:`stage_estimates`)."""
    return max(stage_estimates(profile, layout, batch_size, precision, optimizer), key=lambda e: e.total_bytes)


def stage_estimates(profile: ModuleProfile, layout: Layout, batch_size: int, precision: str = "32-true",
                    optimizer: str = "adamw") -> list[Estimate]:
    """:func:`estimate` of each pipeline stage, in stage order (one without a pipeline)."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} is not one of {sorted(PRECISION_BYTES)}.")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZER_STATES)}.")
    p, t, dp = layout.pipeline_parallel_size, layout.tensor_parallel_size, layout.data_parallel_size
    c = layout.context_parallel_size
    check_context(profile, layout)
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

    ep = layout.expert_parallel_size  # [Note: the advisor under expert parallelism] in advisor/experts.py
    shard_share = dense_shard_share(profile, ep, shard_share)
    holders = dp * c // ep  # ranks holding the same experts

    stages: list[Estimate] = []
    for s, blocks in enumerate(stage_blocks(profile.n_blocks, p, costs=profile.block_params)):
        block_params = sum(profile.block_params[i] for i in blocks)
        experts = held_experts(profile, blocks, ep)
        block_params -= experts * ep
        params = block_params * (shard_share / t + (1 - shard_share))
        if s == 0:
            params += profile.first_params
        if s == p - 1:
            params += profile.last_params + (profile.tied_params if p > 1 else 0)
        held = m if layout.schedule == "gpipe" else min(p - s, m)
        ac = layout.activation_checkpointing
        ring_cp = layout.context_parallel_method == "ring"  # Ulysses: the module's own attention, no ring
        copy = [output_copy_bytes(profile, i, c, t) if ring_cp else 0 for i in blocks]  # the ring output's copy
        kept = [block_kept_bytes(profile, i, ac, t, layout.sequence_parallel) + (0 if checkpointed(ac, i) else x)
                for i, x in zip(blocks, copy)]
        whole = [tp_block_bytes(profile, i, t, layout.sequence_parallel) + x for i, x in zip(blocks, copy)]
        marked = [checkpointed(ac, i) for i in blocks]
        recomputes = any(marked)
        grads_beside = backward_gradient_bytes(profile, t, 1, layout.sequence_parallel) if recomputes else 0.0
        recompute = recompute_peak(kept, whole, marked, grads_beside) / c
        acts = sum(kept) / c  # [Note: the advisor under context parallelism]: the blocks hold 1/c of the rows
        tail = c if p == 1 else 1  # one stage: sharded to the loss ([Note: the advisor under context parallelism])
        last = profile.last_activation_bytes / tail if s == p - 1 else 0
        acts += (profile.first_activation_bytes if s == 0 else 0) + last
        # [Note: a checkpointed backward's gradients]: the loss's moment (with or without checkpointing) or a
        # recompute's, whichever is larger
        loss = (profile.head_largest_bytes / tail or last) if s == p - 1 else 0
        recompute = max(loss, recompute - last) if recomputes else loss
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
        opt += experts * states * s_bytes / (holders if zero >= 1 else 1)
        grads = params / (dp if zero >= 2 else 1) + experts
        held_params = params / (dp if zero >= 2 else 1) + experts  # FSDP2 keeps shards between steps at ZeRO-2 too

        if zero >= 2:  # FSDP2: reduce-scatter the gradients, all-gather the parameters (ZeRO-3: the blocks
            # again in backward; the root unit, embeddings / head / final norm, stays gathered for the step)
            again = params - ends if zero == 3 and p == 1 else 0  # a pipeline stage gathers once per step
            comm = (dp - 1) / dp * (params * (g_bytes + p_bytes) + again * p_bytes)
        else:  # the replicas' ring all-reduce; a 16-bit hook sends the gradients in 2 bytes (PowerSGD: counted whole)
            comm = 2 * (dp - 1) / dp * params * (2 if layout.comm_hook in ("fp16", "bf16") else g_bytes)
        if zero == 1:
            comm += (dp - 1) / dp * params * p_bytes
        comm += expert_comm(profile, layout, blocks, experts, boundary=boundary, m=m, g_bytes=g_bytes,
                            p_bytes=p_bytes)
        if p > 1:
            comm += m * boundary * ((s < p - 1) + (s > 0))
            if profile.tied_params and s in (0, p - 1):
                comm += profile.tied_params * g_bytes  # all-reduce of the tied weight over 2 ranks
        if t > 1:
            comm += len(blocks) * 4 * 2 * (t - 1) / t * m * boundary / c
        comm += context_comm(profile, blocks, c, t, micro, m, lambda i: ac != "selective" and checkpointed(ac, i),
                             boundary if p > 1 else 0.0, grads * g_bytes,  # one stage: no exit gather
                             layout.context_parallel_method)
        runtime = 0.0
        if p > 1:  # [Note: what a pipeline stage holds beyond the model]
            runtime = grads * g_bytes + boundary * (m + 1) * ((s < p - 1) + (s > 0))
        ring = max(0.0, ring_working_bytes(profile, blocks, c, t) - freed_before_ring(profile, blocks[-1], c, t)
                   - last) * micro if ring_cp else 0.0
        units = len(blocks) + 1  # FSDP units of the stage: its blocks, then the root (the ends)
        gathers = 0 if zero < 2 or dp == 1 else (units if zero == 2 or p > 1 else 2 * len(blocks) + 1)
        est = Estimate(int(held_params * p_bytes), int(grads * g_bytes), int(opt),
                       int(acts * micro * held + recompute * micro + gathered * p_bytes), int(comm), gathers,
                       int(runtime), int(ring), int(recompute * micro))
        stages.append(est)
    return stages


def korthikanti_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, t: int = 1,
                                sequence_parallel: bool = False, checkpointing=None) -> float:
    """Activation bytes one transformer layer keeps for backward in 16-bit training (Korthikanti et al., 2022):
    ``sbh(34 + 5as/h)``, ``sbh(10 + 24/t + 5as/(ht))`` with tensor parallel ``t``, ``sbh(34/t + 5as/(ht))`` with
    sequence parallel; checkpointed (``"full"`` or ``"selective"``, [Note: activations under activation
    checkpointing]): its input ``2sbh`` (``/t`` with sequence parallel), selective plus its matmul and attention
    outputs ``20sbh``, ``sbh(16/t + 8)`` with tensor parallel (``sbh(16/t + 4 + 4/t)`` with sequence parallel).
    Double it for fp32. The stack's peak adds one layer's recompute
    (:func:`korthikanti_stack_bytes`).

    Example::

        >>> korthikanti_bytes_per_layer(2048, 1, 4096, 32) / 2**30      # the issue's 0.96 GB, in GiB
        0.890625
        >>> korthikanti_bytes_per_layer(2048, 1, 4096, 32, checkpointing="full") / 2**20
        16.0
    """
    check_checkpointing(checkpointing)
    sbh = seq_len * micro_batch * hidden
    if checkpointing in ("full", "selective"):
        kept = 2 * sbh / (t if sequence_parallel else 1)
        if checkpointing == "full":
            return kept
        return kept + (20 * sbh if t == 1 else sbh * (16 / t + 4 + (4 / t if sequence_parallel else 4)))
    score = 5 * heads * seq_len / (hidden * t)
    if sequence_parallel:
        return sbh * (34 / t + score)
    return sbh * (10 + 24 / t + score)


def korthikanti_stack_bytes(n_layers: int, seq_len: int, micro_batch: int, hidden: int, heads: int, t: int = 1,
                            sequence_parallel: bool = False, checkpointing=None) -> float:
    """Peak activation bytes of ``n_layers`` layers in 16-bit under ``checkpointing`` (None, "full", "selective"
    or every k-th layer): what each layer keeps, plus one checkpointed layer's recompute in backward (its
    activations less what it kept, beside the layers before it: :func:`recompute_peak`).

    Example::

        >>> sbh = 2048 * 4096
        >>> korthikanti_stack_bytes(4, 2048, 1, 4096, 32, checkpointing="full") / sbh   # 3 inputs, 1 layer whole
        120.0
        >>> korthikanti_stack_bytes(4, 2048, 1, 4096, 32, checkpointing=2) / sbh   # 2 whole, 2 inputs
        232.0
    """
    check_checkpointing(checkpointing)
    off = korthikanti_bytes_per_layer(seq_len, micro_batch, hidden, heads, t, sequence_parallel)
    kept = off if checkpointing is None else korthikanti_bytes_per_layer(
        seq_len, micro_batch, hidden, heads, t, sequence_parallel,
        "selective" if checkpointing == "selective" else "full")
    marked = [checkpointed(checkpointing, i) for i in range(n_layers)]
    per_layer = [kept if m else off for m in marked]
    return sum(per_layer) + recompute_peak(per_layer, [off] * n_layers, marked)
