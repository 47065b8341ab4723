"""pipeline_bubble: bubble fraction vs micro-batches, activations GPipe vs 1F1B (recipes/pipeline_bubble/README.md)."""
from __future__ import annotations

import statistics
from pathlib import Path


from lightning_par.pipeline.schedules import bubble_fraction
from lightning_par.recipes.common import figure, Report, accelerator, gpt_workload, measured_fit, savefig
from lightning_par.recipes.layouts import strategy_for


def run(cfg, out_dir: Path, command: str) -> Report:
    acc = accelerator(cfg)
    data, make_module = gpt_workload(cfg.model, cfg.batch_size, cfg.batch_size * (cfg.max_steps + 2), warmup_steps=1)

    results, rows = {}, []
    for p in cfg.stages:
        for m in cfg.microbatches:
            for schedule in cfg.schedules:
                args = {"pipeline_parallel_size": p, "microbatches": m, "schedule": schedule, "balance": "uniform"}
                ranks = measured_fit(make_module, data, strategy=strategy_for("pp", args, acc), devices=p,
                                     max_steps=cfg.max_steps, out_json=out_dir / f"metrics-p{p}-m{m}-{schedule}.json",
                                     accelerator=acc)
                bubbles = [r["bubble"] for r in ranks if "bubble" in r]
                measured = statistics.mean(bubbles) if bubbles else float("nan")
                activ = max(r.get("activation_bytes", 0) for r in ranks)
                results[f"p{p}-m{m}-{schedule}"] = {"p": p, "m": m, "schedule": schedule, "bubble": measured,
                                                    "per_rank_bubble": bubbles, "activation_bytes": activ,
                                                    "formula": bubble_fraction(stages=p, microbatches=m)}
                rows.append([p, m, schedule, f"{bubble_fraction(stages=p, microbatches=m):.3f}", f"{measured:.3f}",
                             " ".join(f"{b:.3f}" for b in bubbles), f"{activ / 1024:.0f}"])
    memory = []
    for p in cfg.stages:
        for m in cfg.microbatches:
            g, f = results.get(f"p{p}-m{m}-gpipe"), results.get(f"p{p}-m{m}-1f1b")
            if g and f:
                memory.append([p, m, f"{g['activation_bytes'] / 1024:.0f}", f"{f['activation_bytes'] / 1024:.0f}",
                               f"{f['activation_bytes'] / g['activation_bytes']:.3f}", f"{min(p, m) / m:.3f}"])
    report = Report(
        title="pipeline_bubble: bubble fraction vs micro-batches, activation memory GPipe vs 1F1B",
        command=command,
        published=("bubble (p−1)/(m+p−1) for GPipe and 1F1B (Huang et al., 2019; Narayanan et al., 2021); 1F1B holds "
                   "at most p micro-batches of activations, GPipe all m (Narayanan et al., 2021)"),
        data=results,
    )
    report.tables.append(("Bubble fraction: formula vs measured (mean over stages)",
                          ["p", "m", "schedule", "(p−1)/(m+p−1)", "measured", "per stage", "activations KiB"], rows))
    report.tables.append(("Activations alive at once on the busiest stage: 1F1B / GPipe vs the bound min(p, m)/m",
                          ["p", "m", "GPipe KiB", "1F1B KiB", "1F1B / GPipe", "min(p,m)/m"], memory))
    report.figures.append(("Bubble fraction vs micro-batches (lines: formula)", savefig(_plot(results, cfg), out_dir,
                                                                                      "bubble.png")))
    report.notes.append("Measured bubble includes the time spent sending/receiving activations (gloo over "
                        "loopback on CPU), which the formula, counting compute only, does not.")
    return report


def _plot(results, cfg):
    fig, ax = figure(6.5, 4)
    ms = list(cfg.microbatches)
    for p in cfg.stages:
        line = ax.plot(ms, [bubble_fraction(stages=p, microbatches=m) for m in ms], "-", label=f"(p−1)/(m+p−1), p={p}")
        for schedule, marker in zip(cfg.schedules, "os^"):
            pts = [(m, results[f"p{p}-m{m}-{schedule}"]["bubble"]) for m in ms]
            ax.plot(*zip(*pts), marker, color=line[0].get_color(), label=f"{schedule}, p={p}", ls="none")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.legend(fontsize=8)
    return fig
