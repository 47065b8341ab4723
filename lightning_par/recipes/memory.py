"""memory: per-device memory of DP, ZeRO-1, PP and TP, measured against the advisor (recipes/memory/README.md)."""
from __future__ import annotations

from pathlib import Path

from lightning_par.advisor import korthikanti_bytes_per_layer
from lightning_par.recipes.common import figure, Report, savefig
from lightning_par.recipes.layouts import measure_layouts

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
                                                      pred.activation_bytes)))
        rows.append([m.name, *(f"{measured[k] / KiB:.0f} / {predicted[k] / KiB:.0f}" for k, _ in FIELDS),
                     f"{total / KiB:.0f}", f"{pred.total_bytes / KiB:.0f}", f"{pred.total_bytes / total:.3f}"])
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
    return report


def _plot(results):
    fig, ax = figure(1.3 * len(results) + 2, 4)
    colors = ["#4a7fb5", "#9fc5e8", "#e0a03a", "#c0504d"]
    for i, m in enumerate(results):
        pred = m.predicted
        predicted = (pred.param_bytes, pred.grad_bytes, pred.optimizer_bytes, pred.activation_bytes)
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
