"""capacity: the largest reference GPT that trains within a per-device memory budget, on one device and under
DP ZeRO-3, PP2, TP2 and PP2×TP2, measured on the ranks beside the advisor's prediction (recipes/capacity/README.md).

1. The advisor: one activation probe of a 2-block GPT of the ladder's width, scaled to every rung
   (:func:`~lightning_par.recipes.decision.scaled_profile`: exact parameter counts, the blocks' activations
   repeated), and :func:`~lightning_par.advisor.estimate` of each layout's busiest rank per rung, net of its
   estimate of the tiny GPT's fit that the measurement subtracts ([Note: a prediction net of the baseline fit] in
   :mod:`lightning_par.recipes.layouts`); its largest rung within the budget is where the measured search starts.
2. The measurement (:mod:`lightning_par.recipes._capacity_job`, one fresh interpreter, every fit a forked child): per
   layout a tiny GPT's fit (what the layout's machinery costs whatever the model), then fits of ladder rungs,
   meta-built (``trainer.init_module(empty_init=True)``: no rank builds the whole model), each a few AdamW steps on
   the synthetic corpus, until the largest rung whose busiest rank stays within the budget is bracketed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lightning_par.recipes.common import Report, figure, savefig
from lightning_par.recipes.decision import scaled_profile
from lightning_par.recipes.layouts import gpt_profile, layout_for, net_bytes

GiB, MiB = 1024**3, 1024**2


def ladder(cfg) -> list[int]:
    """The rungs' ``n_layer``: ``first``, ``first + step``, ... (``rungs`` of them), at the model's fixed width."""
    n_layers = [cfg.ladder.first + i * cfg.ladder.step for i in range(cfg.ladder.rungs)]
    stages = max(dict(e.get("args", {})).get("pipeline_parallel_size", 1) for e in cfg.layouts.values())
    if cfg.ladder.step < 1 or cfg.ladder.first < stages:
        raise ValueError(f"`ladder.first={cfg.ladder.first}` must be at least the largest pipeline size ({stages}: "
                         f"every stage needs a block) and `ladder.step={cfg.ladder.step}` at least 1.")
    return n_layers


def predictions(cfg, n_layers: list[int]) -> tuple[dict[int, int], dict[str, list[int]]]:
    """Parameters per rung, and per layout the advisor's bytes on its busiest rank per rung."""
    m = cfg.model
    probe = gpt_profile(dict(m), cfg.precision, sequences=1, n_layer=2)
    profiles = {n: scaled_profile(probe, m.vocab_size, n, m.n_embd, m.n_head, m.vocab_size, m.block_size)
                for n in n_layers}
    tiny = gpt_profile(dict(m), cfg.precision, **cfg.tiny)  # the baseline fit the measurement subtracts
    predicted = {}
    for name, entry in cfg.layouts.items():
        layout = layout_for(entry.kind, dict(entry.get("args", {})), entry.devices)
        global_batch = cfg.batch_size * layout.data_parallel_size
        predicted[name] = [net_bytes(profiles[n], tiny, layout, global_batch, cfg.precision) for n in n_layers]
    return {n: p.total_params for n, p in profiles.items()}, predicted


def _largest_within(values: list[int], budget: int) -> int | None:
    return max((i for i, v in enumerate(values) if v <= budget), default=None)


def measure(cfg, out_dir: Path, n_layers: list[int], predicted: dict[str, list[int]], budget: int) -> dict:
    """Run the measuring job (a fresh interpreter) over every layout; its results by layout."""
    layouts = []
    for name, entry in cfg.layouts.items():
        start = _largest_within(predicted[name], budget)
        layouts.append({"name": name, "kind": entry.kind, "devices": entry.devices,
                        "args": dict(entry.get("args", {})), "predicted": predicted[name],
                        "start": 0 if start is None else start})
    spec = {"accelerator": cfg.trainer.accelerator, "precision": cfg.precision, "steps": cfg.steps,
            "batch_size": cfg.batch_size, "timeout_s": cfg.timeout_s, "budget": budget, "n_layers": n_layers,
            "model": dict(cfg.model), "tiny": dict(cfg.tiny), "layouts": layouts}
    return run_job(spec, out_dir)


def run_job(spec: dict, out_dir: Path, name: str = "measured") -> dict:
    """Write ``spec`` and run :mod:`~lightning_par.recipes._capacity_job` on it in a fresh interpreter; its results."""
    spec_path, out_path = out_dir / f"{name}-spec.json", out_dir / f"{name}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    root = str(Path(__file__).resolve().parents[2])
    # [Note: a fixed mmap threshold] glibc raises its mmap threshold after large frees, after which freed buffers
    # stay resident as heap slack that depends on each process's history; a fixed threshold hands them back (the
    # tensors' bytes are unchanged), so a rank's resident peak follows what it holds
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", str(128 << 10)),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    log = out_dir / f"{name}.log"
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "lightning_par.recipes._capacity_job", str(spec_path),
                               str(out_path)], env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"the measuring job failed (exit {code}); its last lines:\n"
                           + "\n".join(log.read_text().splitlines()[-30:]))
    return json.loads(out_path.read_text())


def run(cfg, out_dir: Path, command: str) -> Report:
    t0 = time.perf_counter()
    budget = int(cfg.budget_gb * GiB)
    n_layers, params, layouts = ladder(cfg), {}, {}
    if not cfg.get("sweeps_only"):
        params, predicted = predictions(cfg, n_layers)
        layouts = _ladder_results(cfg, out_dir, n_layers, params, predicted, budget)
    data = {"budget_gb": cfg.budget_gb, "budget_bytes": budget, "accelerator": cfg.trainer.accelerator,
            "ladder": n_layers, "params": params, "model": dict(cfg.model), "batch_size": cfg.batch_size,
            "steps": cfg.steps, "layouts": layouts}
    if cfg.get("sweeps"):
        from lightning_par.recipes.capacity_sweeps import run_sweeps

        data["sweeps"] = run_sweeps(cfg, out_dir, budget)
    data["wall_s"] = time.perf_counter() - t0
    report = _report(cfg, command, out_dir, data)
    if data.get("sweeps"):
        from lightning_par.recipes.capacity_sweeps import report_sweeps

        report_sweeps(report, data["sweeps"], budget, out_dir)
    return report


def _ladder_results(cfg, out_dir: Path, n_layers: list[int], params: dict, predicted: dict, budget: int) -> dict:
    """The n_layer ladder measured for every layout, beside the advisor's answer."""
    measured = measure(cfg, out_dir, n_layers, predicted, budget)
    layouts = {}
    for name, entry in cfg.layouts.items():
        res = measured[name]
        best = res["largest"]
        pred = _largest_within(predicted[name], budget)
        layouts[name] = {
            "kind": entry.kind, "devices": entry.devices, "largest_measured": best,
            "largest_measured_params": params[best] if best is not None else None,
            "predicted_largest": n_layers[pred] if pred is not None else None,
            "predicted_largest_params": params[n_layers[pred]] if pred is not None else None,
            "peak_at_largest": res["runs"][str(best)]["model_net"] if best is not None else None,
            "predicted_bytes": dict(zip(n_layers, predicted[name])),
            "measured": res["runs"], "baseline": res["baseline"]}
    return layouts


def _report(cfg, command: str, out_dir: Path, data: dict) -> Report:
    m, budget, layouts = cfg.model, data["budget_bytes"], data["layouts"]
    one = next((v["largest_measured_params"] for v in layouts.values() if v["kind"] == "single"), None)
    report = Report(
        title=f"capacity: the largest GPT that trains within {budget / MiB:.0f} MiB per device",
        command=command,
        published=("the seeds: model parallelism splits the model across devices and so “支持更大规模模型的训练” "
                   "(trains larger models than one device holds), while data parallelism keeps a whole copy "
                   "on every device; ZeRO-3 shards the model states over the replicas (Rajbhandari et al., "
                   "SC 2020); pipeline and tensor parallelism split the layers and the matrices (GPipe, "
                   "Huang et al. 2019; Megatron-LM, Shoeybi et al. 2019)"),
        data=data,
    )
    if layouts:
        _ladder_table(report, layouts, m, budget, one, out_dir)
    else:
        report.notes.append("`sweeps_only=true`: the n_layer ladder was not run, only the sweeps below.")
    cpu = cfg.trainer.accelerator == "cpu"
    report.notes.append(
        "What the budget bounds: " + ("a rank's peak resident memory (VmHWM, restarted by clear_refs) from the "
                                      "point before the strategy gives the meta-built model its memory" if cpu else
                                      "torch.cuda.max_memory_allocated of each rank's device from the point "
                                      "before the strategy gives the meta-built model its memory, with "
                                      "set_per_process_memory_fraction holding the allocator to the budget (an "
                                      "OOM counts as over budget)")
        + " to the end of training, minus the same from the same layout's fit of a tiny GPT "
        f"({cfg.tiny.n_layer} × {cfg.tiny.n_embd}): the memory the model itself adds. The advisor predicts that "
        "quantity: parameters, gradients, AdamW state, activations (and ZeRO-3's gathered block).")
    report.notes.append(f"Every fit: {cfg.steps} AdamW steps of {cfg.batch_size} sequences × {m.block_size} tokens "
                        f"per replica ({cfg.precision}), vocabulary {m.vocab_size}, {m.n_head} heads, tied "
                        "embedding; layouts built on the meta device, each rank materializing its share.")
    report.notes.append("Measured above predicted: allocator slack, the optimizer's and the collectives' "
                        "temporaries and (TP) the setup check's transient region are not in the advisor's model; "
                        "under a pipeline the previous step's gradients also stay alive through the next step's "
                        "schedule (it runs inside training_step; Lightning zeroes them after it): one gradient copy "
                        "more than the advisor counts (recipes/capacity/README.md).")
    return report


def _ladder_table(report: Report, layouts: dict, m, budget: int, one, out_dir: Path) -> None:
    """The n_layer ladder's table and plots."""
    rows = []
    for name, v in layouts.items():
        best, pred = v["largest_measured"], v["predicted_largest"]
        tried = ", ".join(f"{n}{'' if r['fits'] else '✗'}" for n, r in v["measured"].items())
        rows.append([name, v["devices"],
                     "none" if best is None else f"{best} ({v['largest_measured_params'] / 1e6:.2f} M)",
                     "none" if pred is None else f"{pred} ({v['predicted_largest_params'] / 1e6:.2f} M)",
                     "-" if best is None else f"{v['peak_at_largest'] / MiB:.1f} / {budget / MiB:.0f}",
                     "-" if best is None else f"{v['peak_at_largest'] / v['predicted_bytes'][best]:.2f}",
                     "-" if best is None or not one else f"{v['largest_measured_params'] / one:.2f}", tried])
    report.tables.append((f"Largest GPT (n_layer at width {m.n_embd}, parameters) within the budget, measured and "
                          "predicted",
                          ["layout", "devices", "largest measured", "advisor's largest",
                           "busiest rank's model peak / budget (MiB)", "measured / advisor there",
                           "params vs one device",
                           "rungs measured (✗: over budget)"], rows))
    report.figures.append(("Largest model within the budget per layout: measured and predicted",
                           savefig(_bars(layouts), out_dir, "capacity.png")))
    report.figures.append(("Busiest rank's memory per rung: measured (points) and the advisor (lines)",
                           savefig(_curves(layouts, budget), out_dir, "peaks.png")))


def _bars(layouts: dict):
    fig, ax = figure(1.4 * len(layouts) + 2, 4)
    names = list(layouts)
    for j, (key, label, color) in enumerate((("largest_measured_params", "measured", "#4a7fb5"),
                                             ("predicted_largest_params", "advisor", "#e0a03a"))):
        values = [(layouts[n][key] or 0) / 1e6 for n in names]
        ax.bar([i + (j - 0.5) * 0.38 for i in range(len(names))], values, 0.36, color=color, label=label)
        rungs = "largest_measured" if j == 0 else "predicted_largest"
        for i, n in enumerate(names):
            ax.text(i + (j - 0.5) * 0.38, values[i], f"{layouts[n][rungs]}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [f"{n}\n({layouts[n]['devices']} dev.)" for n in names])
    ax.set_ylabel("parameters (M); n_layer on the bars")
    ax.legend()
    return fig


def _curves(layouts: dict, budget: int):
    fig, ax = figure(7, 4.5)
    for i, (name, v) in enumerate(layouts.items()):
        color = f"C{i}"
        rungs = sorted(int(n) for n in v["predicted_bytes"])
        ax.plot(rungs, [v["predicted_bytes"][n] / MiB for n in rungs], color=color, lw=1, label=f"{name}")
        pts = [(int(n), r["model_net"] / MiB) for n, r in v["measured"].items() if r["model_net"] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color)
    ax.axhline(budget / MiB, color="grey", ls="--", lw=1, label="budget")
    ax.set_ylim(0, 2.2 * budget / MiB)
    ax.set_xlabel("n_layer")
    ax.set_ylabel("MiB on the busiest rank (net of the tiny-model fit)")
    ax.legend(fontsize=8)
    return fig
