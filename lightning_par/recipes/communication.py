"""communication: bytes per step per strategy against the formulas (recipes/communication/README.md)."""
from __future__ import annotations

from pathlib import Path

from lightning_par.recipes.common import figure, Report, savefig
from lightning_par.recipes.layouts import measure_layouts


def run(cfg, out_dir: Path, command: str) -> Report:
    results = measure_layouts(cfg, out_dir)
    rows, data = [], {}
    for m in results:
        measured = m.busiest("comm_bytes")
        predicted = m.predicted.comm_bytes  # a 16-bit comm_hook's gradients in 2 bytes (the advisor's Layout)
        kinds = {}
        for r in m.rows:
            for k, v in r.get("comm_bytes_by_kind", {}).items():
                kinds[k] = max(kinds.get(k, 0.0), v)
        gathers = max(sum(v for k, v in r.get("comm_calls_by_kind", {}).items() if k.startswith("all_gather"))
                      for r in m.rows)
        rows.append([m.name, f"{measured:,.0f}", f"{predicted:,.0f}",
                     f"{measured / predicted:.3f}" if predicted else "-",
                     f"{gathers} / {m.predicted.all_gathers}" if m.predicted.all_gathers else "-",
                     ", ".join(f"{k} {v:,.0f}" for k, v in sorted(kinds.items()))])
        data[m.name] = {"measured": measured, "predicted": predicted, "by_kind": kinds, "all_gathers": gathers,
                        "all_gathers_formula": m.predicted.all_gathers}
    report = Report(
        title="communication: bytes per step per strategy vs the formulas",
        command=command,
        published=("ring all-reduce 2(N−1)/N × gradient bytes (Patarasuk & Yuan, 2009); pipeline boundary b·s·h per "
                   "micro-batch each way (GPipe, 2019); Megatron TP 4 all-reduces of b·s·h per layer per micro-batch "
                   "(Shoeybi et al., 2019)"),
        data=data,
    )
    report.tables.append(("Bytes sent per step by the busiest rank: measured vs formula",
                          ["layout", "measured", "formula", "measured / formula",
                           "FSDP all-gathers / step (busiest stage): measured / formula", "by op kind (measured)"],
                          rows))
    report.figures.append(("Measured (left) and formula (right) bytes per step",
                           savefig(_plot(data), out_dir, "communication.png")))
    report.notes.append("Measured includes Lightning's own small control messages (a few hundred bytes); "
                        "ZeRO-1's formula counts the shard broadcast as (N−1)/N of the parameters.")
    return report


def _plot(data):
    names = list(data)
    fig, ax = figure(1.3 * len(names) + 2, 4)
    ax.bar([i - 0.2 for i in range(len(names))], [data[n]["measured"] / 1024 for n in names], 0.38, label="measured")
    ax.bar([i + 0.2 for i in range(len(names))], [data[n]["predicted"] / 1024 for n in names], 0.38, label="formula")
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("KiB sent per step (busiest rank)")
    ax.legend()
    return fig
