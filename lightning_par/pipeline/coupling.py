"""Whether the user's loss couples the samples of a batch, which micro-batching changes (checked at setup).

[Note: losses that couple samples]
A pipeline step runs the user's step on each micro-batch and its loss is the size-weighted mean of the
micro-batches' losses, as with ``accumulate_grad_batches``. That is the loss of the batch only when the loss is
a mean over samples. A contrastive loss (CLIP's over the batch's similarity matrix), batch statistics (batch
norm in training), in-batch negatives: each couples the samples, and micro-batching changes it (CLIP's loss at
its first step, batch of 8 in 4 micro-batches: 2.1 off one device's). So at setup, while the module is whole,
global rank 0 computes, without gradients, the loss of the traced micro-batch and the size-weighted mean of the
losses of its two halves (skipped when the micro-batch holds one sample, or when the batch is not split at all),
and every rank receives the two numbers, so every rank warns or refuses alike and no collective waits for a rank
that went on. Randomness must not set it off:

- dropout is switched off for these forward passes (``F.dropout`` and its variants return their input, the
  attention functions get ``dropout_p=0``): the masks of a batch and of its halves cannot be drawn alike (a mask
  is drawn element by element, so both halves would start from the batch's first rows' draws);
- each forward starts from the same RNG state, and the RNG is restored after;
- a loss that draws other random numbers (noise, diffusion timesteps) cannot be told from a coupled one this way:
  the loss of the micro-batch is computed once more from another RNG state, and if the two differ the check is
  skipped (and says so).

Float noise: the batch and its halves run the same per-sample arithmetic, except kernels that block by the batch
size and the order of the final mean, each rounding a value by at most u (the unit roundoff of the compute
dtype) relatively. The check allows a relative difference of √u (2.4e-4 for fp32, 0.0625 for bf16): it
measured at most 1.4e-7 on the reference GPT (dropout 0.2) and Hugging Face Llama (attention dropout 0.1) in
fp32, while coupling is of the order of the loss itself (CLIP at init: 0.37 relative on a micro-batch of 4).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_par.pipeline.microbatch import batch_size, split_batch, weighted_mean

_IDENTITY = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}
_MHA = inspect.signature(F.multi_head_attention_forward)


class no_dropout(TorchFunctionMode):
    """While active, dropout is the identity (see [Note: losses that couple samples])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _IDENTITY:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:  # (query, key, value, attn_mask, dropout_p, ...)
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        elif func is F.multi_head_attention_forward:
            bound = _MHA.bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            args, kwargs = bound.args, bound.kwargs
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Coupling:
    """The loss of one micro-batch of ``samples`` (``whole``), the size-weighted mean of its halves' losses
    (``halves``), and the relative tolerance of the compute dtype ``dtype`` (√u, see the Note)."""

    whole: float
    halves: float
    samples: int
    dtype: torch.dtype

    @property
    def tolerance(self) -> float:
        return math.sqrt(torch.finfo(self.dtype).eps / 2)  # √u, u the unit roundoff: see the Note

    @property
    def coupled(self) -> bool:
        scale = max(abs(self.whole), abs(self.halves))
        return not abs(self.whole - self.halves) <= self.tolerance * scale + torch.finfo(self.dtype).tiny

    def message(self, strict: bool) -> str:
        return (
            f"micro-batching changes this loss: on a micro-batch of {self.samples} samples the step's loss is "
            f"{self.whole:.6g}, but the size-weighted mean of its two halves' losses is {self.halves:.6g} (beyond "
            f"{self.dtype}'s rounding tolerance of {self.tolerance:.2g} relative).\n"
            f"The loss couples the samples of a batch (a contrastive loss, batch statistics, in-batch negatives): "
            f"the pipeline computes it per micro-batch and averages, as `accumulate_grad_batches` does, so it is "
            f"not the loss of the whole batch. Choose `microbatches=1` (the whole batch in one micro-batch, no "
            f"overlap of the stages), or a larger batch (each micro-batch holds more samples)"
            + ("; `strict_batch_semantics=True` refuses it." if strict else
               ", or pass `strict_batch_semantics=True` to refuse such a loss at setup. See [Note: losses that "
               "couple samples] in lightning_par/pipeline/coupling.py.")
        )


def measure_coupling(run: Callable[[Any], Any], microbatch: Any, *, loss_of: Callable[[Any], torch.Tensor],
                     dtype: torch.dtype, reseed: Callable[[int], Any]) -> tuple[Optional[Coupling], Optional[str]]:
    """The :class:`Coupling` of ``run`` (the user's step on a micro-batch) on ``microbatch``, without gradients or
    dropout, each forward from ``reseed(0)``, or why it cannot tell: ``(None, reason)``, or ``(None, None)`` for a
    micro-batch of one sample (the caller restores the RNG and the module's state)."""
    n = batch_size(microbatch)
    if n < 2:
        return None, None

    def loss(mb, seed=0) -> float:
        reseed(seed)
        return float(loss_of(run(mb)).detach().double())

    with torch.no_grad(), no_dropout():
        whole = loss(microbatch)
        if not math.isfinite(whole):
            return None, f"the loss of the micro-batch is {whole}"
        if loss(microbatch, seed=1) != whole:
            return None, "the loss changes with the RNG state beyond dropout (noise, sampled timesteps)"
        halves = split_batch(microbatch, 2)
        mean = weighted_mean([loss(h) for h in halves], [batch_size(h) for h in halves])
    return Coupling(whole=whole, halves=float(mean), samples=n, dtype=dtype), None
