"""``torchrun --max-restarts`` restarts the app after a rank is SIGKILLed mid-run; the restarted run resumes
from the last complete checkpoint by itself ([Note: restarts resume by themselves] in lightning_par/train.py)
and ends with the weights and the losses of an uninterrupted run. The run stops with ``max_epochs`` and
checkpoints at epoch ends: Lightning resumes those exactly (README, data order)."""
import functools
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness import assert_only_port_races_after_the_kill, fork_as_torchrun

pytestmark = pytest.mark.e2e  # launches processes (pyproject's markers)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EPOCHS = 4  # killed in the second; the restart resumes at an epoch end and trains at least one more
OVERRIDES = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=-1", f"trainer.max_epochs={EPOCHS}",
             "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1",
             "model.n_layer=2", "model.n_head=2", "model.n_embd=16", "data.vocab_size=32", "data.seq_len=16",
             "data.batch_size=8", "data.train_sequences=256", "data.val_sequences=32", "metrics=false"]


def torchrun(run_dir, *extra, max_restarts=0):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # restarts reconnect (README: torch issue 135712)
    log = open(os.path.join(run_dir + ".log"), "w")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             f"--max-restarts={max_restarts}", "-m", "lightning_par.train", *OVERRIDES, *extra,
                             f"hydra.run.dir={run_dir}"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def app(argv):
    """What ``python -m lightning_par.train ARGV`` runs in a rank, in this process."""
    from lightning_par import train

    sys.argv = ["lightning_par.train", *argv]
    train.main()


def worker_of(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker of global rank ``rank`` (a child of ``parent``), if it runs."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except (OSError, ValueError):
            continue
        if ppid == parent and env.get(b"RANK") == str(rank).encode():
            return int(pid)
    return None


def final_state(run_dir):
    ckpt = torch.load(os.path.join(run_dir, "checkpoints", "last.ckpt"), weights_only=True)
    return ckpt["state_dict"], ckpt["epoch"], ckpt["global_step"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_torchrun_restart_resumes_and_ends_as_an_uninterrupted_run(tmp_path, strategy):
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    # the uninterrupted reference: the same app on 2 ranks forked from here ([Note: a reference run by fork, as
    # torchrun's ranks] in harness.py); a failed rank raises with its exit
    fork_as_torchrun(functools.partial(app, [*OVERRIDES, f"strategy={strategy}", f"hydra.run.dir={ref_dir}"]), 2,
                     ref_dir + ".log")
    # the same run, killed in its second epoch: rank 1 dies once the first epoch's checkpoint exists
    # the second restart is a spare for torchrun's port race only (assert_only_port_races_after_the_kill, below)
    proc = torchrun(run_dir, f"strategy={strategy}", max_restarts=2)
    last, deadline = os.path.join(run_dir, "checkpoints", "last.ckpt"), time.time() + 300
    while not os.path.exists(last):
        assert proc.poll() is None and time.time() < deadline, open(run_dir + ".log").read()[-3000:]
        time.sleep(0.05)
    victim = worker_of(proc.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, open(run_dir + ".log").read()[-3000:]
    log = open(run_dir + ".log").read()
    assert "Restoring states from the checkpoint path at" in log, log[-3000:]  # the restarted run resumed
    assert_only_port_races_after_the_kill(log, killed_local_rank=1)
    ref_state, ref_epoch, ref_step = final_state(ref_dir)
    state, epoch, step = final_state(run_dir)
    assert (epoch, step) == (ref_epoch, ref_step) and epoch == EPOCHS - 1
    assert state.keys() == ref_state.keys()
    diff = max(float((state[n] - t).abs().max()) for n, t in ref_state.items())
    print(f"{strategy}: largest weight difference, restarted vs uninterrupted: {diff:.2e}")
    for name, tensor in ref_state.items():
        torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")
