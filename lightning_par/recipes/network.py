"""network: DP, PP and TP across two nodes joined by a shaped link (recipes/network/README.md).

The two nodes are network namespaces on this machine joined by a veth pair
(:mod:`lightning_par.recipes.netns`), one rank each, launched by ``torchrun --nnodes 2 --rdzv-backend c10d``.
One launch runs every rate × layout (:mod:`lightning_par.recipes._node_job`): each rank shapes its own
veth end with tc's tbf before a rate's fits. A one-device run of the same model and global batches is the
reference every layout's losses are checked against. Besides DP, PP and TP, the data-parallel layouts that send less:
``dp_bf16`` and ``dp_powersgd`` (gradient compression), ``local_sgd<H>``, ``diloco<H>`` and ``diloco<H>f<F>``
(streaming DiLoCo, F fragments) (DataParallelStrategy's ``sync=``, replicas meeting every H steps); their step
time and link bytes are the mean over the timed steps (whole sync periods), and their convergence cost the held-out
loss of the final model against every-step DP's, after the same samples.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from lightning_par.recipes._node_job import UNSHAPED, case_dir, dp_options, load_records
from lightning_par.recipes.common import figure, Report, savefig
from lightning_par.recipes.netns import TwoNodeLink, qdisc_drops, rate_bits_per_s

NAMES = {"dp": "DP (2 replicas)", "pp": "PP (2 stages)", "tp": "TP (2 shards)", "dp_bf16": "DP, bf16 gradients",
         "dp_powersgd": "DP, PowerSGD rank 1"}
TIMED_FROM = 2  # step 0 warms up, step 1 is counted by lightning_par.comm (slow); steps 2.. are timed


def name(layout: str) -> str:
    if layout in NAMES:
        return NAMES[layout]
    o = dp_options(layout)
    kind = "local SGD" if o["sync"] == "local_sgd" else "streaming DiLoCo" if o.get("fragments", 1) > 1 else "DiLoCo"
    return f"{kind}, H = {o['sync_every']}" + (f", {o['fragments']} fragments" if o.get("fragments", 1) > 1 else "")


def periodic(layout: str) -> bool:
    """A layout whose replicas meet every H steps (its steps are not alike: mean, not median)."""
    return "sync" in (dp_options(layout) or {})


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
    # a step ends when its slowest rank ends; the median over timed steps resists one-off stalls, but the steps of
    # local SGD / DiLoCo are not alike (a sync every H): their mean over whole sync periods
    mid = statistics.mean if periodic(layout) else statistics.median
    step_s = mid(max(r["step_s"][i] for r in records) for i in timed)
    tx = [mid(r["tx_bytes"][i] for i in timed) for r in records]
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
        "eval_loss": [r.get("eval_loss") for r in records],  # data-parallel layouts: each rank's final model
        "nodes": sorted({r["netns"] for r in records}),
    }


def run(cfg, out_dir: Path, command: str) -> Report:
    layouts, rates = list(cfg.layouts), list(cfg.rates)
    for rate in rates:  # settings fail here, before anything starts
        if rate != UNSHAPED:
            rate_bits_per_s(rate)
    if not layouts or any(lay not in NAMES and dp_options(lay) is None for lay in layouts):
        raise ValueError(f"`layouts={layouts}` must be a non-empty list of {sorted(NAMES)}, 'local_sgd<H>' or "
                         f"'diloco<H>' or 'diloco<H>f<F>' (streaming DiLoCo, F fragments).")
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
    return _report(cfg, command, out_dir, res, nodes, n_params=sum(p.numel() for p in ref["params"].values()),
                   ref_eval_loss=ref["eval_loss"])


def _report(cfg, command, out_dir, res, nodes, n_params, ref_eval_loss) -> Report:
    layouts, rates = list(res), list(next(iter(res.values())))
    base = rates[0]
    data = {"results": res, "nodes": nodes, "parameters": n_params, "gradient_bytes": 4 * n_params,
            "rates": rates, "delay_requested_ms": cfg.delay_ms, "samples": cfg.steps * cfg.global_batch,
            "one_device_eval_loss": ref_eval_loss}
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
        f"Step time (s, median of steps {TIMED_FROM}..{cfg.steps - 1}, slowest rank; local SGD / DiLoCo: their mean) "
        f"per link rate; × = vs {base}",
        ["layout", *rates, *(f"× at {r}" for r in rates[1:])],
        [[name(lay), *(res[lay][r]["step_s"] for r in rates),
          *(f"{res[lay][r]['step_s'] / res[lay][base]['step_s']:.2f}" for r in rates[1:])] for lay in layouts]))
    rows = []
    for lay in layouts:
        r0 = res[lay][base]
        counted = None if periodic(lay) else r0["counted_bytes_per_step"]  # step 1 alone: not a mean over syncs
        rows.append([name(lay), f"{r0['link_bytes_per_step']:,.0f}", "—" if counted is None else f"{counted:,.0f}",
                     "—" if counted is None else f"{r0['link_bytes_per_step'] / counted:.3f}",
                     f"{r0['link_bytes_per_step'] / (4 * n_params):.3f}",
                     max(res[lay][r]["drops"] for r in rates)])
    report.tables.append((
        f"Bytes per step sent by the busiest node over the veth ({base}; local SGD / DiLoCo: the mean) vs "
        f"lightning_par.comm's count of step 1 and the gradients ({4 * n_params:,} B = 4 B × {n_params:,} parameters)",
        ["layout", "link bytes (kernel counter)", "counted by lightning_par.comm", "link / counted",
         "link / gradient bytes", "tc drops (any rate)"], rows))
    report.tables.append((
        "Every layout against one device (same global batches): largest loss difference over all steps (the "
        "compression hooks and local SGD / DiLoCo change the numbers by design)",
        ["layout", *rates],
        [[name(lay), *(f"{res[lay][r]['max_loss_diff_vs_one_device']:.1e}" for r in rates)] for lay in layouts]))
    if "dp" in res:  # the convergence cost of sending less
        dp_loss = res["dp"][base]["eval_loss"][0]
        report.tables.append((
            f"Held-out loss of the final model after {cfg.steps * cfg.global_batch} samples ({cfg.steps} steps x "
            f"{cfg.global_batch}; rank 0's model; one device: {ref_eval_loss:.4f}) against every-step DP's",
            ["layout", "held-out loss", "vs DP every step"],
            [[name(lay), f"{res[lay][base]['eval_loss'][0]:.4f}",
              f"{res[lay][base]['eval_loss'][0] / dp_loss - 1:+.2%}"] for lay in layouts
             if res[lay][base]["eval_loss"][0] is not None]))
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
    notes += _sync_notes(cfg, res, base, slow)
    notes.append("Link bytes are the veth's kernel counter (tx_bytes) read by each rank at the start of every step "
                 "and at the end of training (a step's bytes run to the next step's start): the payload "
                 "lightning_par.comm counts plus TCP/IP headers and the acknowledgements of what the other node sent. "
                 "Shaping is tc's tbf on both veth ends (a bucket of 1 ms at the rate, at least 16 KiB; a 16 MB "
                 "queue); tc drops, which would add retransmissions, are listed.")
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
    ax.set_xticks(range(len(res)), [name(lay) for lay in res], rotation=20, ha="right")
    ax.set_ylabel("step time (s)")
    ax.legend(title="link")
    return fig


def _plot_bytes(res, n_params):
    base = next(iter(next(iter(res.values()))))
    fig, ax = figure(2 + 1.5 * len(res), 4)
    ax.bar(range(len(res)), [res[lay][base]["link_bytes_per_step"] / 1024 for lay in res], 0.6, label="on the link")
    ax.axhline(4 * n_params / 1024, color="k", ls="--", label="gradient bytes (4 B × parameters)")
    ax.set_xticks(range(len(res)), [name(lay) for lay in res], rotation=20, ha="right")
    ax.set_ylabel("KiB sent per step (busiest node)")
    ax.legend()
    return fig


def _sync_notes(cfg, res, base, slow) -> list[str]:
    """Local SGD / DiLoCo against every-step DP: the issue's target (at the slow rate, DiLoCo H = 32 within 1.3x of
    unshaped DP's step time, its loss within 3% of DP's after the same samples)."""
    if "dp" not in res:
        return []
    dp_step, dp_loss = res["dp"][base]["step_s"], res["dp"][base]["eval_loss"][0]
    notes = []
    for lay in (lay for lay in res if periodic(lay)):
        r = res[lay][slow]
        every, fragments = dp_options(lay)["sync_every"], dp_options(lay).get("fragments", 1)
        what = (f"one fragment's all-reduce (1/{fragments} of the parameters) every {every // fragments} steps, "
                f"overlapped with the next forward" if fragments > 1 else
                f"one parameter all-reduce every {every} steps")
        notes.append(f"{name(lay)}: {what}, so {r['link_bytes_per_step']:,.0f} B "
                     f"per step on the link at {slow} (every-step DP: {res['dp'][slow]['link_bytes_per_step']:,.0f} B); "
                     f"its step at {slow} takes {r['step_s'] / dp_step:.2f}x unshaped DP's ({r['step_s']:.3f} s vs "
                     f"{dp_step:.3f} s), and its held-out loss after {cfg.steps * cfg.global_batch} samples is "
                     f"{r['eval_loss'][0] / dp_loss - 1:+.2%} against every-step DP's"
                     + (" (the target: within 1.3x and 3%)." if lay == "diloco32" else "."))
    return notes
