"""The measuring side of ``lightning-par-recipe capacity``: for each layout, the largest GPT of a size ladder whose
training keeps every rank's measured peak memory within a budget.

    python -m lightning_par.recipes._capacity_job SPEC.json OUT.json

``SPEC.json`` (written by :mod:`lightning_par.recipes.capacity`) holds the model, the ladder of ``n_layer`` values,
the budget in bytes, the training sizes and, per layout, its strategy and the advisor's predicted bytes per rung.
``OUT.json`` gets, per layout, the tiny-model baseline and every measured rung (each rank's numbers) and the largest
rung that fit. Every rank writes its own ``rank<r>.json`` into the fit's folder from a callback.

[Note: one fit, one clean process]
This interpreter only imports and forks. Every fit runs in a child forked from it (its own process group, killed
whole on a timeout): the one-device fit in that child, a multi-rank fit in ranks that Lightning forks from it
(spawns on CUDA). The parent never builds a model nor receives one (Lightning hands the trained module back to the
fit's child, which then exits), so each fit starts from the same memory image, and freed memory of an earlier fit
cannot be reused unseen by a later one. A rank's peak is measured from the callback's ``setup``, after the process
group exists and before the strategy gives the meta-built module its memory (the one-device fit: before building
the module), to the end of training, net of what the process held at that point (:class:`PeakMemory`). What the
strategy's own machinery costs whatever the model (lazy imports of DTensor / FSDP / pipelining code, gloo buffers,
the trace of one step on meta) is the same layout's fit of a tiny GPT (``baseline``); the budget bounds the rest:
``net(model) - net(tiny)`` on the busiest rank.
"""
from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import torch

from lightning_par.peak_memory import PeakMemory, held_bytes, reset_peak


class RankPeak(pl.Callback):
    """Writes this rank's peak memory (from ``setup``, or from ``meter``'s start) to ``run_dir/rank<r>.json``."""

    def __init__(self, run_dir: str, limit: int | None = None, meter: PeakMemory | None = None):
        self.run_dir, self.limit, self.meter = run_dir, limit, meter

    def setup(self, trainer, pl_module, stage):
        if self.meter is None:  # a rank of a multi-rank fit: the module is still on the meta device
            self.meter = start_meter(trainer.strategy.root_device, self.limit)
        elif trainer.world_size > 1 and not self.meter.cuda:  # a forked rank of a module built before the fork:
            reset_peak()  # its peak from here on, net of what the fit's process held before building it

    def on_train_end(self, trainer, pl_module):
        rec = {"rank": trainer.global_rank, "net": self.meter.net(), "peak": self.meter.peak(),
               "base": self.meter.base, "held": held_bytes(pl_module)}
        Path(self.run_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(rec))


def start_meter(device: torch.device, limit: int | None) -> PeakMemory:
    """A started meter of ``device``; on CUDA the caching allocator of this process is also held to ``limit`` bytes
    beyond what it holds now (``set_per_process_memory_fraction``): a fit that needs more fails with an OOM."""
    meter = PeakMemory(device)
    if meter.cuda and limit is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        held = torch.cuda.memory_reserved(device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (held + limit) / total), device)
    meter.start()
    return meter


def _strategy(layout: dict, accelerator: str):
    from lightning_par.recipes.layouts import strategy_for

    return strategy_for(layout["kind"], dict(layout.get("args", {})), accelerator)


def _fit(spec: dict, layout: dict, model_kw: dict, run_dir: str, limit: int | None) -> None:
    """One training run (in a forked child, see [Note: one fit, one clean process])."""
    from torch.utils.data import DataLoader

    from lightning_par.data import SyntheticCorpus
    from lightning_par.models import GPT

    os.setpgid(0, 0)  # the ranks Lightning forks from here join this group: a timeout kills them all
    torch.set_num_threads(1)
    acc = "gpu" if spec["accelerator"] in ("gpu", "cuda") else spec["accelerator"]
    steps, batch = spec["steps"], spec["batch_size"]
    sizes = layout.get("args", {})
    replicas = layout["devices"] // (sizes.get("pipeline_parallel_size", 1) * sizes.get("tensor_parallel_size", 1)
                                     * sizes.get("context_parallel_size", 1))
    data = SyntheticCorpus(vocab_size=model_kw["vocab_size"], seq_len=model_kw["block_size"],
                           train_sequences=batch * replicas * steps, val_sequences=1)
    loader = DataLoader(data.train_set, batch_size=batch)
    kw = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0, limit_val_batches=0, max_steps=steps, accelerator=acc,
              precision=spec["precision"])
    ac = layout.get("args", {}).get("activation_checkpointing")
    if ac is not None:  # imported before the meter starts: its code pages are not the model's memory
        from lightning_par.memory.checkpointing import apply_activation_checkpointing
    if layout["kind"] == "single":  # one device builds the whole module, as a user would; measured from before
        meter = start_meter(torch.device("cuda", 0) if acc == "gpu" else torch.device("cpu"), limit)
        torch.manual_seed(0)
        module = GPT(**model_kw, warmup_steps=1)
        if ac is not None:  # what the strategies apply
            apply_activation_checkpointing(module, ac)
        trainer = pl.Trainer(devices=1, strategy="auto", callbacks=[RankPeak(run_dir, meter=meter)], **kw)
    elif layout["kind"] == "dp" and not layout.get("args", {}).get("zero_stage") and acc == "cpu":
        # replicas hold the whole module (Lightning's empty_init leaves its weights uninitialized, not on meta): built
        # before the ranks fork, measured from before building it
        meter = start_meter(torch.device("cpu"), limit)
        torch.manual_seed(0)
        module = GPT(**model_kw, warmup_steps=1)
        trainer = pl.Trainer(devices=layout["devices"], strategy=_strategy(layout, acc),
                             callbacks=[RankPeak(run_dir, meter=meter)], **kw)
    else:  # every rank materializes only its share of the meta-built module
        trainer = pl.Trainer(devices=layout["devices"], strategy=_strategy(layout, acc),
                             callbacks=[RankPeak(run_dir, limit)], **kw)
        torch.manual_seed(0)
        with trainer.init_module(empty_init=True):
            module = GPT(**model_kw, warmup_steps=1)
    trainer.fit(module, loader)


def _child(spec, layout, model_kw, run_dir, limit) -> None:
    try:
        _fit(spec, layout, model_kw, run_dir, limit)
    except BaseException:
        Path(run_dir, "error.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def is_oom(text: str) -> bool:
    return "OutOfMemoryError" in text or "out of memory" in text


def measure(spec: dict, layout: dict, model_kw: dict, run_dir: Path, limit: int | None) -> list[dict] | None:
    """Every rank's record of one fit; None when it ran out of memory (CUDA, under ``limit``); an error otherwise."""
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(spec, layout, model_kw, str(run_dir),
                                                                           limit))
    proc.start()
    proc.join(spec["timeout_s"])
    if proc.is_alive():
        os.killpg(proc.pid, signal.SIGKILL)
        proc.join()
        raise RuntimeError(f"{layout['name']}, n_layer={model_kw['n_layer']}: the fit took over "
                           f"{spec['timeout_s']} s (killed; its folder: {run_dir})")
    error = run_dir / "error.txt"
    if proc.exitcode != 0 or error.exists():
        text = error.read_text() if error.exists() else f"exit code {proc.exitcode}"
        if is_oom(text):
            return None
        raise RuntimeError(f"{layout['name']}, n_layer={model_kw['n_layer']}: the fit failed:\n{text[-3000:]}")
    recs = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(layout["devices"])]
    print(f"  {layout['name']}: n_layer={model_kw['n_layer']}, width {model_kw['n_embd']}: fit in "
          f"{time.perf_counter() - t0:.1f} s, net peak per rank {[round(r['net'] / 2**20, 1) for r in recs]} MiB",
          flush=True)
    return recs


def largest_fitting(measure_rung: Callable[[int], int | None], predicted: list[int], budget: int,
                    start: int) -> tuple[int | None, dict[int, int | None]]:
    """The largest rung ``i`` of a ladder whose ``measure_rung(i)`` (bytes, None: it did not fit at all) is at most
    ``budget``, and every rung measured on the way. Measured bytes are taken to grow with the rung.

    It starts at ``start`` (the advisor's answer) and keeps a bracket: the largest rung known to fit and the
    smallest known not to. The next rung tried is where the measured bytes reach the budget if they follow the
    advisor's ``predicted`` bytes by an affine map through the (at most two) measured rungs nearest the budget,
    kept strictly inside the bracket; so a good prediction costs two fits (the answer, and the rung above it).

    Example::

        >>> measured = [10, 20, 30, 40, 50]
        >>> largest_fitting(measured.__getitem__, predicted=[8, 16, 24, 32, 40], budget=35, start=3)
        (2, {3: 40, 2: 30})
        >>> largest_fitting(measured.__getitem__, predicted=[8, 16, 24, 32, 40], budget=100, start=3)
        (4, {3: 40, 4: 50})
        >>> largest_fitting(measured.__getitem__, predicted=[8, 16, 24, 32, 40], budget=5, start=0)
        (None, {0: 10})
    """
    peaks: dict[int, int | None] = {}
    lo, hi = -1, len(predicted)  # lo fits (-1: none known), hi does not (len: none known)
    i = min(max(start, 0), len(predicted) - 1)
    while hi - lo > 1:
        peaks[i] = measure_rung(i)
        if peaks[i] is not None and peaks[i] <= budget:
            lo = i
        else:
            hi = i
        i = min(max(_aim(peaks, predicted, budget, lo), lo + 1), hi - 1)
    return (lo if lo >= 0 else None), peaks


def _aim(peaks: dict[int, int | None], predicted: list[int], budget: int, lo: int) -> int:
    known = sorted(((p, i) for i, p in peaks.items() if p is not None), key=lambda t: abs(t[0] - budget))[:2]
    if not known:
        return lo  # only failed runs: step down
    if len(known) == 2 and predicted[known[0][1]] != predicted[known[1][1]]:
        (p0, i0), (p1, i1) = known
        slope = (p1 - p0) / (predicted[i1] - predicted[i0])
        offset = p0 - slope * predicted[i0]
    else:
        slope, offset = known[0][0] / max(predicted[known[0][1]], 1), 0.0
    fitting = [j for j, pred in enumerate(predicted) if offset + slope * pred <= budget]
    return max(fitting, default=-1)


def run_layout(spec: dict, layout: dict, out_dir: Path) -> dict:
    """The baseline (tiny GPT) and the search over the ladder for one layout; each fit's records, the answer."""
    # a sweep (capacity_sweeps) brings its own axis, ladder and model: the sequence length, or n_layer at a long one
    ladder, budget, axis = layout.get("ladder", spec["n_layers"]), spec["budget"], layout.get("axis", "n_layer")
    model = {**spec["model"], **layout.get("model", {})}
    tiny = {**model, **spec["tiny"], **layout.get("tiny", {})}
    base = measure(spec, layout, tiny, out_dir / f"{layout['name']}-tiny", None)
    base_net = [r["net"] for r in base]
    runs: dict[int, dict] = {}

    def measure_rung(i: int) -> int | None:
        n = ladder[i]
        limit = budget + max(base_net)  # CUDA: the allocator may hold the baseline and the budget
        recs = measure(spec, layout, {**model, axis: n}, out_dir / f"{layout['name']}-{n}", limit)
        model_net = None if recs is None else max(r["net"] - b for r, b in zip(recs, base_net))
        runs[n] = {"ranks": recs, "model_net": model_net, "oom": recs is None,
                   "fits": model_net is not None and model_net <= budget}
        print(f"  {layout['name']}: {axis}={n}: " + ("out of memory" if recs is None else
              f"the model's peak {model_net / 2**20:.1f} MiB (budget {budget / 2**20:.1f})"), flush=True)
        return model_net

    best, _ = largest_fitting(measure_rung, layout["predicted"], budget, layout["start"])
    return {"baseline": base, "runs": {str(n): r for n, r in sorted(runs.items())},
            "largest": None if best is None else ladder[best]}


def run_fits(spec: dict, layout: dict, out_dir: Path) -> dict:
    """The baseline (tiny GPT) and one fit of each of ``layout["fits"]`` (no search; each ``{"model": {...},
    "args": {...}}`` over the spec's model and the layout's strategy arguments): each fit's records and the busiest
    rank's peak net of the baseline (``spec["fits"]``: the memory recipe's activation checkpointing). With
    ``spec["baseline_per_fit"]`` each fit has its own baseline, the tiny GPT under the fit's arguments
    ([Note: a baseline per checkpointing mode] in :mod:`lightning_par.recipes.memory`)."""
    tiny = {**spec["model"], **spec["tiny"]}
    base = measure(spec, layout, tiny, out_dir / f"{layout['name']}-tiny", None)
    runs = {}
    for name, fit in layout["fits"].items():
        fit_layout = {**layout, "args": {**layout.get("args", {}), **fit.get("args", {})}}
        own = (measure(spec, fit_layout, tiny, out_dir / f"{layout['name']}-{name}-tiny", None)
               if spec.get("baseline_per_fit") and any(v is not None for v in fit.get("args", {}).values())
               else base)
        recs = measure(spec, fit_layout, {**spec["model"], **fit.get("model", {})},
                       out_dir / f"{layout['name']}-{name}", None)
        runs[name] = {"ranks": recs, "model_net": max(r["net"] - b["net"] for r, b in zip(recs, own)),
                      "baseline": own}
    return {"baseline": base, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    spec_path, out_path = (sys.argv[1:] if argv is None else argv)
    spec = json.loads(Path(spec_path).read_text())
    # what this interpreter imported is every fit's, and each fit's launch collects before it forks its ranks
    # ([Note: collect before fork] in lightning_par/strategies/_materialize.py): frozen here, that collection walks
    # only what the fit made (~0.4 s a fit otherwise, a whole-heap walk in each fit's child)
    gc.collect()
    gc.freeze()
    out_dir = Path(out_path).parent / "fits"
    results = {}
    for layout in spec["layouts"]:
        results[layout["name"]] = (run_fits if spec.get("fits") else run_layout)(spec, layout, out_dir)
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
