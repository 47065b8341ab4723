"""memory: per-device memory of DP, ZeRO-1, PP and TP, measured against the advisor (recipes/memory/README.md);
and activation memory per activation checkpointing mode (off, full, every k-th, selective) on single, DP2, PP2 and
TP2, measured as separate processes' peak memory net of the layout's tiny-model fit, beside the advisor."""
from __future__ import annotations

from pathlib import Path

from lightning_par.advisor import korthikanti_bytes_per_layer
from lightning_par.recipes.common import figure, Report, savefig
from lightning_par.recipes.layouts import gpt_profile, layout_for, measure_layouts, net_estimates

FIELDS = (("param_bytes", "params"), ("grad_bytes", "grads"), ("optimizer_bytes", "optim"),
          ("activation_bytes", "activ"))
KiB = 1024


def run(cfg, out_dir: Path, command: str) -> Report:
    results = measure_layouts(cfg, out_dir)
    single = next((m for m in results if m.layout.devices == 1), results[0])
    full_params = single.busiest("param_bytes")
    rows, seeds, data = [], [], {}
    for m in results:
        measured = {key: m.busiest(key) for key, _ in FIELDS}
        total = max(sum(r.get(k, 0) for k, _ in FIELDS) for r in m.rows)
        pred = m.predicted
        predicted = dict(zip([k for k, _ in FIELDS], (pred.param_bytes, pred.grad_bytes, pred.optimizer_bytes,
                                                      saved_activations(pred))))
        counted = sum(predicted.values())  # the same four terms as measured (no stage runtime, no backward's own)
        rows.append([m.name, *(f"{measured[k] / KiB:.0f} / {predicted[k] / KiB:.0f}" for k, _ in FIELDS),
                     f"{total / KiB:.0f}", f"{counted / KiB:.0f}", f"{counted / total:.3f}"])
        share = measured["param_bytes"] / full_params
        seeds.append([m.name, "每张GPU保存完整模型 (full model on every device)" if share > 0.99 else
                      "每张GPU保存部分分片 (a shard on every device)", f"{share:.0%}",
                      f"{measured['optimizer_bytes'] / max(single.busiest('optimizer_bytes'), 1):.0%}"])
        data[m.name] = {"rows": m.rows, "predicted": pred.__dict__, "layout": m.layout.__dict__}
    report = Report(
        title="memory: per-device bytes of each layout, measured vs the advisor",
        command=command,
        published=("the seeds' comparison table: data parallel keeps the full model on every GPU, model parallel "
                   "a shard; ZeRO-1 keeps 1/N of the optimizer state (Rajbhandari et al., 2020); 1F1B holds at most "
                   "p micro-batches of activations where GPipe holds m (Narayanan et al., 2021)"),
        data=data,
    )
    report.tables.append(("Busiest rank, measured / predicted KiB", ["layout", *(t for _, t in FIELDS),
                                                                     "measured total", "predicted total",
                                                                     "predicted / measured"], rows))
    report.tables.append(("The seeds' table with numbers (share of one device's parameters / optimizer state "
                          "held per device)", ["layout", "what each device holds", "params", "optimizer state"],
                          seeds))
    prof = results[0].profile
    s, h, a, elem = prof.seq_len, prof.hidden_size, prof.num_heads or 1, prof.dtype_bytes
    measured_block = prof.block_activation_bytes[0]
    full = korthikanti_bytes_per_layer(s, 1, h, a) * elem / 2
    no_score = s * h * 34 * elem / 2
    report.tables.append((f"Activations of one block per sample ({elem}-byte elements), probe vs Korthikanti et al. "
                          "(2022) sbh(34 + 5as/h), scaled from 16-bit to this element size",
                          ["measured (probe)", "formula", "formula without the 5as/h score term", "measured / formula",
                           "measured / formula without score term"],
                          [[measured_block, f"{full:.0f}", f"{no_score:.0f}", f"{measured_block / full:.3f}",
                            f"{measured_block / no_score:.3f}"]]))
    report.figures.append(("Per-device memory, measured (left bar) and predicted (right bar)",
                           savefig(_plot(results), out_dir, "memory.png")))
    report.notes.append("The fused CPU/CUDA attention kernels save no s × s score matrix, so the 5as/h term of the "
                        "formula has no counterpart here; layer norms run in fp32 under autocast.")
    report.notes.append("Activations: the most bytes saved for backward alive at once on the busiest rank "
                        "(ParallelMetrics); predicted: the advisor's probe × micro-batch × micro-batches in flight.")
    if cfg.get("checkpointing") is not None:
        _checkpointing_section(report, cfg, out_dir)
    return report


def saved_activations(pred) -> int:
    """The advisor's activations at the forward's end, what ``ParallelMetrics`` measures (the tensors saved for
    backward): without what backward adds beside them."""
    return pred.activation_bytes - pred.backward_bytes


def mode_name(mode) -> str:
    return "off" if mode is None else (mode if isinstance(mode, str) else f"every {mode}")


# [Note: a baseline per checkpointing mode]
# A fit's net is its busiest rank's peak less the same layout's tiny-model fit, which cancels what the machinery
# costs whatever the model. Under checkpointing the machinery grows: a fit with it runs code a fit without it never
# touches (non-reentrant checkpoint's saved-tensor hooks and recompute in backward, selective's dispatch mode and
# policy): the tiny fit alone measured up to 6 MiB more under checkpointing than without (one device: full -0.2,
# every 2nd +1.8, selective +5.2 MiB; PP2 +3.6 / +3.6 / +6.0; TP2 +2.7 / +3.7 / +4.8), beyond the tensors (the
# profiler's tensor meter does not see it; which allocation it is was not pinned down: not glibc's mmap threshold,
# not MKL's buffers), which a tiny baseline without checkpointing left in the model's net. So each mode is
# measured net of the tiny fit under the same mode, and predicted net of the advisor's estimate of that tiny fit
# under the same mode (its own blocks' small recompute cancels too).
def checkpointing_predictions(cfg) -> dict[str, dict[str, dict]]:
    """Per layout and mode, the advisor's busiest rank for ``cfg.checkpointing``, net of its estimate of the same
    layout's tiny-model fit under the same mode (what the measurement subtracts, [Note: a baseline per
    checkpointing mode]): one probe of each model."""
    ac = cfg.checkpointing
    profile, tiny = gpt_profile(dict(ac.model), cfg.precision), gpt_profile(dict(ac.model), cfg.precision, **ac.tiny)
    out = {}
    for name, entry in ac.layouts.items():
        args = dict(entry.get("args", {}))
        base_layout = layout_for(entry.kind, args, entry.devices)
        batch = ac.batch_size * base_layout.data_parallel_size
        out[name] = {}
        for mode in entry.get("modes", ac.modes):  # a layout may measure fewer modes
            layout = layout_for(entry.kind, {**args, "activation_checkpointing": mode}, entry.devices)
            # the tiny fit under the same mode, rank by rank ([Note: a prediction net of the baseline fit])
            est, base = net_estimates(profile, tiny, layout, batch, cfg.precision)
            states = est.total_bytes - est.activation_bytes - (base.total_bytes - base.activation_bytes)
            out[name][mode_name(mode)] = {"total": est.total_bytes - base.total_bytes, "states": states,
                                          "activations": est.activation_bytes - base.activation_bytes,
                                          "gross": est.total_bytes, "tiny": base.total_bytes}
    return out


def _checkpointing_section(report: Report, cfg, out_dir: Path) -> None:
    from lightning_par.recipes.capacity import run_job

    ac = cfg.checkpointing
    predicted = checkpointing_predictions(cfg)
    layouts = [{"name": f"ac-{name}", "kind": entry.kind, "devices": entry.devices,
                "args": dict(entry.get("args", {})),
                "fits": {mode_name(mode): {"args": {"activation_checkpointing": mode}}
                         for mode in entry.get("modes", ac.modes)}}
               for name, entry in ac.layouts.items()]
    # the strategy takes the mode; the one-device fit applies it to the module itself, as the strategies do
    spec = {"fits": True, "accelerator": cfg.trainer.accelerator, "precision": cfg.precision, "steps": ac.steps,
            "batch_size": ac.batch_size, "timeout_s": ac.timeout_s, "model": dict(ac.model), "tiny": dict(ac.tiny),
            "layouts": layouts, "baseline_per_fit": True}  # [Note: a baseline per checkpointing mode]
    measured = run_job(spec, out_dir, "checkpointing")
    rows, data = [], {}
    for name in ac.layouts:
        off_net = None
        for mode in map(mode_name, ac.layouts[name].get("modes", ac.modes)):
            res = measured[f"ac-{name}"]
            net = res["runs"][mode]["model_net"]
            pred = predicted[name][mode]
            acts = net - pred["states"]  # measured activations: the peak less the model states the advisor counts
            off_net = acts if mode == "off" else off_net
            rows.append([name, mode, f"{acts / KiB:.0f}", f"{pred['activations'] / KiB:.0f}", f"{net / KiB:.0f}",
                         f"{pred['total'] / KiB:.0f}", f"{pred['total'] / net:.3f}",
                         "-" if not off_net else f"{acts / off_net:.2f}"])
            run = res["runs"][mode]
            data.setdefault(name, {})[mode] = {"measured_net": net, "predicted": pred, "ranks": run["ranks"],
                                               "baseline": run["baseline"]}
    m = ac.model
    report.data["checkpointing"] = data
    report.tables.append((f"Activation checkpointing: busiest rank's peak KiB, GPT {m.n_layer} × {m.n_embd} wide at "
                          f"{m.block_size} tokens, {ac.batch_size} sequences per replica, measured (separate "
                          "processes' peak net of the layout's tiny-model fit) / predicted",
                          ["layout", "mode", "activations measured", "activations predicted", "peak measured",
                           "peak predicted", "predicted / measured", "activations vs off"], rows))
    report.figures.append(("Activation memory per checkpointing mode: measured (bars) and predicted (points)",
                           savefig(_ac_plot(data), out_dir, "checkpointing.png")))
    report.notes.append("Activation checkpointing: both sides are net of the layout's tiny-model fit (measured: its "
                        "peak; predicted: the advisor's estimate of it), which also holds the logits of the same "
                        "vocabulary and sequence; measured activations are the measured peak less the model states "
                        "the advisor counts (weights, gradients, AdamW moments); the peak itself is compared whole. "
                        "What the advisor assumes is in [Note: activations under activation checkpointing] "
                        "(lightning_par/advisor/memory.py).")


def _ac_plot(data):
    fig, ax = figure(2.2 * len(data) + 2, 4)
    modes = list(dict.fromkeys(mode for d in data.values() for mode in d))  # a layout may measure fewer
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        cells = [(i, d[mode]) for i, d in enumerate(data.values()) if mode in d]
        xs = [i + (j - (len(modes) - 1) / 2) * width for i, _ in cells]
        meas = [(c["measured_net"] - c["predicted"]["states"]) / KiB for _, c in cells]
        pred = [c["predicted"]["activations"] / KiB for _, c in cells]
        ax.bar(xs, meas, width * 0.9, label=mode)
        ax.plot(xs, pred, "k.", markersize=9, label="predicted" if j == 0 else None)
    ax.set_xticks(range(len(data)), list(data))
    ax.set_ylabel("activation KiB (busiest rank)")
    ax.legend()
    return fig


def _plot(results):
    fig, ax = figure(1.3 * len(results) + 2, 4)
    colors = ["#4a7fb5", "#9fc5e8", "#e0a03a", "#c0504d"]
    for i, m in enumerate(results):
        pred = m.predicted
        predicted = (pred.param_bytes, pred.grad_bytes, pred.optimizer_bytes, saved_activations(pred))
        for j, values in enumerate(([m.busiest(k) for k, _ in FIELDS], predicted)):
            bottom = 0.0
            for c, (v, (_, title)) in enumerate(zip(values, FIELDS)):
                ax.bar(i + (j - 0.5) * 0.38, v / KiB, 0.36, bottom=bottom, color=colors[c],
                       label=title if i == 0 and j == 0 else None, alpha=1.0 if j == 0 else 0.55)
                bottom += v / KiB
    ax.set_xticks(range(len(results)), [m.name for m in results], rotation=20)
    ax.set_ylabel("KiB per device (busiest rank)")
    ax.legend()
    return fig
