"""The capacity recipe's other axes: under the same per-device budget, the longest sequence that trains (a fixed
model) and the largest model at a long sequence, on one device and under each layout, with activation
checkpointing off and full (``sweeps:`` in recipes/capacity/config.yaml); and the longest sequence under context
parallelism (the ``context`` sweep: one device, cp 2, cp 4 and cp 2 with full checkpointing).

Each (layout, mode) is one search of the measuring job (:func:`~lightning_par.recipes._capacity_job.run_layout`:
fits in fresh processes, the busiest rank's peak net of the layout's tiny-model fit checked against the budget),
started where the advisor's prediction reaches the budget; the advisor's bytes per rung stand beside it.

- ``axis: block_size``: the ladder is the sequence length; the advisor probes a 2-block GPT at each length (the
  activations of fused attention grow linearly with it, the logits too) and scales it to ``n_layer`` blocks.
- ``axis: n_layer``: the ladder is the depth at ``model.block_size``; one probe scaled to every rung.

A sweep's ``layouts`` is a list of names (each measured at every one of the sweep's ``modes``) or a mapping of
names to their own modes; a name is one of the recipe's ``layouts`` or of the sweep's own ``define`` (layouts that
only this sweep measures, as the cp ones). ``batch_size``, ``steps`` and ``budget_gb`` in a sweep replace the
recipe's for it.
"""
from __future__ import annotations

from pathlib import Path

from lightning_par.recipes.common import Report, figure, savefig
from lightning_par.recipes.decision import scaled_profile
from lightning_par.recipes.layouts import gpt_profile, layout_for, net_bytes

MiB = 1024**2


def mode_name(mode) -> str:
    return "off" if mode is None else (mode if isinstance(mode, str) else f"every {mode}")


def sweep_layouts(cfg, sweep) -> list[tuple[str, object, list]]:
    """``(name, entry, modes)`` of every layout ``sweep`` measures (see the module docstring)."""
    define = sweep.get("define") or {}
    named = sweep.layouts
    items = named.items() if hasattr(named, "items") else [(n, sweep.modes) for n in named]
    out = []
    for name, modes in items:
        entry = define.get(name) if name in define else cfg.layouts.get(name)
        if entry is None:
            raise ValueError(f"sweep layout `{name}` is neither one of the recipe's layouts ({sorted(cfg.layouts)}) "
                             f"nor in the sweep's `define` ({sorted(define)}).")
        out.append((name, entry, list(modes)))
    return out


def sweep_batch(cfg, sweep) -> int:
    return sweep.get("batch_size") or cfg.batch_size


def sweep_predictions(cfg, sweep) -> tuple[dict[int, object], dict[str, dict[str, list[int]]]]:
    """The profile of every rung of ``sweep`` and, per layout and mode, the advisor's busiest rank per rung."""
    m, rungs = dict(sweep.model), list(sweep.ladder)
    if sweep.axis == "block_size":
        probes = {s: gpt_profile(m, cfg.precision, 1, n_layer=2, block_size=s) for s in rungs}  # 2 blocks a length
        profiles = {s: scaled_profile(probes[s], m["vocab_size"], m["n_layer"], m["n_embd"], m["n_head"],
                                      m["vocab_size"], s) for s in rungs}
    elif sweep.axis == "n_layer":
        probe = gpt_profile(m, cfg.precision, 1, n_layer=2)
        profiles = {n: scaled_profile(probe, m["vocab_size"], n, m["n_embd"], m["n_head"], m["vocab_size"],
                                      m["block_size"]) for n in rungs}
    else:
        raise ValueError(f"`sweeps.*.axis={sweep.axis}` must be block_size (the sequence) or n_layer.")
    # the baseline fit the measurement subtracts, as run_sweeps builds it ([Note: a prediction net of the baseline
    # fit] in lightning_par/recipes/layouts.py)
    tiny = gpt_profile(m, cfg.precision, **sweep_tiny(cfg, sweep))
    predicted = {}
    for name, entry, modes in sweep_layouts(cfg, sweep):
        for mode in modes:
            layout = layout_for(entry.kind, {**dict(entry.get("args", {})), "activation_checkpointing": mode},
                                entry.devices)
            batch = sweep_batch(cfg, sweep) * layout.data_parallel_size
            predicted.setdefault(name, {})[mode_name(mode)] = [
                net_bytes(profiles[r], tiny, layout, batch, cfg.precision) for r in rungs]
    return profiles, predicted


def sweep_tiny(cfg, sweep) -> dict:
    """The sizes of a sweep's baseline fit over its model: the recipe's tiny GPT, at the sweep's shortest
    sequence when the sequence is the axis (the machinery's cost at the shortest sequence)."""
    tiny = dict(cfg.tiny)
    if sweep.axis == "block_size":
        tiny["block_size"] = list(sweep.ladder)[0]
    return tiny


def run_sweeps(cfg, out_dir: Path, budget: int) -> dict:
    """Every sweep of ``cfg.sweeps``, measured: per sweep, layout and mode the longest / largest rung within
    ``budget`` (or the sweep's own ``budget_gb``), the advisor's, and every rung measured."""
    from lightning_par.recipes.capacity import GiB, _largest_within, run_job

    results, recipe_budget = {}, budget
    for sweep_name, sweep in cfg.sweeps.items():
        if sweep is None:  # `sweeps.NAME=null` on the command line: that sweep is left out
            continue
        budget = int(sweep.budget_gb * GiB) if sweep.get("budget_gb") else recipe_budget
        profiles, predicted = sweep_predictions(cfg, sweep)
        rungs = list(sweep.ladder)
        tiny = sweep_tiny(cfg, sweep)
        jobs, meta = [], {}
        for name, entry, modes in sweep_layouts(cfg, sweep):
            for mode in modes:
                pred = predicted[name][mode_name(mode)]
                start = _largest_within(pred, budget)
                job = f"{sweep_name}-{name}-{mode_name(mode).replace(' ', '')}"
                meta[job] = (name, mode_name(mode))
                jobs.append({"name": job, "kind": entry.kind,
                             "devices": entry.devices,
                             "args": {**dict(entry.get("args", {})), "activation_checkpointing": mode},
                             "predicted": pred, "start": 0 if start is None else start, "axis": sweep.axis,
                             "ladder": rungs, "model": dict(sweep.model), "tiny": tiny})
        spec = {"accelerator": cfg.trainer.accelerator, "precision": cfg.precision,
                "steps": sweep.get("steps") or cfg.steps, "batch_size": sweep_batch(cfg, sweep),
                "timeout_s": cfg.timeout_s, "budget": budget, "n_layers": rungs,
                "model": dict(sweep.model), "tiny": dict(cfg.tiny), "layouts": jobs}
        measured = run_job(spec, out_dir, f"sweep-{sweep_name}")
        out = {"axis": sweep.axis, "ladder": rungs, "model": dict(sweep.model), "layouts": {},
               "batch_size": spec["batch_size"], "steps": spec["steps"], "budget_bytes": budget,
               "params": {r: p.total_params for r, p in profiles.items()}}
        for job in jobs:
            res = measured[job["name"]]
            best, pred = res["largest"], _largest_within(job["predicted"], budget)
            out["layouts"][job["name"]] = {
                "layout": meta[job["name"]][0], "mode": meta[job["name"]][1],
                "devices": job["devices"], "largest_measured": best,
                "predicted_largest": rungs[pred] if pred is not None else None,
                "peak_at_largest": res["runs"][str(best)]["model_net"] if best is not None else None,
                "predicted_bytes": dict(zip(rungs, job["predicted"])), "measured": res["runs"],
                "baseline": res["baseline"]}
        results[sweep_name] = out
    return results


def report_sweeps(report: Report, sweeps: dict, budget: int, out_dir: Path) -> None:
    """A table and a plot per sweep."""
    recipe_budget = budget
    for sweep_name, sw in sweeps.items():
        budget = sw.get("budget_bytes", recipe_budget)
        what = "longest sequence (block_size)" if sw["axis"] == "block_size" else (
            f"largest n_layer at {sw['model'].get('block_size')} tokens")
        rows = []
        for v in sw["layouts"].values():
            best, pred = v["largest_measured"], v["predicted_largest"]
            rows.append([v["layout"], v["mode"], v["devices"], "none" if best is None else best,
                         "none" if pred is None else pred,
                         "-" if best is None else f"{v['peak_at_largest'] / MiB:.1f} / {budget / MiB:.0f}",
                         "-" if best is None else f"{v['predicted_bytes'][best] / MiB:.1f}",
                         "-" if best is None else f"{v['peak_at_largest'] / v['predicted_bytes'][best]:.2f}",
                         ", ".join(f"{n}{'' if r['fits'] else '✗'}" for n, r in v["measured"].items())])
        m = sw["model"]
        report.tables.append((f"Sweep `{sweep_name}`: the {what} within the budget, per layout and activation "
                              f"checkpointing mode (GPT width {m['n_embd']}" + (f", {m['n_layer']} blocks" if
                                                                              "n_layer" in m else "")
                              + f", {sw.get('batch_size', '?')} sequences per replica, {budget / MiB:.0f} MiB per "
                              "device)",
                              ["layout", "checkpointing", "devices", "measured", "advisor's", "model peak / budget "
                               "(MiB)", "advisor's MiB there", "measured / advisor there",
                               "rungs measured (✗: over budget)"], rows))
        report.figures.append((f"Sweep `{sweep_name}`: the {what}, measured (bars) and the advisor's (points)",
                               savefig(_bars(sw), out_dir, f"sweep-{sweep_name}.png")))


def _bars(sw: dict):
    items = list(sw["layouts"].values())
    fig, ax = figure(1.0 * len(items) + 2, 4)
    xs = range(len(items))
    ax.bar(xs, [v["largest_measured"] or 0 for v in items], 0.6,
           color=["#4a7fb5" if v["mode"] == "off" else "#e0a03a" for v in items])
    ax.plot(xs, [v["predicted_largest"] or 0 for v in items], "k_", markersize=18, label="advisor")
    ax.set_xticks(xs, [f"{v['layout']}\nAC {v['mode']}" for v in items], fontsize=7)
    ax.set_ylabel(sw["axis"])
    ax.legend()
    return fig
