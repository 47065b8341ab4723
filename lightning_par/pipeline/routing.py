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
([Note: loss reporting, one rule] in lightning_par.strategies._engine); ``sync_dist`` then averages equal
values, a no-op. A torchmetrics
``Metric`` logged as an object is replayed as its per-micro-batch value (``_forward_cache``) combined
the same way; the object itself is never synchronised over ranks that did not update it.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_par import patches
from lightning_par._compat import metric_forward_value
from lightning_par.pipeline.mailbox import ResultMailbox
from lightning_par.pipeline.microbatch import weighted_mean


class LogCapture:
    """Context manager: while active, ``module.log(name, value, **kw)`` records instead of logging (the value
    passed through ``convert`` first, if given)."""

    def __init__(self, module: torch.nn.Module, convert=None):
        self.module, self.convert = module, convert
        self.records: dict[str, list[tuple[int, torch.Tensor, dict]]] = {}
        self.microbatch = 0

    def __enter__(self) -> "LogCapture":
        self.module.log = self._record  # instance attribute shadows LightningModule.log (log_dict calls it too)
        self._take_out = patches.record("module-log", lambda: self.module.__dict__.pop("log", None))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._take_out()

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("self.log under pipeline parallelism (and tensor parallelism with replicas) takes the value "
                            "positionally and options by keyword.")
        if self.convert is not None:
            value = self.convert(value)
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
        value = metric_forward_value(value)
        if value is None:
            raise ValueError(
                "A torchmetrics Metric logged under pipeline parallelism must have been called on the batch "
                "(`metric(preds, target)`) in the same step."
            )
    if isinstance(value, DTensor):  # a loss computed on vocabulary shards (loss_parallel): replicated
        value = value.full_tensor()
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


class ResultRouter:
    """Every rank of a pipeline returns and logs what its last stage's step produced: the last stage sends
    it through the ``mailbox`` ([Note: result mailbox]; ``None`` with one stage), the others receive it,
    and with data-parallel replicas (``dp_group``) the scalars are averaged over them."""

    def __init__(self, *, mailbox: Optional[ResultMailbox], is_last: bool, device: torch.device,
                 dp_group=None, dp_size: int = 1, pp_group=None, last_rank: int = 0):
        self.mailbox, self.is_last, self.device = mailbox, is_last, device
        self.dp_group, self.dp_size = dp_group, dp_size
        self.pp_group, self.last_rank = pp_group, last_rank

    def post(self) -> None:
        """Receivers: post this step's receive early (see [Note: result mailbox])."""
        if self.mailbox is not None:
            self.mailbox.post()

    def send(self, outputs: list, sizes: list[int], capture: LogCapture) -> tuple:
        """The last stage: combine the micro-batches' results and logs, and send them on."""
        result = None if outputs[0] is None else combine_outputs(outputs, sizes)
        payload = (map_tensors(result, lambda t: t.detach().cpu()), capture.combined(sizes))
        if self.mailbox is not None:
            self.mailbox.send(payload)
        return payload

    def route(self, payload: Optional[tuple], module: torch.nn.Module) -> Any:
        """Every rank: log the last stage's ``payload`` (received here on the other stages) through
        ``module.log`` and return its result."""
        if self.mailbox is not None:
            if self.is_last:
                self.mailbox.finish()
            else:
                payload = self.mailbox.receive()
        result, logs = payload
        result = map_tensors(result, lambda t: t.to(self.device))
        logs = [(n, v.to(self.device), kw) for n, v, kw in logs]
        if self.dp_group is not None:
            result, logs = self.mean_over_replicas(result, logs)
        for name, value, kw in logs:
            module.log(name, value, **kw)
        return result

    def mean_over_replicas(self, result: Any, logs: list) -> tuple[Any, list]:
        """The replicas' values averaged (they train equal shares of the global batch), so every rank
        returns and logs what one device would for the global batch and ``callback_metrics`` agree on all
        ranks (see [Note: log routing])."""
        keys = [k for k, v in (result.items() if isinstance(result, dict) else [(None, result)])
                if isinstance(v, torch.Tensor) and v.numel() == 1]
        picked = [result[k] if k is not None else result for k in keys] + [v for _, v, _ in logs]
        if not picked:
            return result, logs
        vec = torch.stack([v.detach().float().reshape(()) for v in picked])
        dist.all_reduce(vec, group=self.dp_group)
        vec /= self.dp_size
        for i, k in enumerate(keys):
            if k is None:
                result = vec[i]
            else:
                result = {**result, k: vec[i]}
        return result, [(n, vec[len(keys) + j], kw) for j, (n, _, kw) in enumerate(logs)]

    def broadcast_from_last(self, obj: Any) -> Any:
        """Predictions: the last stage's ``obj`` on every rank of the pipeline."""
        if self.pp_group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.pp_group)
        return box[0]


def confine_metrics(module: torch.nn.Module, *, is_last: bool, dp_group) -> None:
    """torchmetrics objects are updated by the last stage only: sync them over the last stages of the
    replicas (the ranks that updated them), never over ranks that did not (that would hang)."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover
        return
    for metric in (m for m in module.modules() if isinstance(m, Metric)):
        if is_last and dp_group is not None:
            metric.process_group = dp_group
        else:
            metric.sync_on_compute = False


def map_tensors(obj: Any, fn) -> Any:
    """``fn`` applied to a tensor, or to the tensors of a dict (a step's result); anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj
