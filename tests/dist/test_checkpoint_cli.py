"""``lightning-par-checkpoint`` as a user runs it, one subprocess per mistake: each ends with exit status 2 and one
message naming the value (no traceback unless ``--debug``); a closed pipe ends quietly; ``--version``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e  # launches processes (pyproject's markers)

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
COMMAND = [sys.executable, "-m", "lightning_par.checkpoint.cli"]


def _run(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *map(str, args)], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120)


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
def test_a_strip_prefix_matching_nothing_is_refused_with_the_real_prefixes(tmp_path, ckpt):
    res = _run("convert", ckpt, "w.safetensors", "--strip-prefix", "foo.", cwd=tmp_path)
    _refused(res, "'foo.'", "'net.' (2)", "'head.' (1)")
    assert not (tmp_path / "w.safetensors").exists()


@pytest.mark.timeout(150)
def test_output_into_a_missing_folder_is_refused_naming_the_folder(tmp_path, ckpt):
    _refused(_run("convert", ckpt, "nowhere/one.ckpt", cwd=tmp_path), f"{tmp_path / 'nowhere'} of nowhere/one.ckpt",
             "mkdir -p")


@pytest.mark.timeout(150)
def test_a_missing_source_is_refused(tmp_path):
    _refused(_run("inspect", "missing.ckpt", cwd=tmp_path), "missing.ckpt does not exist")


@pytest.mark.timeout(150)
def test_debug_shows_the_traceback(tmp_path):
    res = _run("inspect", "missing.ckpt", "--debug", cwd=tmp_path)
    assert res.returncode != 0 and "Traceback" in res.stderr and "missing.ckpt does not exist" in res.stderr


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
def test_version(tmp_path):
    res = _run("--version", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("lightning-par-checkpoint 0.") and "torch 2." in res.stdout
