"""A process killed at any moment of a save leaves every checkpoint under its final name complete and
loadable ([Note: atomic checkpoints] in lightning_par/atomic.py): tests/dist/saver.py saves files and
torch.distributed.checkpoint directories as the strategies do and is SIGKILLed mid-save, at random
moments and at each step of the protocol; everything left under a final name must load, whole.

saver.py runs in a child forked from this process (what is killed is a process of its own; a fresh
interpreter would add only ~5 s of imports per run), as ``python tests/dist/saver.py`` runs it by hand."""
import gc
import os
import signal
import time
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_par.checkpoint import read_meta
from lightning_par.strategies._checkpoint_io import AtomicCheckpointIO

N = 1 << 20


class Saver:
    """saver.py's ``main(folder, mode)`` in a forked child, its stderr kept in a pipe."""

    def __init__(self, folder, mode):
        import saver

        gc.collect()  # [Note: collect before fork] in lightning_par/strategies/_materialize.py
        read_end, write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: save as told (the modes that die kill themselves), never return
            os.close(read_end)
            os.dup2(write_end, 2)
            try:
                saver.main(str(folder), mode)
            except BaseException:  # noqa: BLE001 -- reported through the pipe
                traceback.print_exc()
            os._exit(1)
        os.close(write_end)
        self.err, self.status = os.fdopen(read_end, "rb"), None

    def poll(self):
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status

    def wait(self, timeout: float = 120.0):
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() > deadline:
                self.kill()
                raise TimeoutError(f"saver.py did not end within {timeout} s")
            time.sleep(0.01)
        return self.status

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def stderr(self) -> str:
        self.kill()
        self.wait()
        return self.err.read().decode()[-2000:]


def run_saver(folder, mode, kill_after=None):
    proc = Saver(folder, mode)
    try:
        if kill_after is None:
            assert proc.wait() == -9, proc.stderr()  # it died where it was told to
            return
        deadline = time.time() + 120
        while not any(n.endswith(".ckpt") for n in os.listdir(folder)):  # started, saving
            assert proc.poll() is None and time.time() < deadline, proc.stderr()
            time.sleep(0.02)
        time.sleep(kill_after)
    finally:
        proc.kill()
        proc.wait()
        proc.err.close()


def check_all_loadable(folder) -> dict:
    """Every visible entry loads whole (each tensor holds its own step everywhere); returns name -> step."""
    steps = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("."):
            continue  # temporaries of killed saves
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            meta = read_meta(path)
            state = {"state_dict": {"w": torch.empty(N), "b": torch.empty(7)}}
            dcp.load(state, checkpoint_id=path)
            tensors, step = state["state_dict"], meta["global_step"]
        else:
            ckpt = torch.load(path, weights_only=True)
            tensors, step = ckpt["state_dict"], ckpt["global_step"]
        for t in tensors.values():
            assert torch.equal(t, torch.full_like(t, float(step))), f"{name}: torn (step {step})"
        steps[name] = step
    return steps


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_killed_at_random_moments_of_saving_in_a_loop(tmp_path):
    seen = set()
    for k, delay in enumerate([0.0, 0.05, 0.12, 0.25, 0.45]):
        folder = tmp_path / f"run{k}"
        folder.mkdir()
        run_saver(folder, "loop", kill_after=delay)
        steps = check_all_loadable(folder)
        assert steps, f"nothing under a final name after {delay} s"
        seen |= {n for n in os.listdir(folder) if n.startswith(".")}
    # the kills did land mid-save: some runs left a temporary behind
    assert seen, "no kill caught a save in the middle; the test proves nothing"


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["write", "write_dir", "replace", "aside"])
def test_killed_at_each_step_of_a_save(tmp_path, point):
    run_saver(tmp_path, point)
    steps = check_all_loadable(tmp_path)
    # the step-1 checkpoints saved before are intact; the killed save of step 2 published nothing
    if point == "aside":  # the old directory sits aside (whole), none under the final name
        assert steps == {"ckpt0.ckpt": 1}
        assert read_meta(tmp_path / ".dcp0.old")["global_step"] == 1
    else:
        assert steps == {"ckpt0.ckpt": 1, "dcp0": 1}
    # the next save of those names works and cleans up after the killed one
    import saver

    saver.save_file(str(tmp_path), "ckpt0.ckpt", 3)
    saver.save_dir(str(tmp_path), "dcp0", 3)
    assert check_all_loadable(tmp_path) == {"ckpt0.ckpt": 3, "dcp0": 3}
    assert not {".dcp0.partial", ".dcp0.old"} & set(os.listdir(tmp_path))


@pytest.mark.parametrize("cls", [DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy])
def test_the_strategies_write_files_atomically_by_default(cls):
    assert type(cls().checkpoint_io) is AtomicCheckpointIO
