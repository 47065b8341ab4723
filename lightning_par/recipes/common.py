"""What every recipe shares: the report it writes, the hardware line, and fits measured with ParallelMetrics."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import lightning.pytorch as pl
import torch

from lightning_par.callbacks import ParallelMetrics
from lightning_par.cli_errors import UsageError


@dataclass
class Report:
    """A recipe's result: a title, what is reproduced and from where, tables, figures, and notes."""

    title: str
    command: str
    published: str
    tables: list[tuple[str, list[str], list[list]]] = field(default_factory=list)  # (caption, header, rows)
    figures: list[tuple[str, str]] = field(default_factory=list)  # (caption, file name in the run folder)
    notes: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)  # the raw numbers, saved as results.json

    def markdown(self) -> str:
        lines = [f"# {self.title}", "", f"    {self.command}", "", f"Hardware: {hardware()}", "",
                 f"Published result reproduced: {self.published}", ""]
        for caption, header, rows in self.tables:
            lines += [f"## {caption}", "", "| " + " | ".join(header) + " |",
                      "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
            lines.append("")
        for caption, name in self.figures:
            lines += [f"## {caption}", "", f"![{caption}]({name})", ""]
        if self.notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(lines)

    def write(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(self.data, indent=1, default=str))
        path = out_dir / "report.md"
        path.write_text(self.markdown())
        return path


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def hardware() -> str:
    """The machine line a report (and docs/performance.md) opens with."""
    from lightning_par.performance import machine

    return machine()


def accelerator(cfg, cpu_threads: int = 1) -> str:
    """The recipe's accelerator; on CPU each rank process is one "device" with ``cpu_threads`` threads
    (set here, inherited by forked ranks)."""
    acc = cfg.trainer.accelerator
    acc = "gpu" if acc in ("gpu", "cuda") else acc
    if acc == "cpu":
        torch.set_num_threads(cpu_threads)
    return acc


def gpt_workload(model_cfg, batch_size: int, train_sequences: int, val_sequences: Optional[int] = None,
                 **module_kwargs):
    """The synthetic corpus sized for ``model_cfg`` (``val_sequences``: None, one batch) and a factory of the
    reference GPT, seeded the same way every call (every layout starts from the same weights)."""
    from lightning_par.data import SyntheticCorpus
    from lightning_par.models import GPT

    model_kw = dict(model_cfg)
    data = SyntheticCorpus(vocab_size=model_kw["vocab_size"], seq_len=model_kw["block_size"], batch_size=batch_size,
                           train_sequences=train_sequences, val_sequences=val_sequences or batch_size)

    def make_module() -> pl.LightningModule:
        torch.manual_seed(0)
        return GPT(**model_kw, **module_kwargs)

    return data, make_module


def start_method(acc: str) -> str:
    """fork is the fast start on CPU; CUDA cannot be used in a forked child, so spawn there."""
    return "fork" if acc == "cpu" else "spawn"


def measured_fit(make_module: Callable[[], pl.LightningModule], datamodule: pl.LightningDataModule, *, strategy,
                 devices: int, max_steps: int, out_json: Path, accelerator: str = "cpu", precision="32-true",
                 measure_step: int = 1, **trainer_kwargs) -> list[dict]:
    """Fit and return ParallelMetrics' per-rank rows (read back from ``out_json``: ranks may be children)."""
    out_json = Path(out_json)
    out_json.unlink(missing_ok=True)
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=max_steps,
                         precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[ParallelMetrics(measure_step=measure_step, summary=False,
                                                    save_path=str(out_json))], **trainer_kwargs)
    trainer.fit(make_module(), datamodule=datamodule)
    return json.loads(out_json.read_text())


class LossLog(pl.Callback):
    """Every rank's training loss per step, averaged over ranks and written as JSON by rank 0 at the end.

    The mean over ranks is the global batch's loss for every layout lightning_par offers: data-parallel
    replicas hold equal shares of the batch, and all ranks of one pipeline or tensor-parallel group
    return the same (true) loss.
    """

    def __init__(self, path: str):
        self.path = path
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach().float()) * trainer.accumulate_grad_batches)

    def on_fit_end(self, trainer, pl_module):
        import torch.distributed as dist

        per_rank = [self.losses]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, self.losses)
        if trainer.is_global_zero:
            mean = [sum(step) / len(step) for step in zip(*per_rank)]
            Path(self.path).write_text(json.dumps({"mean": mean, "per_rank": per_rank}))


class MatplotlibMissing(UsageError, ModuleNotFoundError):
    """matplotlib, an optional dependency (the ``recipes`` extra), is not installed: a ``UsageError`` for the
    CLI's one message, and the ``ModuleNotFoundError`` that code catching a missing import expects."""


def require_matplotlib():
    """The ``matplotlib`` module, or :class:`MatplotlibMissing` saying how to install it."""
    try:
        import matplotlib
    except ImportError as err:
        raise MatplotlibMissing('The recipes draw their plots with matplotlib, which is not installed: '
                                'pip install "lightning-par[recipes]" (or pip install matplotlib).',
                                name="matplotlib") from err
    return matplotlib


def figure(width: float, height: float):
    """A new matplotlib figure and axes, drawn off-screen (recipes run on machines without a display)."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def savefig(fig, out_dir: Path, name: str) -> str:
    fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name
