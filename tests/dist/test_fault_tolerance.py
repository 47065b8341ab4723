"""DataParallelStrategy(fault_tolerance="torchft"): a torchft lighthouse and two replica groups (one CPU rank each,
each group forked from here as its torchrun would run it: [Note: replica groups by fork] in tests/ft_groups.py) on
this machine; one group's process is SIGKILLed mid-run.

The jobs are :mod:`lightning_par.recipes._ft_job` (a plain LightningModule: MLP regressor, AdamW, per-step StepLR);
every step each process records its global_step, torchft's step, the live groups and digests of its parameters
and optimizer state, which these tests compare.
"""
import pytest
import torch

from ft_groups import fork_group
from harness import TIMEOUT_S, fork_as_torchrun
from lightning_par.recipes import _ft_job as job

RUN_S = 200  # the whole launch; the tests' own timeout is above it


def _launch(tmp_path, *, steps: int, sleep: float, kill_after: int = 3):
    """``steps`` steps; group 1's process is SIGKILLed after ``kill_after`` and not restarted."""
    lighthouse, address = job.start_lighthouse(min_replicas=1)
    args = ["--steps", str(steps), "--sleep", str(sleep), "--width", "16"]
    groups = [fork_group(tmp_path, args, group_id=g, num_groups=2, lighthouse=address, max_restarts=0)
              for g in range(2)]
    try:
        kill_time, kill_step = job.kill_after(tmp_path, 1, kill_after, timeout_s=RUN_S, procs=groups)
        codes = job.wait_all(groups, timeout_s=RUN_S)
    finally:
        job.stop(groups, lighthouse)
    return codes, job.summarize_kill(tmp_path, survivor=0, killed=1, kill_time=kill_time, kill_step=kill_step)


# A killed replica group that its torchrun restarts and that rejoins with the survivor's exact state, record by record:
# the fault_tolerance recipe's quick run makes that launch (tests/dist/test_recipes.py, `_assert_torchft_launch`).


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_survivor_trains_to_the_end_when_the_lost_replica_never_returns(tmp_path):
    steps = 40
    codes, res = _launch(tmp_path, steps=steps, sleep=0.1)
    assert codes[0] == 0 and codes[1] != 0, (job.log_tail(tmp_path, "g0"), codes)
    assert res["killed"] and not res["recovered"] and res["recovery_s"] is None
    alive = job.read_records(tmp_path, 0)
    assert [r["step"] for r in alive] == list(range(alive[0]["step"], steps + 1)) and res["steps_agree"]
    assert alive[0]["step"] <= 3 and alive[0]["healed_at"] in (None, alive[0]["step"] - 1)
    after = [r for r in alive if r["step"] > res["kill_step"]]
    assert after and all(r["participants"] == 1 for r in after)  # min_replicas=1: alone to the end
    assert res["steps_alone"] == steps - res["kill_step"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_replica_groups_average_gradients_as_ddp(tmp_path):
    """No kill: two replica groups under a lighthouse that waits for both train as 2-rank DDP on the same batches."""
    steps, args = 20, ["--steps", "20", "--sleep", "0", "--width", "16", "--ckpt-every", "10"]
    ft, ddp = tmp_path / "ft", tmp_path / "ddp"
    lighthouse, address = job.start_lighthouse(min_replicas=2)  # the first quorum holds both groups
    procs = []
    try:
        for path in (ft, ddp):
            path.mkdir()
        procs = [fork_group(ft, args, group_id=g, num_groups=2, lighthouse=address, max_restarts=0)
                 for g in range(2)]
        # the 2-rank DDP reference forked from here while the groups run ([Note: a reference run by fork, as
        # torchrun's ranks] in harness.py); a failed rank raises with its exit
        fork_as_torchrun(lambda: job.main(["--out", str(ddp), "--mode", "ckpt", *args]), 2,
                         str(ddp / "torchrun-ckpt.log"))
        codes = job.wait_all(procs, timeout_s=RUN_S)
    finally:
        job.stop(procs, lighthouse)
    assert codes == [0, 0], codes
    for rank in range(2):
        got, want = job.read_records(ft, rank), job.read_records(ddp, rank)
        assert [r["step"] for r in got] == list(range(1, steps + 1)) and all(r["participants"] == 2 for r in got)
        assert len(want) == steps
        # fp32 round-off only (torchft sums then divides, DDP divides then sums); a lost or unaveraged gradient is >1e-3
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want)) <= 1e-5
    ft_state = torch.load(ft / "ckpt-g1" / "last.ckpt", weights_only=False)
    ddp_state = torch.load(ddp / "ckpt" / "last.ckpt", weights_only=False)
    assert ft_state["global_step"] == ddp_state["global_step"] == steps
    torch.testing.assert_close(ft_state["state_dict"], ddp_state["state_dict"], atol=1e-5, rtol=1e-5)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_whole_job_restart_resumes_every_group_from_its_checkpoint(tmp_path):
    """Both groups stop after 10 steps; relaunched with ckpt_path="last" they continue at step 11 in one quorum,
    torchft's step taken from the checkpoint."""
    procs = []
    lighthouse, address = job.start_lighthouse(min_replicas=2)
    try:
        for attempt, steps in ((0, 10), (1, 16)):
            args = ["--steps", str(steps), "--sleep", "0", "--width", "16", "--ckpt-every", "5", "--resume"]
            procs = [fork_group(tmp_path, args, group_id=g, num_groups=2, lighthouse=address, max_restarts=0,
                                attempt=attempt) for g in range(2)]
            assert job.wait_all(procs, timeout_s=RUN_S) == [0, 0], job.log_tail(tmp_path, "g1")
    finally:
        job.stop(procs, lighthouse)
    records = [job.read_records(tmp_path, g) for g in range(2)]
    for rows in records:
        assert [r["step"] for r in rows] == list(range(1, 17)) and [r["restart"] for r in rows] == [0] * 10 + [1] * 6
        assert all(r["step"] == r["ft_step"] and r["participants"] == 2 for r in rows)
        assert rows[10]["before"] == rows[9]["after"]  # resumed from the step-10 checkpoint exactly
    assert [r["after"] for r in records[0]] == [r["after"] for r in records[1]]


def test_fault_tolerance_refuses_a_launch_without_torchft_variables(monkeypatch):
    from lightning_par.dp.ft import ReplicaGroup

    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE.*torchft_lighthouse"):
        ReplicaGroup.from_env()
    with pytest.raises(RuntimeError, match="REPLICA_GROUP_ID=2 must be in 0..NUM_REPLICA_GROUPS-1"):
        ReplicaGroup.from_env({"REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://h:1"})


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("case, match", [
    ("two ranks", r"ValueError: `fault_tolerance='torchft'` runs one rank per replica group \(this group has 2"),
    ("accumulate", r"ValueError: `fault_tolerance='torchft'` does not support `accumulate_grad_batches=2`: a step "
                   r"that loses a peer is retried"),
    ("manual", r"ValueError: `fault_tolerance='torchft'` supports automatic optimization only: Manual sets "
               r"`automatic_optimization = False`"),
])
def test_fault_tolerance_refuses_at_setup_what_it_cannot_retry(case, match, monkeypatch):
    import lightning.pytorch as pl
    from torch.multiprocessing.spawn import ProcessRaisedException

    from lightning_par import DataParallelStrategy

    class Manual(job.Regressor):
        def __init__(self):
            super().__init__(width=8)
            self.automatic_optimization = False

    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:1")  # never reached: refused before
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                         strategy=DataParallelStrategy(fault_tolerance="torchft", start_method="fork"),
                         accumulate_grad_batches=2 if case == "accumulate" else 1, enable_progress_bar=False)

    module = Manual() if case == "manual" else job.Regressor(width=8)
    with pytest.raises(ProcessRaisedException, match=match):  # on both ranks, before any replica exists
        trainer.fit(module, torch.utils.data.DataLoader(job.dataset(64), batch_size=8))
