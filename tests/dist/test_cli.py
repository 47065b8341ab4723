"""``lightning-par-train`` end to end, as a user runs it: a subprocess, real ranks, a Hydra run dir."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_par.data import SyntheticCorpus
from lightning_par.models import GPT

pytestmark = pytest.mark.e2e  # launches processes (pyproject's markers)

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "data.seq_len=16", "data.batch_size=4",
        "data.train_sequences=64", "data.val_sequences=16", "trainer.log_every_n_steps=1"]
FLOOR_LINE = "loss floor (entropy rate)"


def _cli(*overrides: str, cwd: Path, timeout: float = 200) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lightning_par.train", *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _summary(stdout: str) -> dict[str, str]:
    return {line[:26].strip(): line[26:].strip() for line in stdout.splitlines()
            if line.startswith(("train_loss ", "val_loss ", FLOOR_LINE))}


def _metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    (path,) = run_dir.glob("csv/version_*/metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(300)
def test_cli_runs_three_ddp_steps_and_writes_config_logs_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    res = _cli("trainer.max_steps=3", *TINY, "strategy.start_method=fork", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    # the summary: printed once (rank 0), with the corpus's exact loss floor
    assert res.stdout.count(FLOOR_LINE) == 1
    summary = _summary(res.stdout)
    floor = SyntheticCorpus(vocab_size=64, seq_len=16, train_sequences=1, val_sequences=1, seed=0).loss_floor
    assert summary[FLOOR_LINE] == f"{floor:.4f}"
    train_loss, val_loss = float(summary["train_loss"]), float(summary["val_loss"])
    assert floor < val_loss < 4.5 and floor < train_loss < 4.5  # ln 64 = 4.16 at init, 3 steps barely move it

    # resolved config
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert config["strategy"]["_target_"].endswith("DataParallelStrategy")
    assert config["strategy"]["start_method"] == "fork" and config["trainer"]["max_steps"] == 3
    assert config["model"]["n_embd"] == 16

    # CSV metrics: one train_loss row per step (log_every_n_steps=1), a val_loss row
    rows = _metrics_rows(run_dir)
    train_rows = [r for r in rows if r.get("train_loss")]
    assert [int(r["step"]) for r in train_rows] == [0, 1, 2]
    # 3 steps end mid-epoch (8 batches per rank): the one validation is the final one, on the last step's weights
    assert [int(r["step"]) for r in rows if r.get("val_loss")] == [2]
    # ParallelMetrics is on by default: its table on rank 0, its perf/* values in the CSV
    assert res.stdout.count("lightning_par metrics") == 1
    comm = [float(r["perf/comm_bytes"]) for r in rows if r.get("perf/comm_bytes")]
    params = sum(p.numel() for p in GPT(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16).parameters())
    assert len(comm) == 1 and comm[0] >= 4 * params  # 2(N-1)/N x gradient bytes for N=2, + control messages
    hparams = yaml.safe_load(next(run_dir.glob("csv/version_*/hparams.yaml")).read_text())
    assert hparams["n_embd"] == 16 and hparams["run_config"]["trainer"]["max_steps"] == 3

    # a consolidated checkpoint that one device can load by the module's own names
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_file()
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 3
    model = GPT.load_from_checkpoint(last, map_location="cpu")
    assert model.hparams.vocab_size == 64 and model.hparams.block_size == 16 and model.hparams.n_embd == 16


@pytest.mark.timeout(300)
def test_cli_under_lightnings_default_popen_launcher(tmp_path):
    """The default launcher re-runs the command per rank with Hydra's run dir; only rank 0 prints the summary."""
    run_dir = tmp_path / "run"
    res = _cli("trainer.max_steps=2", *TINY, "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}",
               cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count(FLOOR_LINE) == 1
    assert (run_dir / "train_ddp_process_1.log").is_file()  # rank 1 ran in the same run dir
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert [int(r["step"]) for r in _metrics_rows(run_dir) if r.get("train_loss")] == [0, 1]


@pytest.mark.timeout(300)
def test_cli_single_device_fp16_with_accumulation(tmp_path):
    run_dir = tmp_path / "run"
    res = _cli("strategy=single", "trainer.max_steps=2", "trainer.precision=16-mixed",
               "trainer.accumulate_grad_batches=2", *TINY, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "bf16" not in res.stdout + res.stderr  # Lightning's silent bf16 substitution did not happen
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2 and "MixedPrecision" in ckpt  # the fp16 grad scaler's state is saved
    assert ckpt["MixedPrecision"]["scale"] > 0
    # Lightning logs per optimizer step: 2 steps, each of 2 accumulated batches
    assert [int(r["step"]) for r in _metrics_rows(run_dir) if r.get("train_loss")] == [0, 1]


@pytest.mark.timeout(300)
def test_cli_hybrid_pp2_tp2(tmp_path):
    """`strategy=hybrid` from the command line: 2 stages × 2 tensor-parallel ranks, the consolidated checkpoint
    loads on one device."""
    run_dir = tmp_path / "run"
    res = _cli("strategy=hybrid", "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=2",
               "trainer.devices=4", "strategy.start_method=fork", "trainer.max_steps=2",
               *[o for o in TINY if not o.startswith("model.n_layer")], "model.n_layer=2",
               f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert config["strategy"]["_target_"].endswith("HybridParallelStrategy")
    assert float(_summary(res.stdout)["train_loss"]) < 4.5
    model = GPT.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", strict=True)
    assert sum(p.numel() for p in model.parameters()) > 0
