"""What context parallelism changes in the advisor's estimate: a rank's block activations and the bytes it sends.

[Note: the advisor under context parallelism]
With ``context_parallel_size = c`` (:mod:`lightning_par.context`), every rank of a cp group gets the same batch and
runs the block stack on its ``1/c`` of every sequence. With one stage the advisor takes the loss as sharded ([Note:
sharded to the loss] in context/loss.py: a per-token cross-entropy, which the strategy's setup check confirms on
the user's step): the final norm, the logits and the loss hold ``1/c`` of their rows too; a pipeline's last stage
gathers, and holds them whole, as does a step whose loss the check finds the pieces do not serve (the estimate is
then low by ``(1 - 1/c)`` of those bytes). The embeddings' output stays whole on every rank.

- Memory: whatever a block keeps for backward scales with the rows it holds, so the blocks' activations (and what
  checkpointing keeps and recomputes of them) are ``1/c`` of one device's; the ring attention keeps only this
  rank's K and V, as SDPA keeps its own, which is why ([Note: all-gather or ring] in context/attention.py). One
  thing more per block: SDPA's output (fused CPU / CUDA kernels) is laid out ``[batch, seq, heads, dim]``, so a
  module that transposes it back to ``[batch, seq, width]`` (the reference GPT, Hugging Face's attentions) gets a
  view, and the output projection saves the very storage SDPA saved; the ring's output is ``[batch, heads, seq,
  dim]``, and the same transpose copies it: one more tensor of the attention's output size (``1/c`` of the
  probe's, ``/ t``) per block kept for backward. Measured (ParallelMetrics, GPT 4 × 128 at 64 tokens, batch 8,
  fp32): CP2 kept 4 × 128 KiB more than the blocks' halves, exactly this. A module that makes its own copy anyway
  would hold that much less than predicted. The first and last activations stay whole. Parameters, gradients and
  optimizer state are those of the layout without cp: the cp ranks of a replica hold the same weights, and ZeRO
  shards over dp only ([Note: ZeRO under context parallelism]).
- The ring's working set (:func:`ring_working_bytes`, ``Estimate.context_bytes``): while a block's ring runs in
  backward, beyond what the blocks saved, a rank holds its packed K/V and the piece in flight (``2·kv``), the K/V
  gradient accumulator and the one in flight, and the query gradient (float32: ``(2·kv + q)·4/e``). The first block
  to run it (the stack's last) does so after the head and the loss have freed what they saved, so the step's peak
  is the larger of the two: the working set counts beyond the last activations only. Measured (the capacity
  recipe's resident peak, GPT 2 × 64 at 1536 and 2048 tokens, 4 sequences, CP2): measured / advisor was 1.10 and
  1.11 without it, 1.03 and 1.04 with it (one device's off rows: 1.01, 1.02); the recipe's ``context`` sweep
  (width 128, 64 MiB) has cp 2 at 0.94, cp 2 full at 1.03 and cp 4 at 1.07 (recipes/capacity/README.md). The
  saved-tensor meter (the memory recipe) does not see it: it is not in ``activation_bytes``.
- The fused kernels ([Note: the fused kernels] in context/attention.py) hold no score blocks of their own, so the
  ring's working set is what the step's peak sees of it, and it runs inside a block's backward after that block has
  freed what it saved after its attention (its MLP, the output projection's input): :func:`freed_before_ring`, the
  block's saved bytes less its attention's (K, V, the query and the output) and what it saved before (its input
  and the norm's output). Measured (the capacity recipe's quick ``sequence`` sweep, GPT 2 × 128, 4 sequences,
  CP2): measured / advisor was 0.88 at 768 tokens and 0.87 at 1024 with the working set counted whole; 0.95 at
  1024 and 0.96 at 1536 net of what the block freed. (The math kernel the fused one replaced held float32 score
  blocks on top, which had hidden the difference.)
- Communication per rank, per micro-batch, for each block ``i`` of the stage, ``kv`` = this rank's K and V bytes of
  block ``i`` (the probe's, ``/ c`` for its rows, ``/ t`` for its heads under tensor parallel): the ring sends
  ``(c-1)·kv`` in forward and, in backward, ``(c-1)·kv`` (the K/V again) plus ``c`` hops of the K/V gradient
  accumulators, which the ring keeps in float32 (``c·kv·4/e``, ``e`` K's element size); a block that full (or every
  k-th) checkpointing recomputes runs its forward ring again (``(c-1)·kv``; selective keeps the op's outputs, no
  repeat). Leaving a pipeline stage's range of the stack, the hidden state is all-gathered: ``(c-1)·b·(s/c)·h``
  bytes, once per micro-batch (a recompute skips it; its backward sends nothing); with one stage the loss runs on
  the pieces and nothing is gathered. The gradients
  are averaged over the cp group (a ring all-reduce, ``2(c-1)/c`` of them, of the dp shards at ZeRO-2 / 3), beside
  the data-parallel reduction. Tensor parallel's all-reduces carry the local rows only (``/ c``).
- The method: the ring where every block calls SDPA; else Ulysses where every block's attention goes through Hugging
  Face's attention interface (eager, soft-capped, sinks: ``ModuleProfile.context_methods``, as the strategy's setup
  check decides) and ``c`` divides a tensor-parallel rank's query heads; no cp otherwise. Under Ulysses the module's
  own attention runs on the whole sequence for ``H/c`` heads: what it saves (its q, k, v, the scores of an eager
  attention) is ``1/c`` of one device's as the blocks' other activations are, with no ring working set and no output
  copy; it sends, per block and micro-batch, ``(c-1)/c`` of this rank's q, k, v and output in forward and as much
  in backward (:func:`ulysses_bytes`; a recompute the forward's again). K/V heads fewer than ``c`` are repeated
  first ([Note: Ulysses]): the estimate counts them unrepeated, low by that repeat. The all-gather method is not
  estimated.
"""
from __future__ import annotations

from lightning_par.advisor.profile import ModuleProfile


def check_context(profile: ModuleProfile, layout) -> None:
    """``ValueError`` where ``layout``'s context parallelism cannot run this module (the strategy's refusals)."""
    c = layout.context_parallel_size
    if c == 1:
        return
    if layout.sequence_parallel or (layout.pipeline_parallel_size > 1 and layout.zero_stage >= 2):
        raise ValueError(f"context_parallel_size={c} does not compose with sequence_parallel, nor with a pipeline at "
                         f"zero_stage 2 / 3 (the strategy refuses both); got {layout}.")
    method = layout.context_parallel_method
    if method == "allgather":
        raise ValueError("The advisor estimates context parallelism with the ring and Ulysses; "
                         "context_parallel_method='allgather' is not modeled.")
    if method not in profile.context_methods:
        raise ValueError(
            f"context_parallel_method={method!r} cannot serve the profiled module's attention: "
            + ("the ring routes the blocks' scaled_dot_product_attention calls, and they made none (eager attention); "
               "Ulysses serves it through Hugging Face's attention interface." if "ulysses" in profile.context_methods
               else "no method serves blocks whose attention calls neither scaled_dot_product_attention nor Hugging "
                    "Face's attention interface (an attention of the module's own)."))
    heads = (profile.num_heads or 0) // layout.tensor_parallel_size
    if method == "ulysses" and heads % c:
        raise ValueError(f"context_parallel_method='ulysses' splits a rank's {heads} query heads over "
                         f"context_parallel_size={c}, which does not divide them.")
    if profile.seq_len % (2 * c):
        raise ValueError(f"context_parallel_size={c} splits every sequence into 2·cp = {2 * c} chunks, and "
                         f"{2 * c} does not divide the profiled sequence length {profile.seq_len}.")


def output_copy_bytes(profile: ModuleProfile, index: int, c: int, t: int = 1) -> float:
    """Bytes per sample (whole sequence: the caller divides by ``c`` with the blocks' other activations) that block
    ``index`` keeps beyond one device's under cp: its attention output's copy ([Note: the advisor under context
    parallelism])."""
    if c == 1 or not profile.block_attention_bytes:
        return 0.0
    return profile.block_attention_bytes[index] / t


def ring_working_bytes(profile: ModuleProfile, blocks, c: int, t: int = 1) -> float:
    """Bytes per sample a rank holds beyond the saved activations while the busiest of ``blocks`` runs its ring
    backward ([Note: the advisor under context parallelism]).

    Example::

        >>> from lightning_par.advisor.profile import ModuleProfile
        >>> prof = ModuleProfile(0, (0,), 0, 0, 0, 0, (0,), 0, 0, 8, 8, 1, 4, block_kv_bytes=(512,), kv_dtype_bytes=4,
        ...                      block_attention_bytes=(256,))
        >>> ring_working_bytes(prof, [0], 2)       # kv = 256, q = 128: 2·256 + (2·256 + 128)
        1152.0
    """
    if c == 1 or not profile.block_kv_bytes:
        return 0.0
    wide = 4 / (profile.kv_dtype_bytes or 4)

    def work(i):
        kv = profile.block_kv_bytes[i] / (c * t)
        q = (profile.block_attention_bytes[i] if profile.block_attention_bytes else 0) / (c * t)
        return 2 * kv + (2 * kv + q) * wide

    return max((work(i) for i in blocks), default=0.0)


def freed_before_ring(profile: ModuleProfile, index: int, c: int, t: int = 1) -> float:
    """Bytes per sample block ``index`` has freed by the time its attention's ring backward runs: what it saved after
    its attention ([Note: the advisor under context parallelism]); 0 where the probe saw no attention."""
    if c == 1 or not profile.block_kv_bytes or not profile.block_attention_bytes:
        return 0.0
    inputs = profile.block_input_bytes or profile.seq_len * profile.hidden_size * profile.dtype_bytes
    kept = profile.block_kv_bytes[index] + 2 * profile.block_attention_bytes[index] + 2 * inputs
    return max(0.0, profile.block_activation_bytes[index] - kept) / (c * t)


def ring_bytes(kv: float, c: int, kv_dtype_bytes: int, recomputed: bool = False) -> float:
    """Bytes a rank sends for one block's ring attention, one micro-batch, forward and backward ([Note: the advisor
    under context parallelism]); ``kv``: this rank's K and V bytes.

    Example::

        >>> ring_bytes(100, 2, 4)                      # forward 1·kv, backward 1·kv + 2·kv
        400.0
        >>> ring_bytes(100, 4, 2, recomputed=True)     # bf16 K/V, fp32 gradients; the forward again
        1700.0
    """
    if c == 1:
        return 0.0
    grads = kv * 4 / (kv_dtype_bytes or 4)
    return (c - 1) * kv * (3 if recomputed else 2) + c * grads


def ulysses_bytes(io: float, c: int, recomputed: bool = False) -> float:
    """Bytes a rank sends for one block's Ulysses attention, one micro-batch, forward and backward ([Note: the
    advisor under context parallelism]); ``io``: this rank's q, k, v and output bytes (its positions, all heads).

    Example::

        >>> ulysses_bytes(400, 2)                   # 4 all-to-alls keeping 1/2 of each, forward and backward
        400.0
        >>> ulysses_bytes(400, 4, recomputed=True)  # the forward's again
        900.0
    """
    return (c - 1) / c * io * (3 if recomputed else 2) if c > 1 else 0.0


def context_comm(profile: ModuleProfile, blocks, c: int, t: int, micro: int, microbatches: int, recomputed,
                 boundary: float, grad_bytes: float, method: str = "ring") -> float:
    """What cp adds to a stage's bytes per step: the ring of each of its ``blocks`` (``recomputed(i)``: block ``i``
    runs its forward again under checkpointing), the gather leaving the stage's range (``boundary``: one micro-batch's
    whole hidden state in bytes; 0 with one stage, sharded to the loss) and the gradients' average over the group
    (``grad_bytes``: this rank's)."""
    if c == 1:
        return 0.0
    if method == "ulysses":
        ring = sum(ulysses_bytes(profile.block_attention_io_bytes[i] * micro / (c * t), c, recomputed(i))
                   for i in blocks)
    else:
        ring = sum(ring_bytes(profile.block_kv_bytes[i] * micro / (c * t), c, profile.kv_dtype_bytes, recomputed(i))
                   for i in blocks)
    gather = (c - 1) * boundary / c
    return microbatches * (ring + gather) + 2 * (c - 1) / c * grad_bytes


__all__ = ["check_context", "context_comm", "freed_before_ring", "output_copy_bytes", "ring_bytes",
           "ring_working_bytes", "ulysses_bytes"]
