"""A user's mistake on a console script is found before anything runs, and its message names the value and the fix
(in this process; tests/dist/test_cli_mistakes.py runs the console scripts themselves)."""
from __future__ import annotations

import pytest

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
@pytest.mark.parametrize("args", [["--devices", "0"], ["--device-memory-gb", "-1"], ["--probe-samples", "0"]])
def test_advise_bad_flag_values(args, capsys):
    from lightning_par.advise import parse

    with pytest.raises(SystemExit) as info:
        parse(args)
    assert info.value.code == 2 and args[0] in capsys.readouterr().err


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
