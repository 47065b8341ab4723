"""Training metrics of a parallel run: throughput, MFU, per-rank memory, communication, pipeline bubble.

``ParallelMetrics`` is on by default in ``lightning-par-train``; add it to any ``Trainer(callbacks=...)``.
Everything is logged through the trainer's loggers (``perf/*`` keys) and summarised in a table at the
end of ``fit`` (rank 0 prints it; per-rank rows are gathered from every rank).

[Note: what each number means]
- ``samples_per_s`` / ``tokens_per_s``: global samples (per-device batch × data-parallel replicas) over
  the wall time between the ends of consecutive optimizer steps. ``tokens`` counts the elements of the
  batch's first tensor when it holds integer token ids.
- ``mfu``: 6 × parameters × tokens/s over the peak FLOP/s of all devices (``peak_flops_per_device``;
  on CUDA Lightning's table of known GPUs fills it in for the dtype the run's precision computes in, as
  Lightning's ``ThroughputMonitor`` does: bf16 peak under ``bf16-mixed`` / ``bf16-true``, fp16 under
  ``16-mixed``, fp32 (or tf32) under ``32-true``); not logged when the peak is unknown (CPU).
- ``param/grad/optimizer_bytes``: what this rank holds (local shards of DTensors), after a step.
  ``activation_bytes``: the most bytes of tensors saved for backward alive at once during one training
  step on this rank (every storage once, parameters excluded; a tensor stops counting when autograd
  frees it after its backward) — under a pipeline schedule, what the micro-batches in flight hold;
  ``activation_saved_bytes``: all bytes saved during the step. On CUDA ``peak_allocated_bytes`` is exact.
- ``comm_bytes``: wire bytes this rank sent in the measured step (``lightning_par.comm``; by op kind in
  ``comm_bytes_by_kind``, where Lightning's own small control broadcasts show apart from gradients), and
  ``comm_share``: the time spent inside communication calls in the measured step over the median timed
  step (a lower bound: the part of asynchronous bucket all-reduces that overlaps compute is not in it).
- ``bubble``: when the strategy reports pipeline timing (``last_step_stats`` with the seconds the
  stage computed, ``busy_s``, and the seconds its schedule took, ``schedule_s``), ``1 − busy / schedule``.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_par import _compat
from lightning_par._compat import tree_flatten
from lightning_par.comm import CommCounter, count_comm, local_nbytes
from lightning_par.dp.zero import optimizer_state_bytes
from lightning_par.saved import SavedTensorMeter


def state_bytes(module: torch.nn.Module, optimizers) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds."""
    params = {id(p): p for p in module.parameters()}.values()
    opt = sum(optimizer_state_bytes(optimizer) for optimizer in optimizers)
    return {"param_bytes": sum(local_nbytes(p) for p in params),
            "grad_bytes": sum(local_nbytes(p.grad) for p in params),
            "optimizer_bytes": opt}


class ParallelMetrics(pl.Callback):
    """Throughput, MFU, per-rank memory, communication and pipeline bubble (see the module's Note).

    Args:
        measure_step: the optimizer step (counted from 0) on which memory, activations and
            communication are measured (slow: every op passes through Python); later steps are timed.
        peak_flops_per_device: peak FLOP/s of one device for MFU, at the run's precision (None: Lightning's
            table on CUDA, for the dtype the precision plugin computes in).
        summary: print the table at the end of fit on rank 0.
        save_path: write the gathered per-rank rows there as JSON at the end of fit (rank 0), for
            scripts that run the fit in child processes (fork/spawn launchers) and read the numbers back.
    """

    def __init__(self, *, measure_step: int = 1, peak_flops_per_device: float | None = None, summary: bool = True,
                 save_path: str | None = None):
        if measure_step < 0:
            raise ValueError(f"`measure_step={measure_step}` must be >= 0.")
        self.measure_step = measure_step
        self.peak_flops_per_device = peak_flops_per_device
        self.summary = summary
        self.save_path = save_path
        self.step_times: list[float] = []
        self.samples_per_step = 0
        self.tokens_per_step = 0
        self.measured: dict[str, float] = {}
        self.bubbles: list[float] = []
        self._last_end: float | None = None
        self._counter = CommCounter()
        self._stack: list[Any] = []
        self._comm_seconds: float | None = None

    # -- per step ---------------------------------------------------------------------------------
    def _measuring(self, trainer) -> bool:
        return trainer.global_step == self.measure_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.samples_per_step:
            self._batch_size(trainer, batch)
        if self._measuring(trainer) and not self._stack:
            saved = SavedTensorMeter(pl_module.parameters())
            hooks, counting = saved.track(), count_comm(self._counter)
            hooks.__enter__()
            counting.__enter__()
            self._stack = [saved, hooks, counting]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        if self._stack:
            saved, hooks, counting = self._stack
            counting.__exit__(None, None, None)
            hooks.__exit__(None, None, None)
            self._stack = []
            self._counter.steps = 1
            self.measured.update(state_bytes(pl_module, trainer.optimizers))
            self.measured["activation_bytes"] = saved.peak
            self.measured["activation_saved_bytes"] = saved.total
            self.measured["comm_bytes"] = self._counter.wire_bytes
            self.measured["comm_calls"] = sum(self._counter.calls.values())
            self._comm_seconds = self._counter.seconds
            self.measured["comm_bytes_by_kind"] = dict(self._counter.wire)
            self.measured["comm_calls_by_kind"] = dict(self._counter.calls)
            if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
                self.measured["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(trainer.strategy.root_device)
            self._log(trainer, {f"perf/{k}": v for k, v in self.measured.items() if not isinstance(v, dict)})
            self._last_end = None  # the measured step is slow: don't time it
            return
        stats = getattr(trainer.strategy, "last_step_stats", None)
        if isinstance(stats, dict) and stats.get("schedule_s", 0) > 0 and "busy_s" in stats:
            self.bubbles.append(1.0 - stats["busy_s"] / stats["schedule_s"])
        if self._last_end is not None:
            dt = now - self._last_end
            self.step_times.append(dt)
            self._log(trainer, self._rates(dt))
        self._last_end = now

    # -- helpers ----------------------------------------------------------------------------------
    def _batch_size(self, trainer, batch) -> None:
        leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
        if not leaves:
            return
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas = kwargs.get("num_replicas", 1)
        first = leaves[0]
        self.samples_per_step = first.shape[0] * replicas * trainer.accumulate_grad_batches
        if not first.is_floating_point():
            self.tokens_per_step = first.numel() * replicas * trainer.accumulate_grad_batches

    def _rates(self, dt: float) -> dict[str, float]:
        out = {"perf/step_s": dt, "perf/samples_per_s": self.samples_per_step / dt}
        if self.tokens_per_step:
            out["perf/tokens_per_s"] = self.tokens_per_step / dt
        return out

    def _log(self, trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _peak(self, trainer) -> float | None:
        if self.peak_flops_per_device is not None:
            return self.peak_flops_per_device
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return None
        from lightning.fabric.utilities.throughput import get_available_flops

        return get_available_flops(device, _compat.compute_dtype(trainer.precision_plugin))

    def on_fit_end(self, trainer, pl_module):
        row = dict(self.measured)
        if self.step_times:
            step = statistics.median(self.step_times)
            row.update({"step_s": step, "samples_per_s": self.samples_per_step / step})
            if self.tokens_per_step:
                row["tokens_per_s"] = self.tokens_per_step / step
                peak = self._peak(trainer)
                n_params = sum(p.numel() for p in {id(q): q for q in pl_module.parameters()}.values())
                if peak:
                    row["mfu"] = 6 * n_params * row["tokens_per_s"] / (peak * trainer.world_size)
            if self._comm_seconds is not None:
                row["comm_share"] = min(self._comm_seconds / step, 1.0)
        if self.bubbles:
            row["bubble"] = statistics.median(self.bubbles)
        rows = _gather(row, trainer)
        self.rows = rows
        if trainer.is_global_zero:
            if self.summary:
                print(format_summary(rows))
            if self.save_path:
                with open(self.save_path, "w") as f:
                    json.dump(rows, f, indent=1)


def _gather(row: dict, trainer) -> list[dict]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        return rows
    return [row]


def format_summary(rows: list[dict]) -> str:
    """One line per rank: throughput, memory and communication (sizes in MiB)."""
    cols = [("step_s", "step s", "{:.3f}"), ("samples_per_s", "samples/s", "{:.1f}"),
            ("tokens_per_s", "tokens/s", "{:.0f}"), ("mfu", "MFU", "{:.1%}"),
            ("param_bytes", "params MiB", "mib"), ("grad_bytes", "grads MiB", "mib"),
            ("optimizer_bytes", "optim MiB", "mib"), ("activation_bytes", "activ MiB", "mib"),
            ("comm_bytes", "comm MiB/step", "mib"), ("comm_share", "comm share", "{:.1%}"),
            ("bubble", "bubble", "{:.1%}")]
    present = [c for c in cols if any(c[0] in r for r in rows)]
    head = "rank " + " ".join(f"{title:>13s}" for _, title, _ in present)
    lines = ["lightning_par metrics (median over timed steps)", head]
    for rank, r in enumerate(rows):
        cells = []
        for key, _, fmt in present:
            v = r.get(key)
            cells.append(f"{'-':>13s}" if v is None else
                         f"{v / 2**20:13.3f}" if fmt == "mib" else f"{fmt.format(v):>13s}")
        lines.append(f"{rank:4d} " + " ".join(cells))
    return "\n".join(lines)
