"""parity: loss curves of single / DP / PP / TP and pairs on the reference GPT (recipes/parity/README.md)."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par.recipes.common import figure, LossLog, Report, accelerator, gpt_workload, savefig
from lightning_par.recipes.layouts import layout_for, strategy_for


def _fit(make_module, loader, strategy, devices, steps, acc, path: Path) -> list[float]:
    trainer = pl.Trainer(accelerator=acc, devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[LossLog(str(path))])
    trainer.fit(make_module(), loader)
    return json.loads(path.read_text())["mean"]


def run(cfg, out_dir: Path, command: str) -> Report:
    acc = accelerator(cfg)
    data, make_module = gpt_workload(cfg.model, cfg.global_batch, cfg.global_batch * (cfg.max_steps + 1),
                                     warmup_steps=2, lr_decay_steps=cfg.max_steps)

    # one device sees the same global batches as Lightning's distributed sampler gives the replicas
    single_loader = DataLoader(data.train_set, batch_size=cfg.global_batch,
                               sampler=DistributedSampler(data.train_set, num_replicas=1, rank=0, seed=0))
    curves = {"single": _fit(make_module, single_loader, "auto", 1, cfg.max_steps, acc, out_dir / "loss-single.json")}
    for name, entry in cfg.layouts.items():
        args = dict(entry.get("args", {}))
        dp = layout_for(entry.kind, args, entry.devices).data_parallel_size
        loader = DataLoader(data.train_set, batch_size=cfg.global_batch // dp)
        curves[name] = _fit(make_module, loader, strategy_for(entry.kind, args, acc), entry.devices, cfg.max_steps,
                            acc, out_dir / f"loss-{name}.json")
    ref = torch.tensor(curves["single"], dtype=torch.float64)
    rows = []
    for name, curve in curves.items():
        dev = (torch.tensor(curve, dtype=torch.float64) - ref).abs()
        rows.append([name, len(curve), f"{curve[0]:.5f}", f"{curve[-1]:.5f}", "< 1e-4 (fp32 round-off)",
                     f"{dev.max().item():.2e}", f"{dev[0].item():.2e}"])
    report = Report(
        title="parity: every layout trains like one device",
        command=command,
        published=("pipeline and tensor parallelism are exact re-arrangements of the same computation (GPipe, "
                   "Huang et al. 2019; Megatron-LM, Shoeybi et al. 2019): loss curves agree to fp32 round-off"),
        data={"curves": curves, "floor": data.loss_floor},
    )
    report.tables.append(("Largest deviation from one device (nats)",
                          ["layout", "steps", "first loss", "last loss", "expected max |Δ|", "measured max |Δ| over steps",
                           "|Δ| at step 0"], rows))
    report.figures.append(("Loss curves, overlaid", savefig(_plot(curves, data.loss_floor), out_dir, "parity.png")))
    return report


def _plot(curves, floor):
    fig, ax = figure(6.5, 4)
    for i, (name, curve) in enumerate(curves.items()):
        ax.plot(curve, label=name, lw=2.5 if name == "single" else 1.2, ls="-" if i % 2 == 0 else "--")
    ax.axhline(floor, color="grey", lw=0.8, ls=":", label="loss floor")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.legend()
    return fig
