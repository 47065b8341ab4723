"""``lightning-par-train``: the Hydra app that trains a model with one of the lightning_par strategies.

    lightning-par-train                                   # reference GPT, Markov corpus, DDP on 2 CPU processes
    lightning-par-train strategy=single trainer.max_steps=50
    lightning-par-train trainer.precision=bf16-mixed trainer.accumulate_grad_batches=4
    python -m lightning_par.train data=text data.path=notes.txt model.n_layer=6
    torchrun --standalone --nproc-per-node=2 -m lightning_par.train trainer.devices=2
    lightning-par-train model=custom model._target_=my_pkg.MyModule +model.hidden=512 data=custom data._target_=...
    lightning-par-train model=hf 'model.config={model_type: llama, hidden_size: 64, num_hidden_layers: 2}'
    lightning-par-train +trainer.profiler=simple +trainer.max_time=00:00:01:00 +trainer.fast_dev_run=true

``trainer.KEY=`` sets the keys of ``conf/trainer/default.yaml``, ``+trainer.KEY=`` any other argument of
``lightning.Trainer``; loggers, callbacks, a profiler or plugins come by ``_target_``
(``+trainer.logger._target_=...``, ``+trainer.callbacks=[{_target_: ...}]``) and replace the app's own
logger / checkpoint callback. A mistake (a misspelled key, sizes that do not fit the devices, a missing
path) is one message and exit status 2 before anything starts (``HYDRA_FULL_ERROR=1``: the traceback).

Configs live in the top-level ``conf/`` (schemas in :mod:`lightning_par.config`). Each run writes
its resolved config (``.hydra/``), CSV logs (and TensorBoard logs when ``tensorboard`` is installed)
and checkpoints under Hydra's run dir, and ends by printing the final train/val loss next to the data's
loss floor on global rank 0.
"""
from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException
from hydra.types import RunMode
from hydra.utils import get_class, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par._compat import rich_available
from lightning_par.callbacks import ParallelMetrics
from lightning_par.cli_errors import USAGE_EXIT, UsageError, cwd_importable, run_cli, version_text
from lightning_par.config import CUSTOM, check_keys, composition_message, import_target, register_configs
from lightning_par.paths import conf_dir
from lightning_par.precision import precision_kwargs
from lightning_par.topology import Topology

PROG = "lightning-par-train"

# model argument left null in the config -> data module attribute that supplies it
DATA_SIZED_ARGS = {"vocab_size": "vocab_size", "block_size": "seq_len", "in_features": "in_features",
                   "num_classes": "num_classes"}


def build_datamodule(data_cfg: DictConfig) -> pl.LightningDataModule:
    return instantiate(data_cfg, _convert_="all")


def build_model(model_cfg: DictConfig, datamodule: pl.LightningDataModule) -> pl.LightningModule:
    """Instantiate the model, taking every size left ``null`` from the data (vocabulary, sequence length, ...)."""
    sizes: dict[str, Any] = {}
    for arg, attr in DATA_SIZED_ARGS.items():
        if arg in model_cfg and model_cfg[arg] is None and OmegaConf.get_type(model_cfg) is not CUSTOM["model"]:
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
    """Everything ``pl.Trainer`` receives: the ``trainer`` group (any ``+trainer.KEY``, ``_target_`` nodes such
    as ``+trainer.logger._target_=...`` or ``+trainer.callbacks=[{_target_: ...}]`` instantiated), precision
    plugins, the app's loggers and checkpoints (unless the user gives ``trainer.logger`` / a ModelCheckpoint)."""
    kw = trainer_values(cfg)
    precision = kw.pop("precision")
    user = {key: instantiate(node, _convert_="all") for key, node in cfg.trainer.items_ex(resolve=True)
            if _has_target(node)}  # loggers, callbacks, a profiler, plugins
    plugins = precision_kwargs(precision, kw["accelerator"])
    if "plugins" in user:  # the user's plugins beside the precision plugin the app chose
        plugins["plugins"] = [*plugins.get("plugins", []), *_as_list(user.pop("plugins"))]
    kw.update(plugins, **user)
    run_dir = Path(run_dir)
    kw.setdefault("default_root_dir", str(run_dir))
    kw["logger"] = build_loggers(run_dir) if kw.get("logger", True) is True else kw["logger"]
    kw["callbacks"] = _as_list(kw.get("callbacks"))
    if kw["enable_checkpointing"] and not any(isinstance(c, ModelCheckpoint) for c in kw["callbacks"]):  # else theirs
        kw["callbacks"].append(ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), save_last=cfg.save_last))
    if kw["enable_progress_bar"] and (bar := build_progress_bar()) is not None:
        kw["callbacks"].append(bar)
    return kw


def trainer_values(cfg: DictConfig) -> dict[str, Any]:
    """The ``trainer`` group as plain values, checked (devices, accumulation, an end); nothing instantiated."""
    kw: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)
    if kw["max_epochs"] is None and kw["max_steps"] == -1 and not kw.get("max_time") and not kw.get("fast_dev_run"):
        raise ValueError("trainer.max_steps=-1 and trainer.max_epochs=null would train forever; set one of them.")
    accumulate = kw["accumulate_grad_batches"]
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"trainer.accumulate_grad_batches={accumulate!r} must be a positive integer (1: no "
                         f"accumulation), e.g. `trainer.accumulate_grad_batches=4`.")
    precision_kwargs(kw["precision"], kw["accelerator"])  # an unknown precision names the choices
    kw["devices"] = _check_devices(cfg.trainer.devices)
    if _under_torchelastic() and kw["devices"] in ("auto", -1):
        kw["devices"] = int(os.environ["LOCAL_WORLD_SIZE"])
    return kw


def _targets(node: Any) -> list[str]:
    """The ``_target_`` of a node, or of the nodes of a list (what ``hydra.utils.instantiate`` builds)."""
    if OmegaConf.is_dict(node):
        return [node._target_] if "_target_" in node else []
    return [t for item in node for t in _targets(item)] if OmegaConf.is_list(node) else []


def _has_target(node: Any) -> bool:
    return bool(_targets(node))


def _as_list(value: Any) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def world_size(trainer_cfg: DictConfig) -> Optional[int]:
    """The processes of the run (``trainer.devices`` × ``trainer.num_nodes``, or torchrun's), None where only
    Lightning can tell (``devices=auto`` / ``-1`` outside torchrun)."""
    if _under_torchelastic():
        return int(os.environ.get("WORLD_SIZE", os.environ["LOCAL_WORLD_SIZE"]))
    devices = _check_devices(trainer_cfg.devices)
    if isinstance(devices, str) and devices != "auto":
        devices = [d for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
    if isinstance(devices, list):
        devices = len(devices)
    return None if devices in ("auto", -1) else devices * trainer_cfg.num_nodes


def check_sizes(cfg: DictConfig) -> None:
    """The strategy's parallel sizes against ``trainer.devices`` × ``trainer.num_nodes``, before any process
    starts; the message names only the sizes this strategy option takes."""
    sizes = {k: v for k, v in cfg.strategy.items()  # expert parallelism borrows its ranks: no factor of the world
             if k.endswith("_parallel_size") and k != "expert_parallel_size"}
    world = world_size(cfg.trainer)
    if not sizes or world is None:
        return
    model_axis = getattr(get_class(cfg.strategy._target_), "_model_axis", None)
    Topology.resolve(world, model_axis=model_axis, named=tuple(sizes), **sizes,
                     fix=f"`strategy.<size>=` or `trainer.devices=` (now {cfg.trainer.devices}) × "
                         f"`trainer.num_nodes=` (now {cfg.trainer.num_nodes})")


LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")  # what Lightning's `ckpt_path` resolves itself


def check_paths(cfg: DictConfig) -> None:
    """``ckpt_path``, ``strategy.weights`` and ``model.weights`` exist, before any process starts."""
    paths = {"ckpt_path": cfg.ckpt_path, "strategy.weights": cfg.strategy.get("weights"),
             "model.weights": cfg.model.get("weights")}
    for key, path in paths.items():
        if path is None or (key == "ckpt_path" and (path in LIGHTNING_CKPT_NAMES or "://" in str(path))):
            continue
        if not Path(path).exists():
            what = "a checkpoint file (or last / best)" if key == "ckpt_path" else "a weights file or folder"
            raise ValueError(f"`{key}={path}` does not exist (looked in {Path.cwd()}): give {what} that does, "
                             f"or drop `{key}=`.")


def check_run(cfg: DictConfig) -> None:
    """Every check of the user's config that needs no process: keys, targets, sizes, paths, Trainer values."""
    check_keys(cfg)
    trainer_values(cfg)
    for key, node in cfg.trainer.items():  # the `_target_` of a logger, a callback, ... is importable
        for target in _targets(node):
            import_target(f"trainer.{key}", target, "class (a logger, a callback, a profiler or a plugin)")
    check_sizes(cfg)
    check_paths(cfg)


@contextmanager
def user_errors() -> Iterator[None]:
    """A ``ValueError`` (or Hydra's wrapping of one) while building from the config is the user's: a
    :class:`UsageError` with the message alone."""
    try:
        yield
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, (ValueError, TypeError)):
            raise UsageError(str(cause)) from err
        if isinstance(cause, ImportError):  # a `_target_` that is not there: Hydra's text names it and its key
            raise UsageError(" ".join(line.strip() for line in str(err).splitlines() if line.strip())) from err
        raise
    except (ValueError, MisconfigurationException, HydraException) as err:
        raise UsageError(composition_message(err) if isinstance(err, HydraException) else str(err)) from err
    except OmegaConfBaseException as err:  # e.g. an interpolation that does not resolve
        raise UsageError(str(err).splitlines()[0]) from err


class SetupFinished(pl.Callback):
    """Whether the strategy's setup finished (``on_fit_start`` runs after it): a ``ValueError`` before that is a
    layout the strategy refused (too few blocks for the stages, a size that does not divide), the user's to fix."""

    reached = False

    def on_fit_start(self, trainer, pl_module):
        self.reached = True


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


def streamed_weights(cfg: DictConfig) -> bool:
    """``model.weights`` handed to the strategy's ``weights=`` (each rank reads its share), where it takes one;
    the module is then built by ``trainer.init_module(empty_init=True)``."""
    if cfg.model.get("weights") is None or "weights" not in cfg.strategy or cfg.strategy.weights is not None:
        return False
    cfg.strategy.weights, cfg.strategy.weights_prefix, cfg.model.weights = cfg.model.weights, "model.", None
    return True


def run(cfg: DictConfig, run_dir: str | os.PathLike) -> dict[str, float]:
    """Build everything from ``cfg``, fit (validating at the end), print the summary on rank 0; return the metrics.

    A user's mistake is a :class:`UsageError` raised before any process group starts.
    """
    with user_errors():
        check_run(cfg)
        pl.seed_everything(cfg.seed, workers=True)
        trainer_kw = build_trainer_kwargs(cfg, run_dir)
        datamodule = build_datamodule(cfg.data)
        streamed = streamed_weights(cfg)
        strategy = build_strategy(cfg.strategy)
        callbacks = trainer_kw["callbacks"]
        callbacks.append(LogConfig(OmegaConf.to_container(cfg, resolve=True)))
        if cfg.validate_at_end:
            callbacks.append(ValidateAtLastStep())
        if cfg.metrics:
            callbacks.append(ParallelMetrics())
        started = SetupFinished()
        callbacks.append(started)
        trainer = pl.Trainer(strategy=strategy, **trainer_kw)
        with trainer.init_module(empty_init=True) if streamed else nullcontext():
            model = build_model(cfg.model, datamodule)
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=resume_path(cfg))
    except ValueError as err:  # a strategy refuses a layout at setup with a message naming the value and the fix
        if started.reached:
            raise
        if trainer.global_rank != 0:  # every rank refuses alike; rank 0 says it once
            raise SystemExit(USAGE_EXIT) from err
        raise UsageError(str(err)) from err
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        _print_summary(metrics, getattr(datamodule, "loss_floor", None), run_dir)
    return metrics


@rank_zero_only
def _print_summary(metrics: dict[str, float], loss_floor: float | None, run_dir) -> None:
    print(f"\nrun dir: {run_dir}", flush=True)
    print("\n".join(summary_lines(metrics, loss_floor)), flush=True)


register_configs()


def precheck(argv: Sequence[str]) -> None:
    """Compose the config of a plain run (``key=value`` arguments only) and check it, so that a mistake is one
    message and exit 2 before Hydra starts the run ([Note: user errors on the command line] in cli_errors)."""
    if any(a.startswith("-") for a in argv):  # Hydra's own flags (-m, --cfg, -cn, ...): Hydra handles the run
        return
    overrides = [a for a in argv if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    from hydra import compose, initialize_config_dir

    with user_errors(), initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        check_run(cfg)
        build_strategy(cfg.strategy)  # its own argument checks; a strategy starts nothing when constructed


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def app(cfg: DictConfig) -> None:
    # Lightning 2.6 calls an API that torch 2.13 deprecates, once per step; nothing the user can act on
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    hydra_cfg = HydraConfig.get()

    def body() -> None:
        with user_errors():
            check_multirun(cfg, multirun=hydra_cfg.mode == RunMode.MULTIRUN)
        run(cfg, hydra_cfg.runtime.output_dir)

    run_cli(PROG, body)


def main() -> None:
    """The console script: ``--version``, the up-front checks, then the Hydra app (the current directory
    importable for ``_target_=my_pkg.X``)."""
    argv = sys.argv[1:]
    if "--version" in argv:  # before Hydra's parser, which has a --version of its own (Hydra's)
        print(version_text(PROG))
        return
    cwd_importable()
    run_cli(PROG, lambda: precheck(argv))
    app()


if __name__ == "__main__":
    main()
