"""sync="diloco" with fault_tolerance="torchft": a torchft lighthouse and two replica groups (each run as a torchrun
would run it: [Note: replica groups by fork] in tests/ft_groups.py; :mod:`lightning_par.recipes._ft_job`), on
DataParallelStrategy (one CPU rank a group) and on the hybrid core (a two-stage pipeline a group, as
tests/dist/test_fault_tolerance_core.py); one group's process is SIGKILLed between syncs and restarted by its agent:
it rejoins at the start of the next sync's step with the survivor's state, the outer optimizer's among it ([Note:
syncs on torchft's quorum] in lightning_par.dp.local_sgd, [Note: periodic sync under torchft, one wiring] in
lightning_par.strategies._fault_tolerance)."""
import math

import pytest

from ft_groups import fork_group
from harness import TIMEOUT_S
from lightning_par.recipes import _ft_job as job

RUN_S = 200
EVERY = 4


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_killed_diloco_replica_rejoins_with_the_outer_state(tmp_path):
    lighthouse, address = job.start_lighthouse(min_replicas=1)
    args = ["--steps", "2000", "--sleep", "0.2", "--width", "16", "--sync", "diloco", "--sync-every", str(EVERY)]
    groups = [fork_group(tmp_path, args, group_id=g, num_groups=2, lighthouse=address,
                         max_restarts=1 if g == 1 else 0) for g in range(2)]
    try:
        _, kill_step = job.kill_after(tmp_path, 1, 2 * EVERY + 2, timeout_s=RUN_S, procs=groups)  # 2 syncs behind it
        stop = job.stop_after_rejoin(tmp_path, 1, 3 * EVERY, every=EVERY, timeout_s=RUN_S, procs=groups)
        codes = job.wait_all(groups, timeout_s=RUN_S)
    finally:
        job.stop(groups, lighthouse)
    assert codes == [0, 0], (job.log_tail(tmp_path, "g0"), job.log_tail(tmp_path, "g1"))
    alive, lost = job.read_records(tmp_path, 0), job.read_records(tmp_path, 1)
    back = [r for r in lost if r["restart"] == 1]
    assert any(r["restart"] == 0 for r in lost) and back and back[0]["healed_at"] is not None, back[:1]
    by_step = {r["step"]: r for r in alive}
    assert [r["step"] for r in alive] == list(range(alive[0]["step"], stop + 1))  # the survivor lost no step
    first = back[0]
    # restarted from other random weights (seed 1), it received the survivor's state at the start of a sync's step:
    # parameters, AdamW moments, and DiLoCo's last synced parameters and outer momentum
    assert first["step"] % EVERY == 0 and first["step"] > kill_step, (first["step"], kill_step)
    assert first["before"] == by_step[first["step"]]["before"]
    synced = [r for r in back if r["step"] % EVERY == 0]
    assert len(synced) >= 3 and synced[-1]["step"] == stop
    for r in synced:  # every sync after the rejoin: one model (the synced copy, copied into the parameters) and one
        # outer momentum; the AdamW moments ("after" digests them too) stay each replica's own
        assert r["sync"] == by_step[r["step"]]["sync"], r["step"]
        assert r["participants"] == 2
    apart = [r for r in back if r["step"] % EVERY]
    assert apart and all(r["after"] != by_step[r["step"]]["after"] for r in apart)  # own shards between syncs
    assert any(r["participants"] == 1 for r in alive if r["step"] % EVERY == 0)  # the survivor synced alone


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_killed_pipeline_group_rejoins_diloco_with_each_stages_outer_state(tmp_path):
    """HybridParallelStrategy(pipeline_parallel_size=2, sync="diloco"): the second stage of group 1 dies, its agent
    restarts both of its ranks, and each receives the state of its stage (parameters, AdamW moments, DiLoCo's synced
    copy and outer momentum of that stage) from the survivor's rank of the same stage."""
    lighthouse, address = job.start_lighthouse(min_replicas=1)
    args = ["--steps", "2000", "--sleep", "0.2", "--width", "16", "--pp", "2", "--sync", "diloco",
            "--sync-every", str(EVERY), "--ft-timeout", "30", "--ckpt-every", "1000"]
    groups = [fork_group(tmp_path, args, group_id=g, num_groups=2, lighthouse=address, nproc=2,
                         max_restarts=1 if g == 1 else 0) for g in range(2)]
    try:
        _, kill_step = job.kill_after(tmp_path, "1_1", 2 * EVERY + 2, timeout_s=RUN_S, procs=groups)
        stop = job.stop_after_rejoin(tmp_path, "1_0", 2 * EVERY, every=EVERY, timeout_s=RUN_S, procs=groups)
        codes = job.wait_all(groups, timeout_s=RUN_S)
    finally:
        job.stop(groups, lighthouse)
    assert codes == [0, 0], (job.log_tail(tmp_path, "g0"), job.log_tail(tmp_path, "g1"))
    for rank in range(2):  # each stage of the restarted group against the same stage of the survivor
        alive, lost = job.read_records(tmp_path, f"0_{rank}"), job.read_records(tmp_path, f"1_{rank}")
        back = [r for r in lost if r["restart"] == 1]
        assert any(r["restart"] == 0 for r in lost) and back and back[0]["healed_at"] is not None, (rank, back[:1])
        assert all(math.isfinite(r["loss"]) for r in alive + lost), rank
        by_step = {r["step"]: r for r in alive}
        assert [r["step"] for r in alive] == list(range(alive[0]["step"], stop + 1))  # the survivor lost no step
        first = back[0]  # restarted from other random weights (seed 1), healed at the start of a sync's step
        assert first["step"] % EVERY == 0 and first["step"] > kill_step, (rank, first["step"], kill_step)
        assert first["before"] == by_step[first["step"]]["before"], rank
        synced = [r for r in back if r["step"] % EVERY == 0]
        assert len(synced) >= 3 and synced[-1]["step"] == stop, (rank, [r["step"] for r in synced])
        for r in synced:  # after every sync: this stage's parameters, synced copy and outer momentum are the
            # survivor's, bit for bit (an outer state not received would have stepped them elsewhere)
            assert r["params"] == by_step[r["step"]]["params"] and r["sync"] == by_step[r["step"]]["sync"], \
                (rank, r["step"])
            assert r["participants"] == 2, (rank, r["step"])
        apart = [r for r in back if r["step"] % EVERY]
        assert apart and all(r["params"] != by_step[r["step"]]["params"] for r in apart), rank  # own inner steps
        assert any(r["participants"] == 1 for r in alive if r["step"] % EVERY == 0), rank  # the survivor alone
