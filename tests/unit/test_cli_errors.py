"""A user's mistake on a console script: one message naming the value and the fix, exit status 2, no traceback,
before any process group or training starts (each run is bounded by a short timeout to show that)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAST = 60  # seconds: an import of torch + Lightning + Hydra under load; no rank is started (no run dir either)


def _run(module: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=FAST)


def _one_message(res: subprocess.CompletedProcess, prog: str, *named: str) -> str:
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(errors) == 1, out[-3000:]
    for value in named:
        assert value in errors[0], errors[0]
    return errors[0]


TRAIN_MISTAKES = [
    # (overrides, what the message names)
    (["strategy.comm_hok=fp16"], ["strategy.comm_hok", "comm_hook"]),
    (["model.n_layr=4"], ["model.n_layr", "n_layer"]),
    (["trainer.max_steps=ten"], ["trainer.max_steps=ten", "Integer"]),
    (["strategy=tensr"], ["strategy/tensr", "tensor"]),
    (["+trainer.profilr=simple"], ["trainer.profilr", "profiler"]),
    (["trainer.profiler=simple"], ["trainer.profiler", "+trainer.profiler="]),
    (["strategy=tensor", "strategy.tensor_parallel_size=2", "trainer.devices=3"],
     ["tensor_parallel_size=2", "data_parallel_size=auto", "world size (3)", "trainer.devices="]),
    (["ckpt_path=missing.ckpt"], ["ckpt_path=missing.ckpt", "does not exist"]),
    (["strategy.weights=nothere.safetensors"], ["strategy.weights=nothere.safetensors", "does not exist"]),
    (["trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches=0", "positive integer"]),
    (["model=custom", "model._target_=no_such_pkg.Model"], ["model._target_=no_such_pkg.Model", "No module named"]),
    (["model=custom", "model._target_=collections.OrderedDict"], ["collections.OrderedDict", "LightningModule"]),
    (["model=custom", "model._target_=lightning_par.models.GPT", "+model.n_layr=2"], ["model.n_layr", "n_layer"]),
    (["strategy.zero_stage=7"], ["zero_stage=7"]),
    (["strategy=pipeline", "strategy.schedule=zigzag"], ["schedule='zigzag'"]),
    (["data=text"], ["data.path"]),
    (["trainer.max_steps=-1"], ["train forever"]),
    (["+trainer.strategy=ddp"], ["trainer.strategy=ddp", "strategy=<"]),
    (["model=hf"], ["model.config"]),
    (["+sead=3"], ["`sead` is not a setting of the run", "seed"]),
    (["+trainer.logger._target_=nope.Logger"], ["trainer.logger._target_=nope.Logger", "No module named 'nope'"]),
    (["+trainer.callbacks=[{_target_: lightning.pytorch.callbacks.NoSuchCallback}]"],
     ["trainer.callbacks._target_=lightning.pytorch.callbacks.NoSuchCallback", "has no attribute"]),
]


@pytest.mark.parametrize("overrides, named", TRAIN_MISTAKES, ids=[" ".join(o) for o, _ in TRAIN_MISTAKES])
def test_train_mistake_is_found_before_the_run_naming_the_value(tmp_path, monkeypatch, overrides, named):
    """Every mistake, in this process: the up-front check of the console script raises the user's message."""
    from lightning_par import train
    from lightning_par.cli_errors import UsageError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as info:
        train.precheck(overrides)
    text = str(info.value)
    assert "\n" not in text.strip() and all(value in text for value in named), text


# the mistakes a user meets first, each through the real console script
CLI_MISTAKES = [TRAIN_MISTAKES[i] for i in (0, 6, 7, 8, 9)]


@pytest.mark.timeout(2 * FAST)
@pytest.mark.parametrize("overrides, named", CLI_MISTAKES, ids=[" ".join(o) for o, _ in CLI_MISTAKES])
def test_train_mistake_is_one_message_and_exit_2(tmp_path, overrides, named):
    res = _run("lightning_par.train", *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    _one_message(res, "lightning-par-train", *named)
    assert not (tmp_path / "run").exists()  # nothing started: no run dir, no logs, no checkpoints


@pytest.mark.timeout(2 * FAST)
def test_train_traceback_on_request(tmp_path):
    res = _run("lightning_par.train", "ckpt_path=missing.ckpt", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert res.returncode != 0 and "Traceback" in res.stderr and "ckpt_path=missing.ckpt" in res.stderr


@pytest.mark.timeout(3 * FAST)
@pytest.mark.parametrize("module, prog", [("lightning_par.train", "lightning-par-train"),
                                          ("lightning_par.advise", "lightning-par-advise"),
                                          ("lightning_par.recipe", "lightning-par-recipe")])
def test_version(tmp_path, module, prog):
    res = _run(module, "--version", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith(f"{prog} ") and "torch" in res.stdout, res.stderr[-2000:]


@pytest.mark.timeout(2 * FAST)
@pytest.mark.parametrize("args, named", [
    (["model.n_layr=4"], ["model.n_layr", "n_layer"]),
    (["--bogus"], ["--bogus"]),
])
def test_advise_mistake_is_one_message_and_exit_2(tmp_path, args, named):
    _one_message(_run("lightning_par.advise", *args, cwd=tmp_path), "lightning-par-advise", *named)


@pytest.mark.parametrize("args", [["--devices", "0"], ["--device-memory-gb", "-1"], ["--probe-samples", "0"]])
def test_advise_bad_flag_values(args, capsys):
    from lightning_par.advise import parse

    with pytest.raises(SystemExit) as info:
        parse(args)
    assert info.value.code == 2 and args[0] in capsys.readouterr().err


@pytest.mark.timeout(2 * FAST)
def test_advise_traceback_on_debug(tmp_path):
    res = _run("lightning_par.advise", "model.n_layr=4", "--debug", cwd=tmp_path)
    assert res.returncode != 0 and "Traceback" in res.stderr


@pytest.mark.timeout(2 * FAST)
@pytest.mark.parametrize("args, named", [
    (["parity", "--quick", "trainer.max_steps=2"], ["trainer.max_steps", "did you mean `max_steps=`"]),
    (["parity", "--bogus"], ["--bogus"]),
])
def test_recipe_mistake_is_one_message_and_exit_2(tmp_path, args, named):
    text = _one_message(_run("lightning_par.recipe", *args, "--out", str(tmp_path / "out"), cwd=tmp_path),
                        "lightning-par-recipe", *named)
    assert "unrecognized arguments: trainer" not in text and not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, named", [
    (["max_stepz=2"], ["max_stepz", "max_steps"]),
    (["max_steps=abc"], ["max_steps=abc", "an int"]),
    (["steps"], ["`steps`", "key=value"]),
    (["model.n_layr=3"], ["model.n_layr", "model.n_layer"]),
])
def test_recipe_override_mistakes_name_the_key(overrides, named):
    from lightning_par.cli_errors import UsageError
    from lightning_par.recipe import load_config

    with pytest.raises(UsageError) as info:
        load_config("parity", True, overrides)
    assert all(value in str(info.value) for value in named), str(info.value)


def test_recipe_flags_and_overrides_in_any_order():
    from lightning_par.recipe import load_config

    cfg = load_config("parity", True, ["max_steps=2", "trainer.accelerator=cpu"])
    assert cfg.max_steps == 2 and cfg.model.n_layer == 2  # --quick applied under the override
    import argparse

    from lightning_par.cli_errors import ArgumentParser

    p = ArgumentParser(prog="x")
    p.add_argument("name")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--quick", action="store_true")
    args = p.parse_intermixed_args(["parity", "--quick", "a=1", "b=2"])
    assert args.quick and args.overrides == ["a=1", "b=2"] and isinstance(args, argparse.Namespace)


# ------------------------------------------------------------------- the same checks for library users


@pytest.mark.parametrize("make, named, not_named", [
    (lambda: __import__("lightning_par").TensorParallelStrategy(tensor_parallel_size=2, start_method="fork"),
     ["`tensor_parallel_size=2`", "`data_parallel_size=auto` (1)", "world size (3)"], "pipeline_parallel_size"),
    (lambda: __import__("lightning_par").PipelineParallelStrategy(pipeline_parallel_size=2, start_method="fork"),
     ["`pipeline_parallel_size=2`", "`data_parallel_size=auto` (1)", "world size (3)"], "tensor_parallel_size"),
])
def test_a_presets_size_error_names_only_its_own_sizes(make, named, not_named):
    import lightning.pytorch as pl

    with pytest.raises(ValueError) as info:
        pl.Trainer(accelerator="cpu", devices=3, strategy=make(), logger=False)
    assert all(value in str(info.value) for value in named) and not_named not in str(info.value), str(info.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["data_parallel", "tensor_parallel"])
def test_strategies_refuse_accumulate_grad_batches_0_at_setup(strategy):
    """Lightning alone divides by it (a bare ZeroDivisionError); every strategy refuses it in setup."""
    import lightning.pytorch as pl

    from lightning_par.data import SyntheticCorpus
    from lightning_par.models import GPT

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, accumulate_grad_batches=0, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    data = SyntheticCorpus(vocab_size=16, seq_len=8, batch_size=2, train_sequences=8, val_sequences=2)
    try:
        with pytest.raises(ValueError, match=r"`Trainer\(accumulate_grad_batches=0\)` must be a positive integer"):
            trainer.fit(GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16), datamodule=data)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # the one-rank group setup_environment made: no global state left behind
            dist.destroy_process_group()
