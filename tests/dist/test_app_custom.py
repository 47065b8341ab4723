"""``lightning-par-train`` on a user's own package (examples/hydra_custom), from the command line: 2 CPU ranks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hydra_custom"


@pytest.mark.timeout(300)
def test_app_trains_a_users_module_and_data_with_their_logger_and_callback(tmp_path):
    run_dir, logs, mine = tmp_path / "run", tmp_path / "logs", tmp_path / "mine"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_par.train",
               "model=custom", "model._target_=my_pkg.MyModule", "+model.hidden=16", "+model.depth=2",
               "data=custom", "data._target_=my_pkg.MyData", "+data.batch_size=8", "+data.samples=128",
               "trainer.max_steps=3", "trainer.devices=2", "strategy.start_method=fork",
               "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0", "metrics=false",
               "+trainer.logger._target_=lightning.pytorch.loggers.CSVLogger", f"+trainer.logger.save_dir={logs}",
               f"+trainer.callbacks=[{{_target_: lightning.pytorch.callbacks.ModelCheckpoint, dirpath: '{mine}', "
               f"filename: mine}}]",
               "+trainer.max_time=00:00:05:00", f"hydra.run.dir={run_dir}"]
    res = subprocess.run(command, cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    sys.path.insert(0, str(EXAMPLE))
    try:
        from my_pkg import MyModule
    finally:
        sys.path.remove(str(EXAMPLE))
    # the user's checkpoint callback replaced the app's, and holds the user's module after 3 steps
    assert not (run_dir / "checkpoints").exists()
    ckpt = torch.load(mine / "mine.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["hyper_parameters"]["hidden"] == 16
    model = MyModule.load_from_checkpoint(mine / "mine.ckpt", map_location="cpu")
    assert model.hparams.hidden == 16 and len(model.blocks) == 2
    # the user's logger replaced the app's (no csv/ under the run dir), and recorded the 3 steps
    (metrics,) = logs.glob("lightning_logs/version_*/metrics.csv")
    assert len([line for line in metrics.read_text().splitlines()[1:] if line.split(",")[-1]]) >= 1
    assert not (run_dir / "csv").exists()
    assert res.stdout.count("train_loss ") == 1  # the summary, once (rank 0)
