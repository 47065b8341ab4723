"""A user's mistake on a console script is found before anything runs, and its message names the value and the fix
(in this process; tests/dist/test_cli_mistakes.py runs the console scripts themselves)."""
from __future__ import annotations

import pytest

from harness import assert_one_usage_error

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


# -- each console script's own handling, in this process: exit status 2 and one `prog: error:` line, no traceback
# (tests/dist/test_cli_mistakes.py runs each console script once as a user runs it, in a new interpreter)
PROGS = {"lightning_par.train": "lightning-par-train", "lightning_par.advise": "lightning-par-advise",
         "lightning_par.recipe": "lightning-par-recipe", "lightning_par.checkpoint.cli": "lightning-par-checkpoint"}


def _as_console(monkeypatch, module: str, args: list[str]):
    """``module``'s ``main``, to be called as its console script with ``args`` (argv, sys.path restored after)."""
    import importlib
    import sys

    monkeypatch.setattr(sys, "argv", [module, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the train script makes the current directory importable
    return importlib.import_module(module).main


def _console(monkeypatch, capsys, module: str, args: list[str]):
    """Run ``module.main()`` as its console script with ``args``; its exit status, stdout and stderr."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    main, code = _as_console(monkeypatch, module, args), 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# the mistakes a user meets first, and the app's own config errors (Hydra's messages)
CONSOLE_MISTAKES = [
    ("lightning_par.train", ["strategy.comm_hok=fp16"], ["strategy.comm_hok", "comm_hook"]),
    ("lightning_par.train", ["strategy=tensor", "strategy.tensor_parallel_size=2", "trainer.devices=3"],
     ["tensor_parallel_size=2", "data_parallel_size=auto", "world size (3)", "trainer.devices="]),
    ("lightning_par.train", ["ckpt_path=missing.ckpt"], ["ckpt_path=missing.ckpt", "does not exist"]),
    ("lightning_par.train", ["strategy.weights=nothere.safetensors"],
     ["strategy.weights=nothere.safetensors", "does not exist"]),
    ("lightning_par.train", ["trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches=0",
                                                                     "positive integer"]),
    ("lightning_par.train", ["strategy=pipeline", "strategy.schedule=bogus"],
     ["`schedule='bogus'` is not a pipeline schedule"]),
    ("lightning_par.train", ["strategy=bogus"], ["Could not find 'strategy/bogus'"]),
    ("lightning_par.train", ["strategy.not_a_key=1"], ["not_a_key"]),
    ("lightning_par.advise", ["model.n_layr=4"], ["model.n_layr", "n_layer"]),
    ("lightning_par.advise", ["--bogus"], ["--bogus"]),
    ("lightning_par.recipe", ["parity", "--quick", "trainer.max_steps=2"], ["trainer.max_steps",
                                                                          "did you mean `max_steps=`"]),
    ("lightning_par.recipe", ["parity", "--bogus"], ["--bogus"]),
]


@pytest.mark.parametrize("module, args, named", CONSOLE_MISTAKES,
                         ids=[f"{m.split('.')[1]} {' '.join(a)}" for m, a, _ in CONSOLE_MISTAKES])
def test_console_script_mistake_is_one_message_and_exit_2(tmp_path, monkeypatch, capsys, module, args, named):
    monkeypatch.chdir(tmp_path)
    extra = {"lightning_par.train": [f"hydra.run.dir={tmp_path / 'run'}"],
             "lightning_par.recipe": ["--out", str(tmp_path / "run")]}.get(module, [])
    text = assert_one_usage_error(*_console(monkeypatch, capsys, module, [*args, *extra]), PROGS[module], *named)
    assert "unrecognized arguments: trainer" not in text
    assert not (tmp_path / "run").exists()  # nothing started: no run dir, no logs, no checkpoints


@pytest.mark.parametrize("module, args", [("lightning_par.train", ["ckpt_path=missing.ckpt"]),
                                          ("lightning_par.advise", ["model.n_layr=4", "--debug"])])
def test_console_script_traceback_on_request(tmp_path, monkeypatch, capsys, module, args):
    """``HYDRA_FULL_ERROR=1`` (or ``--debug``): the error propagates with its traceback."""
    from lightning_par.cli_errors import UsageError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1" if "--debug" not in args else "0")
    main = _as_console(monkeypatch, module, args)
    with pytest.raises(UsageError, match="missing.ckpt|n_layr"):
        main()


@pytest.mark.parametrize("module", list(PROGS))
def test_console_script_version(monkeypatch, capsys, module):
    code, out, err = _console(monkeypatch, capsys, module, ["--version"])
    assert code == 0 and out.startswith(f"{PROGS[module]} ") and "torch" in out, err[-2000:]


# the advisor's flag values, through its parser
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


def test_train_misspelled_key_is_one_short_line(tmp_path, monkeypatch, capsys):
    """The whole of stderr is one line naming the key, the schema and the valid keys (the console script's own
    handling, as a user meets it; tests/unit/test_configs.py checks the message at composition)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = _console(monkeypatch, capsys, "lightning_par.train",
                            ["strategy.comm_hok=fp16", f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 2
    assert ("`strategy.comm_hok` is not a setting of strategy (DataParallelStrategyConfig); valid keys: " in err
            and "Traceback" not in err)
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
