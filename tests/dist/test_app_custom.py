"""``lightning-par-train`` on a user's own package (examples/hydra_custom), from the command line: 2 CPU ranks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e  # launches processes (pyproject's markers)

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


TINY_LLAMA = ("{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 2, "
              "num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 64}")


@pytest.mark.timeout(300)
def test_app_trains_a_hugging_face_model_from_a_local_weights_file_under_pipeline(tmp_path):
    """`model=hf model.weights=` under a pipeline of 2 stages: each stage streams its share of the file (lr 0:
    the checkpoint after one step is the file)."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_file, save_model

    from lightning_par.models import HFCausalLM

    torch.manual_seed(3)
    source = HFCausalLM(config=OmegaConf.to_container(OmegaConf.create(TINY_LLAMA))).model
    weights = tmp_path / "model.safetensors"
    save_model(source, str(weights))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_par.train", "model=hf", f"model.config={TINY_LLAMA}",
               f"model.weights={weights}", "model.lr=0.0", "strategy=pipeline", "strategy.start_method=fork",
               "trainer.devices=2", "trainer.max_steps=1", "data.seq_len=16", "data.batch_size=4",
               "data.train_sequences=32", "data.val_sequences=8", "trainer.enable_progress_bar=false",
               "trainer.num_sanity_val_steps=0", "metrics=false", f"hydra.run.dir={run_dir}"]
    res = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    expected = load_file(str(weights))
    assert set(state) == {f"model.{k}" for k in expected}
    for name, value in expected.items():
        torch.testing.assert_close(state[f"model.{name}"], value, rtol=0, atol=0)
    assert 3.0 < float(next(line for line in res.stdout.splitlines() if line.startswith("train_loss ")).split()[1]) < 5
