"""Context parallelism sharded to the loss: the final norm, the head and a per-token cross-entropy run on each rank's
piece of the sequence, the labels cut in the same load-balanced layout.

    with context.sharded_loss():
        loss = training_step(batch)        # F.cross_entropy(logits_piece, labels_whole) -> the group's mean
    loss.backward()                        # each rank: the gradient of its positions, times cp

[Note: sharded to the loss]
Without it the stack's last block gathers its output back to the whole sequence ([Note: where the sequence is cut]),
so what follows the stack (final norm, head, logits, loss) runs at full length on every rank: for a real vocabulary
the logits are the largest activation of the step. Under :meth:`ContextParallel.sharded_loss` (the training step)
the last block keeps its output as this rank's piece instead, and :class:`ShardedCrossEntropy` (a
``TorchFunctionMode`` entered there, left when the step ends) recognises the loss in the unchanged step, as
``loss_parallel`` recognises a cross-entropy on vocabulary shards: a call of ``F.cross_entropy(input, target)``
whose ``input`` holds ``1/cp`` of the tokens of the sequence the stack received (``[B·S/cp, V]`` flattened, or
``[B, V, S/cp]``) and whose integer ``target`` holds all of them (``[B·S]`` or ``[B, S]``). The target is cut in the
same layout (:func:`~lightning_par.context.sharding.shard` along the sequence), so a label shifted on the whole
sequence before the cut (Hugging Face's ``ForCausalLMLoss`` pads the labels and shifts them by one) stays right:
the label of a chunk's last token, which lives in the next chunk, was moved before the cut. The mean over the
group's tokens is the sum of the pieces' sums over the group's count of counted tokens (``ignore_index`` left out,
``weight[target]`` summed where a class weight is given: torch's own denominator, with label smoothing too);
``reduction="sum"`` is the group's sum. The returned value is that of the whole sequence, the same on every rank;
its gradient is this rank's part times ``cp``, as the gather's backward gives it ([Note: gradients under context
parallelism]): the mean over the group of every parameter's gradient is one device's.

What a step does with the logits besides this loss (a shifted slice of the logits, an accuracy against the whole
labels, a pooled first token) would see one piece of the sequence. So the piece is used only where one run of the
user's step on a recorded micro-batch at setup (:func:`check_sharded_loss`) returned the same loss and logged the
same values sharded as gathered, and recognised at least one cross-entropy; otherwise the stack gathers as before,
and the plan log says why. A step whose shapes change later (a longer batch) is still served: the layout follows
the sequence each forward receives; a cross-entropy whose shapes do not match is left to torch, which raises.
Validation, test and predict steps gather (their outputs and metrics are the user's to read whole).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_par.context.sharding import shard


class ShardedCrossEntropy(TorchFunctionMode):
    """Serves ``F.cross_entropy`` on this rank's piece of the sequence ([Note: sharded to the loss]). ``lead``: the
    whole sequence's leading shape (``[B, S]`` batch first), ``seq_dim``: its sequence dimension."""

    def __init__(self, group, lead: tuple[int, ...], seq_dim: int):
        super().__init__()
        self.group, self.lead, self.seq_dim = group, tuple(lead), seq_dim
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            out = self._cross_entropy(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _target_piece(self, inp: torch.Tensor, target: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's labels shaped as ``inp`` without its class dimension, or None where the shapes are not those
        of a piece of the sequence and its whole labels."""
        if inp.dim() < 2 or target.is_floating_point() or target.dim() != inp.dim() - 1:
            return None
        tokens = math.prod(self.lead)
        if inp.numel() // inp.shape[1] * self.size != tokens or target.numel() != tokens:
            return None
        if target.dim() > 1 and tuple(target.shape) != self.lead:
            return None
        piece = shard(target.reshape(self.lead), self.seq_dim, self.size, self.rank)
        return piece.reshape(inp.shape[:1] + inp.shape[2:])

    def _cross_entropy(self, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                       reduction="mean", label_smoothing=0.0):
        if size_average is not None or reduce is not None or reduction not in ("mean", "sum"):
            return None  # legacy arguments and per-token losses: left to torch
        piece = self._target_piece(input, target)
        if piece is None:
            return None
        self.calls += 1
        total = F.cross_entropy(input, piece, weight=weight, ignore_index=ignore_index, reduction="sum",
                                label_smoothing=label_smoothing)
        if reduction == "mean":  # torch's denominator: the counted tokens, or their classes' weights
            kept = piece != ignore_index
            count = (weight[piece.clamp(min=0)] * kept).sum() if weight is not None else kept.sum()
            count = count.to(torch.float64).reshape(1)
            dist.all_reduce(count, group=self.group)
            total = total / count.to(total.dtype).reshape(())
        value = total.detach().clone()
        dist.all_reduce(value, group=self.group)
        scaled = total * self.size  # [Note: gradients under context parallelism]
        return scaled + (value - scaled).detach()


@dataclass
class LossCheck:
    """The verdict of :func:`check_sharded_loss`: whether the step's loss runs on the pieces, and why not."""

    sharded: bool
    why: str = ""

    def describe(self) -> str:
        if self.sharded:
            return ("  context parallel: the final norm, the head and the cross-entropy run on each rank's piece of "
                    "the sequence (sharded to the loss)")
        return f"  context parallel: the stack's output is gathered whole before the head ({self.why})"


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the reassociation of the step's sums over the tokens: the pieces add the same float32 terms in
    another order (each rank's partial sum, then the group's), which moves a sum by a few ulps of its magnitude;
    64 float32 eps, relative and absolute, holds that with room for the means and logs derived from it."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return False
    eps = torch.finfo(torch.float32).eps
    return bool(torch.allclose(a, b, rtol=64 * eps, atol=64 * eps, equal_nan=True))


def check_sharded_loss(run: Callable[[], tuple[Any, list]], context, device: torch.device) -> LossCheck:
    """Run ``run()`` (the user's step on one recorded micro-batch, returning its output and logs as ``(name, value,
    kwargs)``) gathered and sharded to the loss, and agree over the cp group whether the pieces serve ([Note:
    sharded to the loss]). Collective over the group (every rank runs both); no gradient."""
    with torch.no_grad():
        whole_out, whole_logs = run()
        reason = ""
        try:
            with context.sharded_loss(probe=True) as seen:
                out, logs = run()
        except Exception as err:  # noqa: BLE001 - any failure of the pieces keeps the gather
            reason = f"the step fails on the pieces: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        else:
            reason = _differs(whole_out, whole_logs, out, logs, seen.calls)
    ok = torch.tensor([0.0 if reason else 1.0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=context.group)
    if ok.item() < 1 and not reason:
        reason = "another rank of the context-parallel group found the pieces differ"
    return LossCheck(sharded=not reason, why=reason)


def _loss(out: Any) -> Optional[torch.Tensor]:
    loss = out.get("loss") if isinstance(out, dict) else out
    return loss if isinstance(loss, torch.Tensor) else None


def _differs(whole_out, whole_logs, out, logs, calls: int) -> str:
    if calls == 0:
        return "the step computes no per-token F.cross_entropy of the logits against the batch's labels"
    a, b = _loss(whole_out), _loss(out)
    if a is None or b is None:
        return "the step returns no loss tensor"
    if not _close(a, b):
        return f"the step's loss is {b.item():.6g} on the pieces and {a.item():.6g} whole"
    whole = {name: v for name, v, _ in whole_logs}
    for name, value, _ in logs:
        if name in whole and not _close(whole[name], value):
            return f"the logged `{name}` is {value.item():.6g} on the pieces and {whole[name].item():.6g} whole"
    return ""


__all__ = ["LossCheck", "ShardedCrossEntropy", "check_sharded_loss"]
