"""``lightning-par-checkpoint``'s mistakes: each ends with exit status 2 and one message naming the value (no
traceback unless ``--debug``); a closed pipe ends quietly; ``--version``. Two run as a user runs them (a new
interpreter: the exit status and stderr of a process, a pipe closed under it); the rest call the same ``main`` in
this process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
COMMAND = [sys.executable, "-m", "lightning_par.checkpoint.cli"]


def _run(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *map(str, args)], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120)


@pytest.fixture
def main(monkeypatch, capsys):
    """``main(*args, cwd=...)``: the console script's ``main`` in this process, as a ``CompletedProcess``."""
    from lightning_par.checkpoint import cli

    def run(*args, cwd: Path) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
        argv = list(map(str, args))
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess([*COMMAND, *argv], code or 0, out.out, out.err)

    return run


@pytest.fixture
def ckpt(tmp_path) -> Path:
    torch.save({"state_dict": {"net.w": torch.ones(2, 2), "net.b": torch.zeros(2), "head.w": torch.ones(2)},
                "epoch": 0, "global_step": 1}, tmp_path / "one.ckpt")
    return tmp_path / "one.ckpt"


def _refused(res: subprocess.CompletedProcess, *names: str) -> str:
    """The one message of a refusal, checked: exit 2, no traceback, the values named."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    (message,) = res.stderr.splitlines()
    assert message.startswith("lightning-par-checkpoint: error: "), message
    for name in names:
        assert name in message, (name, message)
    return message


@pytest.mark.timeout(150)
def test_a_strip_prefix_matching_nothing_is_refused_with_the_real_prefixes(tmp_path, ckpt, main):
    res = main("convert", ckpt, "w.safetensors", "--strip-prefix", "foo.", cwd=tmp_path)
    _refused(res, "'foo.'", "'net.' (2)", "'head.' (1)")
    assert not (tmp_path / "w.safetensors").exists()


@pytest.mark.timeout(150)
def test_output_into_a_missing_folder_is_refused_naming_the_folder(tmp_path, ckpt, main):
    _refused(main("convert", ckpt, "nowhere/one.ckpt", cwd=tmp_path), f"{tmp_path / 'nowhere'} of nowhere/one.ckpt",
             "mkdir -p")


@pytest.mark.e2e  # launches a process (pyproject's markers)
@pytest.mark.timeout(150)
def test_a_missing_source_is_refused(tmp_path):
    _refused(_run("inspect", "missing.ckpt", cwd=tmp_path), "missing.ckpt does not exist")


@pytest.mark.timeout(150)
def test_debug_shows_the_traceback(tmp_path, main):
    with pytest.raises(Exception, match="missing.ckpt does not exist"):  # the error itself, with its traceback
        main("inspect", "missing.ckpt", "--debug", cwd=tmp_path)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    torch.save({f"layer{i}.weight": torch.zeros(1) for i in range(20000)}, tmp_path / "many.pt")  # > a pipe's buffer
    proc = subprocess.Popen([*COMMAND, "inspect", "many.pt"], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, stderr
    assert first.endswith("many.pt: a state dict of 20000 tensors (torch.save file, not a Lightning checkpoint)\n")
    assert stderr == "", stderr


@pytest.mark.timeout(150)
def test_version(tmp_path, main):
    res = main("--version", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("lightning-par-checkpoint 0.") and "torch 2." in res.stdout
