"""A user's mistake on a console script, run as a user runs it: one message naming the value and the fix, exit
status 2, no traceback, before any process group or training starts (a short timeout bounds each run, and no run
dir is made). The other mistakes, and more, go through the same ``main()`` in tests/unit/test_cli_errors.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import assert_one_usage_error

REPO = Path(__file__).resolve().parents[2]
FAST = 60  # seconds: an import of torch + Lightning + Hydra under load; no rank is started (no run dir either)


def _run(module: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=FAST)


def _one_message(res: subprocess.CompletedProcess, prog: str, *named: str) -> str:
    return assert_one_usage_error(res.returncode, res.stdout, res.stderr, prog, *named)


# One mistake per console script, each run as a user runs it (a new interpreter, `python -m`): what only a
# process shows, its exit status and its whole stderr. Every other mistake, the tracebacks on request and
# `--version` go through the same `main()` in tests/unit/test_cli_errors.py (in-process, the same assertions).
@pytest.mark.e2e
@pytest.mark.timeout(2 * FAST)
def test_train_mistake_is_one_message_and_exit_2(tmp_path):
    res = _run("lightning_par.train", "ckpt_path=missing.ckpt", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    _one_message(res, "lightning-par-train", "ckpt_path=missing.ckpt", "does not exist")
    assert not (tmp_path / "run").exists()  # nothing started: no run dir, no logs, no checkpoints


@pytest.mark.e2e
@pytest.mark.timeout(2 * FAST)
def test_advise_mistake_is_one_message_and_exit_2(tmp_path):
    _one_message(_run("lightning_par.advise", "model.n_layr=4", cwd=tmp_path), "lightning-par-advise",
                 "model.n_layr", "n_layer")


@pytest.mark.e2e
@pytest.mark.timeout(2 * FAST)
def test_recipe_mistake_is_one_message_and_exit_2(tmp_path):
    text = _one_message(_run("lightning_par.recipe", "parity", "--quick", "trainer.max_steps=2", "--out",
                             str(tmp_path / "out"), cwd=tmp_path),
                        "lightning-par-recipe", "trainer.max_steps", "did you mean `max_steps=`")
    assert "unrecognized arguments: trainer" not in text and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------- for library users


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


@pytest.mark.e2e
@pytest.mark.timeout(2 * FAST)
def test_context_parallel_on_a_module_without_a_sequence_is_one_message_and_exit_2(tmp_path):
    res = _run("lightning_par.train", "strategy=hybrid", "strategy.context_parallel_size=2", "model=mlp",
               "data=classification", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    _one_message(res, "lightning-par-train", "`MLPClassifier`'s block `layers.0`", "shape [32, 64]",
                 "no sequence dimension to cut", "context_parallel_size=1")
