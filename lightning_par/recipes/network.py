"""network: DP, PP and TP across two nodes joined by a shaped link (recipes/network/README.md).

The two nodes are network namespaces on this machine joined by a veth pair
(:mod:`lightning_par.recipes.netns`), one rank each, launched by ``torchrun --nnodes 2 --rdzv-backend c10d``.
One launch runs every rate × layout (:mod:`lightning_par.recipes._node_job`): each rank shapes its own
veth end with tc's tbf before a rate's fits. A one-device run of the same model and global batches is the
reference every layout's losses are checked against.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from lightning_par.recipes._node_job import UNSHAPED, case_dir, load_records
from lightning_par.recipes.common import figure, Report, savefig
from lightning_par.recipes.netns import TwoNodeLink, qdisc_drops, rate_bits_per_s

NAMES = {"dp": "DP (2 replicas)", "pp": "PP (2 stages)", "tp": "TP (2 shards)"}
TIMED_FROM = 2  # step 0 warms up, step 1 is counted by lightning_par.comm (slow); steps 2.. are timed


def job_args(cfg, out: Path, layouts: list[str], rates: list[str] | None = None) -> list[str]:
    args = ["-m", "lightning_par.recipes._node_job", "--layouts", ",".join(layouts), "--out", str(out),
            "--steps", str(cfg.steps), "--global-batch", str(cfg.global_batch), "--microbatches",
            str(cfg.microbatches), "--model", json.dumps(dict(cfg.model)), "--timeout", str(cfg.timeout_s)]
    if rates is not None:
        args += ["--rates", ",".join(rates), "--delay-ms", str(cfg.delay_ms), "--measure-comm"]
    return args


def global_losses(records: list[dict], layout: str) -> list[float]:
    """The global batch's loss per step: the mean over data-parallel replicas' (equal) shares; under PP and
    TP every rank returns the true loss (rank 0's is taken)."""
    if layout == "dp":
        return [sum(step) / len(step) for step in zip(*(r["losses"] for r in records))]
    return records[0]["losses"]


def summarize(case: Path, layout: str, ref_losses: list[float]) -> dict:
    records = load_records(case)
    timed = range(TIMED_FROM, len(records[0]["step_s"]))
    # a step ends when its slowest rank ends; the median over timed steps resists one-off stalls
    step_s = statistics.median(max(r["step_s"][i] for r in records) for i in timed)
    tx = [statistics.median(r["tx_bytes"][i] for i in timed) for r in records]
    metrics = json.loads((case / "metrics.json").read_text())
    qdiscs = [json.loads((case / f"qdisc{r['rank']}.json").read_text()) for r in records]
    losses = global_losses(records, layout)
    return {
        "step_s": step_s,
        "link_bytes_per_step": max(tx),                # the busiest node's veth end, sent
        "link_bytes_per_step_per_node": tx,
        "counted_bytes_per_step": max(m["comm_bytes"] for m in metrics),  # lightning_par.comm, wire bytes sent
        "drops": sum(qdisc_drops(q["after"]) - qdisc_drops(q["before"]) for q in qdiscs),
        "qdisc": qdiscs[0]["shaped"]["qdisc"],
        "delay_applied": qdiscs[0]["shaped"]["delay_applied"],
        "max_loss_diff_vs_one_device": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "nodes": sorted({r["netns"] for r in records}),
    }


def run(cfg, out_dir: Path, command: str) -> Report:
    layouts, rates = list(cfg.layouts), list(cfg.rates)
    for rate in rates:  # settings fail here, before anything starts
        if rate != UNSHAPED:
            rate_bits_per_s(rate)
    if not layouts or set(layouts) - set(NAMES):
        raise ValueError(f"`layouts={layouts}` must be a non-empty list of {sorted(NAMES)}.")
    if cfg.steps <= TIMED_FROM:
        raise ValueError(f"`steps={cfg.steps}` must be at least {TIMED_FROM + 1}: step 0 warms up, step 1 is counted "
                         f"by lightning_par.comm, steps {TIMED_FROM}.. are timed.")
    with TwoNodeLink() as link:  # first: without root it refuses at once, naming the reason
        # 1. the one-device reference, in this process's own namespace (no link)
        subprocess.run([sys.executable, *job_args(cfg, out_dir, ["single"])], check=True, timeout=cfg.timeout_s,
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        # 2. two nodes, every rate × layout in one launch
        link.torchrun(job_args(cfg, out_dir, layouts, rates), log_dir=out_dir / "logs", timeout=cfg.timeout_s)
        nodes = [f"{n.namespace} ({n.addr}, {n.ifname})" for n in link.nodes]
    ref = load_records(case_dir(out_dir, "single"))[0]
    res = {layout: {rate: summarize(case_dir(out_dir, layout, rate), layout, ref["losses"]) for rate in rates}
           for layout in layouts}
    return _report(cfg, command, out_dir, res, nodes, n_params=sum(p.numel() for p in ref["params"].values()))


def _report(cfg, command, out_dir, res, nodes, n_params) -> Report:
    layouts, rates = list(res), list(next(iter(res.values())))
    base = rates[0]
    data = {"results": res, "nodes": nodes, "parameters": n_params, "gradient_bytes": 4 * n_params,
            "rates": rates, "delay_requested_ms": cfg.delay_ms}
    report = Report(
        title="network: data, pipeline and tensor parallelism across a shaped link between two nodes",
        command=command,
        published=("the seeds: a slow link drags data parallelism down (“低带宽或高延迟网络会显著拖慢训练速度”) "
                   "and pipeline traffic is smaller than the model's full parameters (“对于按层切分的流水线并行，"
                   "通信数据量通常小于模型全量参数；对于张量级切分，通信量可能进一步上升”); ring all-reduce sends "
                   "2(N−1)/N × the gradient bytes per rank per step (Patarasuk & Yuan, 2009)"),
        data=data,
    )
    report.tables.append((
        f"Step time (s, median of steps {TIMED_FROM}..{cfg.steps - 1}, slowest rank) per link rate; × = vs {base}",
        ["layout", *rates, *(f"× at {r}" for r in rates[1:])],
        [[NAMES[lay], *(res[lay][r]["step_s"] for r in rates),
          *(f"{res[lay][r]['step_s'] / res[lay][base]['step_s']:.2f}" for r in rates[1:])] for lay in layouts]))
    rows = []
    for lay in layouts:
        r0 = res[lay][base]
        rows.append([NAMES[lay], f"{r0['link_bytes_per_step']:,.0f}", f"{r0['counted_bytes_per_step']:,.0f}",
                     f"{r0['link_bytes_per_step'] / r0['counted_bytes_per_step']:.3f}",
                     f"{r0['link_bytes_per_step'] / (4 * n_params):.3f}",
                     max(res[lay][r]["drops"] for r in rates)])
    report.tables.append((
        f"Bytes per step sent by the busiest node over the veth ({base}) vs lightning_par.comm's count "
        f"and the gradients ({4 * n_params:,} B = 4 B × {n_params:,} parameters)",
        ["layout", "link bytes (kernel counter)", "counted by lightning_par.comm", "link / counted",
         "link / gradient bytes", "tc drops (any rate)"], rows))
    report.tables.append((
        "Every layout against one device (same global batches): largest loss difference over all steps",
        ["layout", *rates],
        [[NAMES[lay], *(f"{res[lay][r]['max_loss_diff_vs_one_device']:.1e}" for r in rates)] for lay in layouts]))
    report.figures.append(("Step time per link rate", savefig(_plot_times(res, rates), out_dir, "step_time.png")))
    report.figures.append(("Bytes per step on the link", savefig(_plot_bytes(res, n_params), out_dir,
                                                                  "link_bytes.png")))
    report.notes += _notes(cfg, res, rates, nodes, n_params)
    return report


def _notes(cfg, res, rates, nodes, n_params) -> list[str]:
    base, slow = rates[0], rates[-1]
    step = {lay: (res[lay][base]["step_s"], res[lay][slow]["step_s"]) for lay in res}
    sent = {lay: res[lay][base]["link_bytes_per_step"] for lay in res}
    notes = [f"Nodes: network namespaces {nodes[0]} and {nodes[1]} joined by one veth pair; torchrun --nnodes 2 "
             "--nproc-per-node 1 --rdzv-backend c10d in each, gloo bound to the veth (GLOO_SOCKET_IFNAME)."]
    if "dp" in res and slow != base:
        wire = sent["dp"] * 8 / rate_bits_per_s(slow)
        notes.append(f"A slow link drags data parallelism down: DP's step takes {step['dp'][1] / step['dp'][0]:.1f}× "
                     f"as long at {slow} as on the {base} link ({step['dp'][1]:.3f} s vs {step['dp'][0]:.3f} s); "
                     f"at {slow} its gradients alone need {wire:.3f} s per step on the wire.")
    if "dp" in res and "pp" in res:
        notes.append(f"Pipeline traffic is smaller than the gradients: PP sends {sent['pp']:,.0f} B per step (the "
                     f"boundary activations forward and their gradients back), {sent['pp'] / sent['dp']:.1%} of "
                     f"DP's {sent['dp']:,.0f} B; its step grows {step['pp'][1] / step['pp'][0]:.1f}× at {slow}.")
    if "tp" in res:
        notes.append(f"Tensor parallelism all-reduces activations 4 times per layer: {sent['tp']:,.0f} B per step, "
                     f"{sent['tp'] / (4 * n_params):.2f}× the gradient bytes at this batch (it grows with the batch, "
                     f"DP's does not); its step grows {step['tp'][1] / step['tp'][0]:.1f}× at {slow}: tensor "
                     "parallel groups belong inside a node.")
    notes.append("Link bytes are the veth's kernel counter (tx_bytes) read by each rank at the start and end of every "
                 "step: the payload lightning_par.comm counts plus TCP/IP headers and the acknowledgements of what the "
                 "other node sent. Shaping is tc's tbf on both veth ends (a bucket of 1 ms at the rate, at least "
                 "16 KiB; a 16 MB queue); tc drops, which would add retransmissions, are listed.")
    if cfg.delay_ms:
        applied = any(r["delay_applied"] for lay in res.values() for r in lay.values())
        notes.append(f"delay_ms={cfg.delay_ms}: " + ("applied with netem under the tbf." if applied else
                     "NOT applied: this kernel has no netem (sch_netem), so only the rate was shaped."))
    else:
        notes.append("No delay was requested (delay_ms=0); a delay needs netem, which this machine's kernel may lack "
                     "(the report says so when it is requested and missing).")
    notes.append("Both nodes share this machine's cores (and, here, with other jobs): the unshaped veth is a memory "
                 "copy and compute dominates it, and absolute seconds vary with the load; read the ratios.")
    return notes


def _plot_times(res, rates):
    fig, ax = figure(2 + 1.5 * len(res), 4)
    width = 0.8 / len(rates)
    for j, rate in enumerate(rates):
        ax.bar([i + (j - (len(rates) - 1) / 2) * width for i in range(len(res))],
               [res[lay][rate]["step_s"] for lay in res], width, label=rate)
    ax.set_xticks(range(len(res)), [NAMES[lay] for lay in res])
    ax.set_ylabel("step time (s)")
    ax.legend(title="link")
    return fig


def _plot_bytes(res, n_params):
    base = next(iter(next(iter(res.values()))))
    fig, ax = figure(2 + 1.5 * len(res), 4)
    ax.bar(range(len(res)), [res[lay][base]["link_bytes_per_step"] / 1024 for lay in res], 0.6, label="on the link")
    ax.axhline(4 * n_params / 1024, color="k", ls="--", label="gradient bytes (4 B × parameters)")
    ax.set_xticks(range(len(res)), [NAMES[lay] for lay in res])
    ax.set_ylabel("KiB sent per step (busiest node)")
    ax.legend()
    return fig
