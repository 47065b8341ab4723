"""benchmarks/gpu_check.py on a machine without CUDA: one "no CUDA" line, exit status 0, nothing written."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # launches processes (pyproject's markers)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, also on a machine that has one
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["no CUDA: benchmarks/gpu_check.py needs a CUDA GPU; nothing was run."]
    assert not out.exists()
