"""HybridParallelStrategy(fault_tolerance="torchft"): the replica (dp) axis of the hybrid core under torchft. A
lighthouse and two replica groups, each a two-stage pipeline (2 CPU ranks each) run as a torchrun job would run it
([Note: replica groups by fork] in tests/ft_groups.py); one rank of one group is SIGKILLed mid-run, its agent
restarts that group and each of its ranks rejoins with the state of its stage
from the survivor.

The jobs are :mod:`lightning_par.recipes._ft_job` (a plain LightningModule: input layer, 4 Linear+Tanh blocks, head;
AdamW, per-step StepLR); each rank records its steps and digests of its stage's parameters and optimizer state.
"""
import copy
import io
import json

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from ft_groups import fork_group
from harness import TIMEOUT_S, fork_as_torchrun
from models import corpus, tiny_gpt
from lightning_par.recipes import _ft_job as job

RUN_S = 200
PP = ["--pp", "2", "--width", "16"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_killed_stage_rejoins_with_its_coordinates_state(tmp_path):
    # steps of >= 0.2 s until the restarted group is back, then 10-20 more together (the stop step written to a file
    # the jobs read); the surviving rank of the killed group exits within ft_timeout of its agent's SIGTERM
    args = ["--steps", "2000", "--sleep", "0.2", "--ft-timeout", "10", "--ckpt-every", "10", *PP]
    lighthouse, address = job.start_lighthouse(min_replicas=1)
    groups = [fork_group(tmp_path, args, group_id=g, num_groups=2, lighthouse=address, nproc=2,
                         max_restarts=1 if g == 1 else 0) for g in range(2)]
    try:  # the second stage of group 1 dies; its agent restarts both of its ranks
        kill_time, kill_step = job.kill_after(tmp_path, "1_1", 3, timeout_s=RUN_S, procs=groups)
        steps = job.stop_after_rejoin(tmp_path, "1_0", 10, every=10, timeout_s=RUN_S, procs=groups)
        codes = job.wait_all(groups, timeout_s=RUN_S)
    finally:
        job.stop(groups, lighthouse)
    assert codes == [0, 0], (job.log_tail(tmp_path, "g0"), job.log_tail(tmp_path, "g1"))
    for rank in range(2):  # each stage of the restarted group against the same stage of the survivor
        res = job.summarize_kill(tmp_path, survivor=f"0_{rank}", killed=f"1_{rank}", kill_time=kill_time,
                                 kill_step=kill_step)
        assert res["killed"] and res["recovered"], (rank, res)
        assert res["steps_alone"] >= 1 and res["final_step"] == steps, (rank, res)
        # started from other random weights (seed 1), received its stage's parameters, AdamW moments and step from
        # the survivor's rank of the same stage, bit for bit, and stayed bit-equal at every step after
        assert res["weights_equal_after_recovery"] and res["steps_agree"], (rank, res)
        alive = job.read_records(tmp_path, f"0_{rank}")
        back = [r for r in job.read_records(tmp_path, f"1_{rank}") if r["restart"] == 1]
        assert [r["step"] for r in alive] == list(range(alive[0]["step"], steps + 1)) and alive[0]["step"] <= 3
        assert back[0]["step"] == res["heal_step"] + 1 and back[-1]["step"] == steps
        assert all(r["participants"] == 2 for r in back) and any(r["participants"] == 1 for r in alive)
    # both groups end on the same consolidated checkpoint (every stage), step and learning rate
    assert job.checkpoint_differences(tmp_path, steps) == []
    assert len(torch.load(tmp_path / "ckpt-g1" / "last.ckpt", weights_only=False)["state_dict"]) == 12  # every stage
    text = "\n".join(p.read_text() for p in (tmp_path / "logs1_0").rglob("metrics.csv"))
    assert "train_loss" in text and f",{steps - 1}," in text  # Lightning kept logging in the rejoined group


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_pipeline_groups_train_as_dp2_pp2(tmp_path):
    """No kill: two pp2 replica groups under a lighthouse that waits for both train as one dp2 × pp2 run."""
    steps = 12
    args = ["--steps", str(steps), "--sleep", "0", "--ckpt-every", str(steps), *PP]
    ft, ref = tmp_path / "ft", tmp_path / "ref"
    lighthouse, address = job.start_lighthouse(min_replicas=2)  # the first quorum holds both groups
    procs = []
    try:
        for path in (ft, ref):
            path.mkdir()
        procs = [fork_group(ft, args, group_id=g, num_groups=2, lighthouse=address, max_restarts=0, nproc=2)
                 for g in range(2)]
        # the plain dp2 x pp2 reference on 4 ranks forked from here while the groups run ([Note: a reference run
        # by fork, as torchrun's ranks] in harness.py); a failed rank raises with its exit
        fork_as_torchrun(lambda: job.main(["--out", str(ref), "--mode", "ckpt", *args]), 4,
                         str(ref / "torchrun-ckpt.log"))
        codes = job.wait_all(procs, timeout_s=RUN_S)
    finally:
        job.stop(procs, lighthouse)
    assert codes == [0, 0], (codes, job.log_tail(ft, "g0"), job.log_tail(ref, "ckpt"))
    want = job.read_records(ref, 0)  # rank 0 of dp2 x pp2 reports the mean over its two replicas
    assert [r["step"] for r in want] == list(range(1, steps + 1))
    got = [job.read_records(ft, f"{g}_0") for g in range(2)]  # each group reports its own batch's loss
    for rows in got:
        assert [r["step"] for r in rows] == list(range(1, steps + 1)) and all(r["participants"] == 2 for r in rows)
        assert all(r["step"] == r["ft_step"] for r in rows)
    worst = max(abs((a["loss"] + b["loss"]) / 2 - w["loss"]) for a, b, w in zip(*got, want))
    assert worst <= 1e-5, worst
    ref_state = torch.load(ref / "ckpt" / "last.ckpt", weights_only=False)
    for g in range(2):
        state = torch.load(ft / f"ckpt-g{g}" / "last.ckpt", weights_only=False)
        assert state["global_step"] == ref_state["global_step"] == steps
        torch.testing.assert_close(state["state_dict"], ref_state["state_dict"], atol=1e-5, rtol=1e-5)


def _kinds(optimizer):
    return {i: {k: type(v).__name__ for k, v in e.items()} for i, e in optimizer.state_dict()["state"].items()}


class _ShareRoundTrip(pl.Callback):
    """At the end of a tensor-parallel fit: what this rank would send a recovering peer, through bytes (as torchft's
    transport), loaded back into the module and optimizer after both were spoilt."""

    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, module):
        from lightning_par.dp import ft

        strategy, optimizer = trainer.strategy, trainer.optimizers[0]
        buffer = io.BytesIO()
        torch.save(strategy._ft.own_state(trainer, strategy._engine), buffer)
        sent = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        want = {k: v.clone() for k, v in ft.local_module_state(module).items()}
        want_opt = copy.deepcopy(ft.local_optimizer_state(optimizer))
        kinds = _kinds(optimizer)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
            for entry in optimizer.state.values():
                for v in entry.values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        v.zero_()
        strategy.load_model_state_dict(sent)
        strategy.load_optimizer_state_dict(sent)
        got, got_opt = ft.local_module_state(module), ft.local_optimizer_state(optimizer)
        result = {
            "dtensors": sum(isinstance(p, DTensor) for p in module.parameters()),
            "module": sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want),
            "optimizer": sorted(want_opt["state"]) == sorted(got_opt["state"]) and all(
                torch.equal(torch.as_tensor(v), torch.as_tensor(got_opt["state"][i][k]))
                for i, e in want_opt["state"].items() for k, v in e.items()),
            "kinds": kinds == _kinds(optimizer),  # DTensor state came back as DTensors
            "entries": len(want_opt["state"]),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(TIMEOUT_S)
def test_a_tensor_parallel_rank_takes_its_peers_shard_state(tmp_path):
    """tp2 (no torchft processes): the state a rank sends a recovering peer of its coordinate holds its DTensor
    shards as local tensors, and loading it restores parameters and AdamW state exactly, DTensors as DTensors."""
    from lightning_par import TensorParallelStrategy

    torch.manual_seed(0)
    module = tiny_gpt(n_head=4)
    data = corpus(train_sequences=32)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[_ShareRoundTrip(tmp_path)],
                         strategy=TensorParallelStrategy(tensor_parallel_size=2, start_method="fork", timeout=120))
    trainer.fit(module, DataLoader(data.train_set, batch_size=4))
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["dtensors"] > 0 and res["entries"] > 0, res
        assert res["module"] and res["optimizer"] and res["kinds"], res
