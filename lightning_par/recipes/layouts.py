"""Running the same model under several parallel layouts and setting each beside the advisor's prediction.

The memory and communication recipes share this: each layout of the recipe's config is one fit with
:class:`~lightning_par.callbacks.ParallelMetrics` (per-rank bytes of parameters, gradients, optimizer
state, activations alive, and communication, measured on one step) and one
:func:`~lightning_par.advisor.estimate` for the same layout, on the same model and batch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lightning_par.advisor import Layout, estimate, profile_lightning_module
from lightning_par.advisor.memory import Estimate, stage_estimates
from lightning_par.advisor.profile import ModuleProfile
from lightning_par.recipes.common import accelerator, gpt_workload, measured_fit, start_method

KINDS = ("single", "dp", "pp", "tp", "hybrid")


@dataclass
class Measured:
    name: str
    layout: Layout
    rows: list[dict]           # ParallelMetrics, one per rank
    predicted: Estimate        # the advisor, busiest rank
    profile: ModuleProfile     # the advisor's measured probe of the model

    def busiest(self, key: str) -> float:
        return max(r.get(key, 0.0) for r in self.rows)


def strategy_for(kind: str, args: dict, acc: str):
    if kind == "single":
        return "auto"
    if kind == "dp":
        from lightning_par.strategies.data_parallel import DataParallelStrategy as cls
    elif kind == "pp":
        from lightning_par import PipelineParallelStrategy as cls
    elif kind == "tp":
        from lightning_par import TensorParallelStrategy as cls
    elif kind == "hybrid":
        from lightning_par import HybridParallelStrategy as cls
    else:
        raise ValueError(f"layout kind {kind!r} must be one of {KINDS}.")
    return cls(start_method=start_method(acc), **args)


def layout_for(kind: str, args: dict, devices: int) -> Layout:
    return replace(_sizes_for(kind, args, devices), comm_hook=args.get("comm_hook"))


def _sizes_for(kind: str, args: dict, devices: int) -> Layout:
    ac = args.get("activation_checkpointing")
    if kind in ("single", "dp"):
        return Layout(data_parallel_size=devices, zero_stage=args.get("zero_stage", 0), activation_checkpointing=ac)
    if kind == "pp":
        p = args.get("pipeline_parallel_size", devices)
        return Layout(data_parallel_size=devices // p, pipeline_parallel_size=p,
                      microbatches=args.get("microbatches") or 2 * p, schedule=args.get("schedule", "1f1b"),
                      zero_stage=args.get("zero_stage", 0), activation_checkpointing=ac)
    if kind == "hybrid":
        p, t = args.get("pipeline_parallel_size", 1), args.get("tensor_parallel_size", 1)
        c = args.get("context_parallel_size", 1)
        return Layout(data_parallel_size=devices // (p * t * c), pipeline_parallel_size=p, tensor_parallel_size=t,
                      microbatches=args.get("microbatches") or 2 * p, schedule=args.get("schedule", "1f1b"),
                      zero_stage=args.get("zero_stage", 0), activation_checkpointing=ac, context_parallel_size=c)
    t = args.get("tensor_parallel_size", devices)
    return Layout(data_parallel_size=devices // t, tensor_parallel_size=t,
                  sequence_parallel=args.get("sequence_parallel", False), zero_stage=args.get("zero_stage", 0),
                  activation_checkpointing=ac)


def measure_layouts(cfg, out_dir: Path) -> list[Measured]:
    """Fit ``cfg.model`` under every entry of ``cfg.layouts`` ({name: {kind, devices, args}})."""
    acc = accelerator(cfg)
    data, make_module = gpt_workload(cfg.model, cfg.batch_size, cfg.batch_size * 4 * (cfg.max_steps + 1),
                                     warmup_steps=1)

    results = []
    for name, entry in cfg.layouts.items():
        kind, devices, args = entry.kind, entry.devices, dict(entry.get("args", {}))
        layout = layout_for(kind, args, devices)
        global_batch = cfg.batch_size * layout.data_parallel_size
        probe_n = global_batch // (layout.data_parallel_size * layout.microbatches)
        x, y = (torch.stack(t) for t in zip(*(data.train_set[i] for i in range(probe_n))))
        profile = profile_lightning_module(make_module(), (x, y), precision=cfg.precision)
        predicted = estimate(profile, layout, global_batch, cfg.precision, "adamw")
        rows = measured_fit(make_module, data, strategy=strategy_for(kind, args, acc), devices=devices,
                            max_steps=cfg.max_steps, out_json=out_dir / f"metrics-{name}.json", accelerator=acc,
                            precision=cfg.precision)
        results.append(Measured(name, layout, rows, predicted, profile))
    return results


def gpt_profile(model: dict, precision: str, sequences: int = 2, **overrides) -> ModuleProfile:
    """The advisor's probe, on ``sequences`` random sequences, of the recipes' GPT of ``model`` with ``overrides``
    (the tiny baseline's sizes, a sweep's rung), built as the fits build it."""
    from lightning_par.models import GPT

    kw = {**model, **overrides}
    torch.manual_seed(0)
    gpt = GPT(**kw, warmup_steps=1)
    tokens = torch.randint(0, kw["vocab_size"], (sequences, kw["block_size"] + 1))
    return profile_lightning_module(gpt, (tokens[:, :-1], tokens[:, 1:]), precision=precision)


# [Note: a prediction net of the baseline fit]
# The capacity and memory recipes measure each rank's peak net of the same rank's fit of a tiny GPT (the layout's
# machinery, whatever the model: [Note: one fit, one clean process] in lightning_par/recipes/_capacity_job.py). That
# tiny fit holds tensors too, the logits of the same vocabulary and sequence above all (a few MiB at 1024 tokens),
# so the advisor's figure set beside the measurement is its estimate of the model net of its estimate of that tiny
# fit, rank by rank: a pipeline stage less the same stage (the tiny GPT's busiest stage is the one with the logits,
# the model's may be another).
def net_estimates(profile: ModuleProfile, base: ModuleProfile, layout: Layout, batch_size: int,
                  precision: str) -> tuple[Estimate, Estimate]:
    """``(model, baseline)``: the advisor's estimates of the stage whose model exceeds the baseline's same stage the
    most ([Note: a prediction net of the baseline fit])."""
    pairs = zip(stage_estimates(profile, layout, batch_size, precision, "adamw"),
                stage_estimates(base, layout, batch_size, precision, "adamw"))
    return max(pairs, key=lambda pair: pair[0].total_bytes - pair[1].total_bytes)


def net_bytes(profile: ModuleProfile, base: ModuleProfile, layout: Layout, batch_size: int, precision: str) -> int:
    """The advisor's busiest rank net of the baseline fit on the same rank, in bytes."""
    est, tiny = net_estimates(profile, base, layout, batch_size, precision)
    return est.total_bytes - tiny.total_bytes
