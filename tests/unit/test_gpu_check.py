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


def test_the_compiled_rows_dry_run_on_cpu(tmp_path):
    """``--accelerator cpu --tiny``: a strategy eager and with ``compile=True`` (inductor, bf16-mixed), side by
    side: both train, the compiled row has its tokens/s over the eager row's and its first step (the compile)."""
    import json

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--accelerator", "cpu", "--tiny", "--json", str(out),
                           "--only", "data_parallel,data_parallel compile"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"data_parallel", "data_parallel compile"}
    eager, compiled = rows["data_parallel"], rows["data_parallel compile"]
    assert compiled["vs_eager"] > 0 and compiled["first_step_s"] > 0 and compiled["tokens_per_s"] > 0
    # bf16-mixed: inductor and eager round the same products to bf16 (8 bits of mantissa, 2^-8 ~ 0.4% relative)
    # in another order; over 6 steps the tiny GPT's loss (~3.5) stays within 0.05 of the eager run's
    assert max(abs(a - b) for a, b in zip(compiled["losses"], eager["losses"])) < 0.05
    assert "vs eager" in done.stdout
