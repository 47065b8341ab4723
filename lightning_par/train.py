"""``lightning-par-train``: the Hydra app that trains a model with one of the lightning_par strategies.

    lightning-par-train                                   # reference GPT, Markov corpus, DDP on 2 CPU processes
    lightning-par-train strategy=single trainer.max_steps=50
    lightning-par-train trainer.precision=bf16-mixed trainer.accumulate_grad_batches=4
    python -m lightning_par.train data=text data.path=notes.txt model.n_layer=6
    torchrun --standalone --nproc-per-node=2 -m lightning_par.train trainer.devices=2

Configs live in the top-level ``conf/`` (schemas in :mod:`lightning_par.config`). Each run writes
its resolved config (``.hydra/``), CSV logs (and TensorBoard logs when ``tensorboard`` is installed)
and checkpoints under Hydra's run dir, and ends by printing the final train/val loss next to the data's
loss floor on global rank 0.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from omegaconf import DictConfig, OmegaConf

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par._compat import rich_available
from lightning_par.callbacks import ParallelMetrics
from lightning_par.config import check_keys, register_configs
from lightning_par.paths import conf_dir
from lightning_par.precision import precision_kwargs

# model argument left null in the config -> data module attribute that supplies it
DATA_SIZED_ARGS = {"vocab_size": "vocab_size", "block_size": "seq_len", "in_features": "in_features",
                   "num_classes": "num_classes"}


def build_datamodule(data_cfg: DictConfig) -> pl.LightningDataModule:
    return instantiate(data_cfg, _convert_="all")


def build_model(model_cfg: DictConfig, datamodule: pl.LightningDataModule) -> pl.LightningModule:
    """Instantiate the model, taking every size left ``null`` from the data (vocabulary, sequence length, ...)."""
    sizes: dict[str, Any] = {}
    for arg, attr in DATA_SIZED_ARGS.items():
        if arg in model_cfg and model_cfg[arg] is None:
            if not hasattr(datamodule, attr):
                raise ValueError(
                    f"model.{arg} is null, which means 'take it from the data', but the data module "
                    f"{type(datamodule).__name__} has no `{attr}`. Set it: `model.{arg}=<int>`."
                )
            sizes[arg] = getattr(datamodule, attr)
    return instantiate(model_cfg, _convert_="all", **sizes)  # plain lists: checkpoints load with weights_only


def build_strategy(strategy_cfg: DictConfig):
    return instantiate(strategy_cfg, _convert_="all")


def _check_devices(devices: Any) -> Any:
    ok = (isinstance(devices, int) and devices > 0 or devices in ("auto", -1)
          or isinstance(devices, str) and devices.replace(",", "").strip().isdigit()
          or OmegaConf.is_list(devices) or isinstance(devices, list))
    if not ok:
        raise ValueError(
            f"trainer.devices={devices!r} must be a positive int, a list of device ids, -1 or 'auto' "
            f"(e.g. `trainer.devices=2`)."
        )
    return OmegaConf.to_container(devices) if OmegaConf.is_list(devices) else devices


def _under_torchelastic() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ


def build_trainer_kwargs(cfg: DictConfig, run_dir: str | os.PathLike) -> dict[str, Any]:
    """Everything ``pl.Trainer`` receives: the ``trainer`` group, precision plugins, loggers, checkpoints."""
    kw: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)
    if kw["max_epochs"] is None and kw["max_steps"] == -1:
        raise ValueError("trainer.max_steps=-1 and trainer.max_epochs=null would train forever; set one of them.")
    precision = kw.pop("precision")
    kw["devices"] = _check_devices(cfg.trainer.devices)
    if _under_torchelastic() and kw["devices"] in ("auto", -1):
        kw["devices"] = int(os.environ["LOCAL_WORLD_SIZE"])
    kw.update(precision_kwargs(precision, kw["accelerator"]))
    run_dir = Path(run_dir)
    kw["default_root_dir"] = str(run_dir)
    kw["logger"] = build_loggers(run_dir)
    kw["callbacks"] = []
    if kw["enable_checkpointing"]:
        kw["callbacks"].append(ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), save_last=cfg.save_last))
    if kw["enable_progress_bar"] and (bar := build_progress_bar()) is not None:
        kw["callbacks"].append(bar)
    return kw


class StepsBoundedProgressBar(RichProgressBar):
    """Lightning's default (rich) bar, minus its ``Epoch 4/-2`` and ``v_num`` when ``max_steps`` bounds the run."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs not in (None, -1):
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


def build_progress_bar() -> pl.Callback | None:
    """:class:`StepsBoundedProgressBar` where ``rich`` is installed; None leaves Lightning's TQDM bar."""
    return StepsBoundedProgressBar() if rich_available() else None


def build_loggers(run_dir: Path) -> list[Logger]:
    loggers: list[Logger] = [CSVLogger(save_dir=str(run_dir), name="csv")]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tensorboard"))
    for logger in loggers:
        _ = logger.version  # fixed in the launching process: every rank and any later launch use this folder
    return loggers


class LogConfig(pl.Callback):
    """Logs the resolved run config as hyperparameters (next to the module's own) on every logger."""

    def __init__(self, config: dict):
        self.config = config

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams({"run_config": self.config})


class ValidateAtLastStep(pl.Callback):
    """Runs one validation pass on the final weights, inside ``fit``, when ``max_steps`` ends training mid-epoch.

    [Note: the final validation runs inside fit]
    Lightning validates at epoch ends; a run that stops at ``max_steps`` would end unvalidated. A
    second ``trainer.validate`` call would work but, under the fork/spawn launchers, starts the processes
    again and its CSV writer replaces the metrics file of the fit. Requesting a stop after the last
    optimizer step instead makes Lightning validate right there (as it does for early stopping), so the
    validation is logged next to the training curve and the last checkpoint carries ``val_loss``.
    """

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


def check_multirun(cfg: DictConfig, multirun: bool) -> None:
    """Refuse a Hydra sweep (``-m``) that Lightning's popen launcher would re-run inside every rank."""
    devices = cfg.trainer.devices
    one_process = devices == 1 or (OmegaConf.is_list(devices) and len(devices) == 1)
    if multirun and cfg.strategy.get("start_method") == "popen" and not one_process and not _under_torchelastic():
        raise ValueError(
            "Hydra multirun (-m) with strategy.start_method=popen does not work: Lightning re-runs the command "
            "per rank, and every rank would run the whole sweep again. Add `strategy.start_method=spawn` "
            "(or fork on CPU), or loop over the runs in the shell."
        )


def summary_lines(metrics: dict[str, Any], loss_floor: float | None) -> list[str]:
    """The closing report: final train/val loss next to the data's loss floor (nats/token)."""
    def fmt(name: str) -> str:
        value = metrics.get(name)
        return "n/a" if value is None else f"{float(value):.4f}"

    floor = "unknown for this data" if loss_floor is None else f"{loss_floor:.4f}"
    return [
        f"train_loss                 {fmt('train_loss')}",
        f"val_loss                   {fmt('val_loss')}",
        f"loss floor (entropy rate)  {floor}",
    ]


def resume_path(cfg: DictConfig) -> str | None:
    """The checkpoint ``fit`` resumes from: ``cfg.ckpt_path``, or ``"last"`` when torchrun restarted this run.

    [Note: restarts resume by themselves]
    ``torchrun --max-restarts=N`` restarts every worker of a run in which one failed, with the same
    arguments, the same rendezvous id (so the same run dir, [Note: one run dir per launch]) and
    ``TORCHELASTIC_RESTART_COUNT`` counting the restarts. A restarted run with no ``ckpt_path`` of its own
    resumes from the run dir's last checkpoint (Lightning's ``ckpt_path="last"``), which is complete
    whatever moment the failure hit ([Note: atomic checkpoints] in lightning_par/atomic.py). A first
    launch with ``ckpt_path=last`` and no checkpoint yet starts afresh (Lightning warns), so ``ckpt_path=last``
    also serves a scheduler that requeues the same command (SLURM's ``--requeue``) with a fixed ``hydra.run.dir``.
    """
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch#135712: workers of a restart find the addresses of the failed ones in torchrun's shared store
        rank_zero_warn("torchrun shares its rendezvous store with the workers, so a restarted run may fail to "
                       "connect (it can read the failed workers' addresses; torch issue 135712). Launch torchrun "
                       "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment for restarts that reconnect.")
    if cfg.ckpt_path is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return "last"
    return cfg.ckpt_path


def run(cfg: DictConfig, run_dir: str | os.PathLike) -> dict[str, float]:
    """Build everything from ``cfg``, fit (validating at the end), print the summary on rank 0; return the metrics."""
    check_keys(cfg)
    pl.seed_everything(cfg.seed, workers=True)
    trainer_kw = build_trainer_kwargs(cfg, run_dir)  # validates before any process is started
    datamodule = build_datamodule(cfg.data)
    model = build_model(cfg.model, datamodule)
    strategy = build_strategy(cfg.strategy)
    callbacks = trainer_kw["callbacks"]
    callbacks.append(LogConfig(OmegaConf.to_container(cfg, resolve=True)))
    if cfg.validate_at_end:
        callbacks.append(ValidateAtLastStep())
    if cfg.metrics:
        callbacks.append(ParallelMetrics())
    trainer = pl.Trainer(strategy=strategy, **trainer_kw)
    trainer.fit(model, datamodule=datamodule, ckpt_path=resume_path(cfg))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        _print_summary(metrics, getattr(datamodule, "loss_floor", None), run_dir)
    return metrics


@rank_zero_only
def _print_summary(metrics: dict[str, float], loss_floor: float | None, run_dir) -> None:
    print(f"\nrun dir: {run_dir}", flush=True)
    print("\n".join(summary_lines(metrics, loss_floor)), flush=True)


register_configs()


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    # Lightning 2.6 calls an API that torch 2.13 deprecates, once per step; nothing the user can act on
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    hydra_cfg = HydraConfig.get()
    check_multirun(cfg, multirun=hydra_cfg.mode == RunMode.MULTIRUN)
    run(cfg, hydra_cfg.runtime.output_dir)


if __name__ == "__main__":
    main()
