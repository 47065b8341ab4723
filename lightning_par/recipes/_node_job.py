"""One rank's training job for the two-node runs: the reference GPT on the synthetic corpus, recorded.

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d ... -m lightning_par.recipes._node_job \
        --layouts dp,pp --rates unshaped,20mbit --out DIR --steps 4 --global-batch 8 --model '{"n_layer": 2, ...}'
    python -m lightning_par.recipes._node_job --layouts single --out DIR ...    # the one-device reference

Under torchrun Lightning takes the ranks from torchrun's environment (``Trainer(num_nodes=2, devices=1)``
for 2 nodes × 1 rank). Every layout × rate is one fit in the same processes (one launch: starting
torchrun and importing torch costs far more than a few tiny training steps); before the fits of a rate
each rank shapes its own veth end with tc (``lightning_par.recipes.netns``; only an interface that
``TwoNodeLink.torchrun`` names in ``LIGHTNING_PAR_NETNS``). Every rank writes
``DIR/<layout>-<rate>/rank<r>.pt`` (``DIR/single/rank0.pt`` for the reference): the loss of every step,
the wall time of every step, the bytes (and frames) its network interface (``GLOO_SOCKET_IFNAME``) sent and received
during every step (the kernel's counters, read at the step's start and end), the parameters it owns at
the end (those it held a gradient for at the last optimizer step: a pipeline stage owns its blocks) as
full tensors; beside them ``qdisc<r>.json`` (tc's statistics around the fit) and, with
``--measure-comm``, ParallelMetrics' rows (bytes handed to ``torch.distributed`` on step 1). Under the data-parallel
layouts and the reference each rank also records ``eval_loss``: its final model's loss on the held-out sequences
(the same on every layout), the convergence cost of ``dp_bf16``, ``dp_powersgd``, ``local_sgd<H>`` and
``diloco<H>`` (DataParallelStrategy's comm hooks and ``sync=``, every ``H`` optimizer steps).

Data order: the one-device reference reads the global batches Lightning's distributed sampler hands the
replicas (``DistributedSampler(num_replicas=1, shuffle=True, seed=0)`` with the global batch), so all
layouts see the same sequences at every step.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from lightning_par.recipes.common import gpt_workload
from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_par.recipes.netns import NETNS_ENV, qdisc_show, shape_interface

LAYOUTS = ("single", "dp", "pp", "tp", "dp_bf16", "dp_powersgd", "local_sgd<H>", "diloco<H>")
UNSHAPED = "unshaped"
STRATEGIES = {"dp": DataParallelStrategy, "pp": PipelineParallelStrategy, "tp": TensorParallelStrategy}
DP_VARIANTS = {"dp": {}, "dp_bf16": {"comm_hook": "bf16"},
               "dp_powersgd": {"comm_hook": "powersgd", "powersgd_start_iter": 2}}  # PowerSGD from step 2 on


def dp_options(layout: str) -> dict | None:
    """DataParallelStrategy's keywords of a data-parallel layout; None for another layout.

    >>> dp_options("diloco32"), dp_options("dp_bf16"), dp_options("pp")
    ({'sync': 'diloco', 'sync_every': 32}, {'comm_hook': 'bf16'}, None)
    >>> dp_options("diloco32f4")  # streaming DiLoCo: 4 fragments
    {'sync': 'diloco', 'sync_every': 32, 'fragments': 4}
    """
    if layout in DP_VARIANTS:
        return DP_VARIANTS[layout]
    m = re.fullmatch(r"(local_sgd|diloco)([1-9][0-9]*)(?:f([1-9][0-9]*))?", layout)
    if not m:
        return None
    return {"sync": m[1], "sync_every": int(m[2]), **({"fragments": int(m[3])} if m[3] else {})}


COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets")


def _interface_counters(ifname: str | None) -> tuple[int, ...]:
    if not ifname:
        return (0,) * len(COUNTERS)
    stats = Path("/sys/class/net") / ifname / "statistics"
    return tuple(int((stats / key).read_text()) for key in COUNTERS)


class NodeRecord(pl.Callback):
    """Per step: loss, wall time, interface bytes; at the end the owned parameters (see the module's doc)."""

    def __init__(self, out_dir: Path, ifname: str | None, held_out=None):
        self.out_dir, self.ifname, self.held_out = out_dir, ifname, held_out
        self.losses, self.step_s = [], []
        self.counts: dict[str, list[int]] = {key: [] for key in COUNTERS}  # per step, as the kernel counts them
        self.owned: set[str] = set()
        self._c0: tuple[int, ...] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()
        self._count_bytes()

    def _count_bytes(self) -> None:
        """A step's bytes: from its start to the next step's start (or the end of training), so that a transfer
        still running after the step's end (streaming DiLoCo's fragment, finished in the next forward) counts."""
        now = _interface_counters(self.ifname)
        if self._c0 is not None:
            for key, a, b in zip(COUNTERS, now, self._c0):
                self.counts[key].append(a - b)
        self._c0 = now

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.owned = {n for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_s.append(time.perf_counter() - self._t0)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach().float()) * trainer.accumulate_grad_batches)

    def on_fit_end(self, trainer, pl_module):  # after the strategy's on_train_end: the last step's bytes
        from torch.distributed.tensor import DTensor

        self._count_bytes()
        params = {}
        for name, p in pl_module.named_parameters():  # every rank in the same order: full_tensor() is a collective
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if name in self.owned:
                params[name] = full.detach().float().cpu().clone()
        eval_loss = None
        if self.held_out is not None:  # the whole model on this rank: its loss on the held-out sequences
            with torch.no_grad():
                eval_loss = float(pl_module._loss(self.held_out))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"rank": trainer.global_rank, "eval_loss": eval_loss, "node": int(os.environ.get("GROUP_RANK", 0)),
                    "netns": os.stat("/proc/self/ns/net").st_ino,  # which network namespace this rank ran in
                    "world_size": trainer.world_size, "losses": self.losses, "step_s": self.step_s,
                    **self.counts, "params": params},
                   self.out_dir / f"rank{trainer.global_rank}.pt")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_par.recipes._node_job", description=__doc__.split("\n")[0])
    p.add_argument("--layouts", required=True, help=f"comma-separated, each one of {LAYOUTS}")
    p.add_argument("--rates", default=UNSHAPED, help=f"comma-separated tc rates ('100mbit') or {UNSHAPED!r}: "
                   "each rank shapes its veth end (LIGHTNING_PAR_NETNS) before the layouts run at that rate")
    p.add_argument("--delay-ms", type=float, default=0.0, help="netem delay per packet, where the kernel has netem")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches per step")
    p.add_argument("--model", default="{}", help="GPT arguments as JSON (vocab_size, block_size, n_layer, ...)")
    p.add_argument("--timeout", type=float, default=120.0, help="the strategy's collective timeout (s)")
    p.add_argument("--measure-comm", action="store_true", help="ParallelMetrics on step 1 (slows that step)")
    p.add_argument("--nodes", type=int, default=2)
    args = p.parse_args(argv)
    args.layouts, args.rates = args.layouts.split(","), args.rates.split(",")
    for layout in args.layouts:
        if layout not in ("single", "pp", "tp") and dp_options(layout) is None:
            p.error(f"layout {layout!r} must be one of {LAYOUTS}")
    return args


def case_dir(out: Path, layout: str, rate: str = UNSHAPED) -> Path:
    """Where a case's records go: ``single`` (one device, no link), else ``<layout>-<rate>``."""
    return out / ("single" if layout == "single" else f"{layout}-{rate}")


def load_records(case: Path) -> list[dict]:
    """A case's ``rank<r>.pt`` records in rank order."""
    files = sorted(case.glob("rank*.pt"), key=lambda f: int(f.stem[4:]))
    return [torch.load(f, weights_only=False) for f in files]


def fit_case(args, layout: str, out_dir: Path) -> None:
    world = 1 if layout == "single" else int(os.environ.get("WORLD_SIZE", 1))
    replicas = dp_options(layout)
    dp = world if replicas is not None else 1
    if args.global_batch % dp:
        raise ValueError(f"`--global-batch {args.global_batch}` must be divisible by the {dp} data-parallel replicas.")
    data, make_module = gpt_workload(json.loads(args.model), args.global_batch // dp,
                                     train_sequences=args.global_batch * (args.steps + 1),
                                     val_sequences=4 * args.global_batch, warmup_steps=1, lr_decay_steps=10)
    whole = layout == "single" or replicas is not None  # every rank holds the whole model at the end
    held_out = default_collate([data.val_set[i] for i in range(len(data.val_set))]) if whole else None
    if layout == "single":
        sampler = DistributedSampler(data.train_set, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(data.train_set, batch_size=args.global_batch, sampler=sampler, drop_last=True)
        strategy, devices, nodes = "auto", 1, 1
    else:
        # Lightning replaces the sampler by DistributedSampler(shuffle=True, seed=0) over the data-parallel group
        loader = DataLoader(data.train_set, batch_size=args.global_batch // dp, shuffle=True, drop_last=True)
        sizes = {"pp": {"pipeline_parallel_size": world, "microbatches": args.microbatches},
                 "tp": {"tensor_parallel_size": world}}.get(layout, replicas)
        # [Note: popen under torchrun] start_method stays "popen": its launcher starts nothing when the cluster
        # environment (torchrun's) created the processes; "fork"/"spawn" fork one more process per rank and fit,
        # each with a process group of its own on torchrun's shared store (seen here: the third fit's gloo dialled
        # a port an earlier fit had closed, "Connection refused").
        strategy = STRATEGIES.get(layout, DataParallelStrategy)(timeout=args.timeout, **sizes)
        devices, nodes = world // args.nodes, args.nodes
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if layout != "single" else None
    callbacks = [NodeRecord(out_dir, ifname, held_out)]
    if args.measure_comm:
        from lightning_par.callbacks import ParallelMetrics

        callbacks.append(ParallelMetrics(measure_step=1, summary=False, save_path=str(out_dir / "metrics.json")))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy,
                         max_steps=args.steps, deterministic=True, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=callbacks)
    trainer.fit(make_module(), train_dataloaders=loader)


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    # only the veth end of a namespace TwoNodeLink made is ever shaped, never an interface of a real host
    ifname = os.environ.get(NETNS_ENV)
    for rate in args.rates:
        shaped = None
        if ifname:  # every rate, the unshaped one too: it undoes the previous rate's shaping
            shaped = shape_interface(ifname, None if rate == UNSHAPED else rate, args.delay_ms)
        elif rate != UNSHAPED or args.delay_ms:
            raise ValueError(f"`--rates {rate}` shapes a veth end of lightning_par.recipes.netns.TwoNodeLink; "
                             f"{NETNS_ENV} is not set: launch the job with TwoNodeLink.torchrun.")
        for layout in args.layouts:
            out_dir = case_dir(args.out, layout, rate)
            before = qdisc_show(ifname, stats=True) if ifname else ""
            fit_case(args, layout, out_dir)
            if ifname:  # tc's own account of this case: bytes through the qdisc, drops
                rank = int(os.environ.get("RANK", 0))
                (out_dir / f"qdisc{rank}.json").write_text(json.dumps(
                    {"shaped": shaped, "before": before, "after": qdisc_show(ifname, stats=True)}))
    if ifname:
        shape_interface(ifname, None)


if __name__ == "__main__":
    main()
