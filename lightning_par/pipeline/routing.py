"""Route what the user's step produces on the last stage (its return value and its ``self.log`` calls)
to every rank of the pipeline, combined over micro-batches as one device would have seen the batch.

[Note: log routing] Only the last stage runs the code after the blocks, and it runs it once per
micro-batch. If those ``self.log`` calls went straight to Lightning, rank 0 (the first stage) would log
nothing, the last stage would log the last micro-batch's value, and ``sync_dist=True`` would hang
because only the last stage reaches the all-reduce. So during the micro-batches ``self.log`` is
captured; afterwards the last stage combines each name's values (weighted by micro-batch size: the
batch mean of micro-batch means), broadcasts them in its pipeline, and every rank replays the calls
with the original keyword arguments. With data-parallel replicas the values (and the returned loss)
are first averaged over the replicas, so every rank logs what one device would for the global batch
and ``trainer.callback_metrics`` agree on all ranks (this differs from DDP, where values are
rank-local unless ``sync_dist=True``); ``sync_dist`` then averages equal values, a no-op. A torchmetrics
``Metric`` logged as an object is replayed as its per-micro-batch value (``_forward_cache``) combined
the same way; the object itself is never synchronised over ranks that did not update it.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from lightning_par.pipeline.microbatch import weighted_mean


class LogCapture:
    """Context manager: while active, ``module.log(name, value, **kw)`` records instead of logging."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.records: dict[str, list[tuple[int, torch.Tensor, dict]]] = {}
        self.microbatch = 0

    def __enter__(self) -> "LogCapture":
        self.module.log = self._record  # instance attribute shadows LightningModule.log (log_dict calls it too)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.module.__dict__.pop("log", None)

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("self.log under pipeline parallelism takes the value positionally and options by keyword.")
        self.records.setdefault(name, []).append((self.microbatch, _as_tensor(value), kwargs))

    def combined(self, sizes: Sequence[int]) -> list[tuple[str, torch.Tensor, dict]]:
        """One (name, value, kwargs) per logged name: the size-weighted mean of its micro-batch values."""
        out = []
        for name, recs in self.records.items():
            last = {mb: (v, kw) for mb, v, kw in recs}  # several calls in one micro-batch: the last counts
            mbs = sorted(last)
            value = weighted_mean([last[mb][0].float() for mb in mbs], [sizes[mb] for mb in mbs])
            out.append((name, value.detach().cpu(), last[mbs[-1]][1]))
        return out


def _as_tensor(value: Any) -> torch.Tensor:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover
        Metric = ()  # type: ignore[assignment]
    if isinstance(value, Metric):
        value = value._forward_cache
        if value is None:
            raise ValueError(
                "A torchmetrics Metric logged under pipeline parallelism must have been called on the batch "
                "(`metric(preds, target)`) in the same step."
            )
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"self.log needs a scalar, got a tensor of shape {tuple(value.shape)}.")
        return value.detach().reshape(())
    return torch.tensor(float(value))


def combine_outputs(outputs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """The step's return value from the micro-batches' (detached): scalar tensors and numbers averaged by
    size, dict entries likewise, anything else taken from the last micro-batch."""
    first = outputs[0]
    if isinstance(first, torch.Tensor) and first.numel() == 1:
        return weighted_mean([o.detach().float() for o in outputs], sizes)
    if isinstance(first, Mapping):
        return {k: combine_outputs([o[k] for o in outputs], sizes) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return weighted_mean(list(outputs), sizes)
    last = outputs[-1]
    return last.detach() if isinstance(last, torch.Tensor) else last


def concat_outputs(outputs: Sequence[Any]) -> Any:
    """Predictions of the micro-batches joined along dimension 0 (tensors, or dicts/tuples of tensors)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([o.detach() for o in outputs]) if first.dim() > 0 else first.detach()
    if isinstance(first, Mapping):
        return {k: concat_outputs([o[k] for o in outputs]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat_outputs([o[i] for o in outputs]) for i in range(len(first)))
    return list(outputs)
