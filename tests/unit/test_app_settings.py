"""The Hydra app's settings outside the config groups: precision on CPU (16-mixed is really float16 there), the
accelerator, the Trainer's arguments from the config, and where a run writes (one directory for externally launched
processes)."""
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from app_config import compose_app
from lightning_par import config as schemas
from lightning_par import train
from lightning_par.paths import conf_dir, recipes_dir
from lightning_par.precision import precision_kwargs, resolve_accelerator


# ---------------------------------------------------------------------------------------- precision


def test_16_mixed_on_cpu_is_really_float16_with_a_scaler():
    kw = precision_kwargs("16-mixed", "cpu")
    assert "precision" not in kw
    (plugin,) = kw["plugins"]
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed"
    assert isinstance(plugin.scaler, torch.amp.GradScaler)
    with plugin.forward_context():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, **kw)
    assert trainer.precision_plugin is plugin and trainer.precision == "16-mixed"


def test_lightning_alone_would_have_given_bf16_on_cpu():
    """The reason for the plugin: a plain `precision="16-mixed"` autocasts to bfloat16 on CPU."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, precision="16-mixed")
    with trainer.precision_plugin.forward_context():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_other_precisions_pass_through(precision):
    assert precision_kwargs(precision, "cpu") == {"precision": precision}
    assert precision_kwargs("16-mixed", "cuda") == {"precision": "16-mixed"}


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match=r"trainer.precision='fp8' .*32-true, bf16-mixed, 16-mixed, bf16-true"):
        precision_kwargs("fp8", "cpu")


def test_resolve_accelerator():
    assert resolve_accelerator("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_accelerator("GPU") == "cuda" and resolve_accelerator("cpu") == "cpu"


def test_trainer_kwargs_from_the_config(tmp_path):
    cfg = compose_app("trainer.precision=16-mixed", "trainer.accumulate_grad_batches=4", "trainer.accelerator=cpu")
    kw = train.build_trainer_kwargs(cfg, tmp_path)
    assert kw["accumulate_grad_batches"] == 4 and kw["devices"] == 2 and "precision" not in kw
    assert isinstance(kw["plugins"][0], MixedPrecision)
    assert isinstance(kw["logger"][0], CSVLogger) and kw["logger"][0].save_dir == str(tmp_path)
    (ckpt,) = [c for c in kw["callbacks"] if isinstance(c, ModelCheckpoint)]
    assert ckpt.dirpath == str(tmp_path / "checkpoints") and ckpt.save_last


def test_devices_follow_torchrun_when_auto(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    cfg = compose_app("trainer.devices=auto")
    assert train.build_trainer_kwargs(cfg, "run")["devices"] == 3


# -------------------------------------------------------------------------------------- paths, run dir


def test_conf_and_recipes_are_found():
    assert (conf_dir() / "config.yaml").is_file()
    assert recipes_dir().is_dir()


@pytest.mark.parametrize("env, expected", [
    ({"TORCHELASTIC_RUN_ID": "r42"}, "outputs/torchrun-r42"),
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "8"}, "outputs/slurm-77-3"),
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "1"}, "outputs/20"),  # one task: by time
    ({"SLURM_JOB_ID": "77"}, "outputs/20"),  # inside an allocation, not under srun: by time
])
def test_run_dir_is_shared_by_externally_launched_processes(monkeypatch, env, expected):
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert schemas.run_dir("outputs").startswith(expected)


def test_run_dir_by_launch_time_is_stable_within_a_process(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    first = schemas.run_dir("outputs")
    assert first.startswith("outputs/20") and schemas.run_dir("outputs") == first


def test_summary_lines():
    lines = train.summary_lines({"train_loss": torch.tensor(2.5), "val_loss": 2.25}, 2.125)
    assert lines == ["train_loss                 2.5000", "val_loss                   2.2500",
                     "loss floor (entropy rate)  2.1250"]
    assert train.summary_lines({}, None)[2].endswith("unknown for this data")
