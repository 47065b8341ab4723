"""``sync="local_sgd" | "diloco"`` on the hybrid core's data axis, composed with pipeline, tensor and context
parallelism inside each replica (4 gloo ranks, fork): against every-step hybrid DP, against each other, against
DataParallelStrategy's streaming DiLoCo, and resumed from a checkpoint between syncs. [Note: periodic sync on the
data axis] in lightning_par/strategies/_periodic_sync.py."""
import os

import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_resumed_exactly, fit_and_record, fit_whole_then_resumed, hybrid, seeded
from models import corpus, sgd_gpt, warm_gpt
from lightning_par.strategies.hybrid_parallel import SYNC_KEY

TOL = dict(atol=1e-5, rtol=1e-5)
LAYOUTS = {"pp2_dp2": dict(pipeline_parallel_size=2, data_parallel_size=2, microbatches=2),
           "tp2_dp2": dict(tensor_parallel_size=2, data_parallel_size=2),
           "cp2_dp2": dict(context_parallel_size=2, data_parallel_size=2)}


def hybrid_at(layout, **kw):
    return hybrid(**LAYOUTS[layout], **kw)


def fit4(tmp, name, strategy, model=warm_gpt, data=None, max_steps=4, **kw):
    train = data if data is not None else corpus().train_set
    return fit_and_record(seeded(model), DataLoader(train, batch_size=4), str(tmp / name), strategy=strategy,
                          devices=4, max_steps=max_steps, **kw)


def assert_same_runs(got, expected, **tol):
    assert len(got) == len(expected) == 4
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(e["losses"]), **tol)
        assert g["params"].keys() == e["params"].keys()
        for name, p in e["params"].items():
            torch.testing.assert_close(g["params"][name], p, **tol, msg=lambda m: f"rank {e['rank']} {name}: {m}")


def replica_peers(layout):
    """Pairs of ranks holding the same shard of the model in the two replicas (mesh pp_dp_tp: tp innermost)."""
    return [(0, 1), (2, 3)] if layout == "pp2_dp2" else [(0, 2), (1, 3)]


def sequence_peers(layout):
    """Pairs of ranks of one replica holding the same whole model (cp2_dp2, mesh dp_cp: cp inner)."""
    return [(0, 1), (2, 3)] if layout == "cp2_dp2" else []


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_local_sgd_every_step_equals_every_step_hybrid_data_parallel_under_sgd(tmp_path, layout):
    every = fit4(tmp_path, "every", hybrid_at(layout), model=sgd_gpt)
    local = fit4(tmp_path, "local", hybrid_at(layout, sync="local_sgd", sync_every=1), model=sgd_gpt)
    assert_same_runs(local, every, **TOL)
    assert all(r["global_step"] == 4 for r in local)


@pytest.mark.timeout(TIMEOUT_S)
def test_diloco_with_outer_lr_one_and_no_momentum_is_local_sgd_under_pipeline_parallelism(tmp_path):
    """AdamW inside, H = 2, 5 steps: two syncs, then a step on each replica's own gradients alone."""
    local = fit4(tmp_path, "local", hybrid_at("pp2_dp2", sync="local_sgd", sync_every=2), max_steps=5)
    diloco = fit4(tmp_path, "diloco", hybrid_at("pp2_dp2", sync="diloco", sync_every=2, outer_lr=1.0,
                                             outer_momentum=0.0), max_steps=5)
    assert_same_runs(diloco, local, **TOL)
    for a, b in replica_peers("pp2_dp2"):  # step 5 was not synced: the replicas are apart (no gradient average)
        assert any(not torch.equal(local[a]["params"][n], local[b]["params"][n]) for n in local[a]["params"])


@pytest.mark.timeout(TIMEOUT_S)
def test_diloco_with_outer_lr_one_and_no_momentum_is_local_sgd_under_context_parallelism(tmp_path):
    """dp 2 × cp 2, AdamW inside, H = 2, 5 steps: between syncs each replica's two ranks still average their
    gradients over the sequence every step (they stay equal), while the replicas part after the unsynced step 5."""
    local = fit4(tmp_path, "local", hybrid_at("cp2_dp2", sync="local_sgd", sync_every=2), max_steps=5)
    diloco = fit4(tmp_path, "diloco", hybrid_at("cp2_dp2", sync="diloco", sync_every=2, outer_lr=1.0,
                                             outer_momentum=0.0), max_steps=5)
    assert_same_runs(diloco, local, **TOL)
    for a, b in sequence_peers("cp2_dp2"):
        assert local[a]["params"].keys() == local[b]["params"].keys()
        assert all(torch.equal(local[a]["params"][n], local[b]["params"][n]) for n in local[a]["params"]), (a, b)
    for a, b in replica_peers("cp2_dp2"):
        assert any(not torch.equal(local[a]["params"][n], local[b]["params"][n]) for n in local[a]["params"])


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("layout, distributed", [("tp2_dp2", False), ("tp2_dp2", True), ("cp2_dp2", False)],
                         ids=["file", "dcp", "cp-file"])
def test_diloco_under_tensor_and_context_parallelism_resumes_exactly_between_syncs(tmp_path, layout, distributed):
    """4 steps an epoch, H = 3: the checkpoint of step 4 is one step past a sync; resumed, steps 5-8 are the
    uninterrupted run's, bit for bit, on every rank (each its own replica's shard and inner state), from one
    file or from a DCP directory; under dp 2 × cp 2 too (each rank the whole model of its replica)."""
    kw = dict(sync="diloco", sync_every=3, save_distributed_checkpoint=distributed)
    whole, resumed, path = fit_whole_then_resumed(fit4, tmp_path, lambda: hybrid_at(layout, **kw),
                                                  data=corpus(train_sequences=32).train_set)
    if not distributed:
        state = torch.load(path, weights_only=False)[SYNC_KEY]
        assert (state["sync"], state["since"], len(state["ranks"])) == ("diloco", 1, 4)
        assert all(state["layout"][k] == v for k, v in LAYOUTS[layout].items()), state["layout"]
    else:
        assert os.path.isdir(path)
    assert_resumed_exactly(whole, resumed, steps=8, resumed_at=4)
    for a, b in replica_peers(layout):  # step 8 was not synced: the replicas are apart
        name = "blocks.0.mlp.fc.weight"
        assert not torch.equal(whole[a]["params"][name], whole[b]["params"][name])


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_streaming_diloco_on_the_core_equals_data_parallel_streaming(tmp_path, layout):
    """fragments = 2, H = 4, 5 steps (fragment 0: embeddings and block 0, synced at step 2; fragment 1: block 1 and
    the head, at step 4): each rank's parameters equal the replica's under DataParallelStrategy's streaming DiLoCo
    on the same batches. Under pp 2 each stage holds one fragment whole and none of the other (its sync of nothing
    is a no-op); under tp 2 each rank syncs its shards; under cp 2 both ranks of a replica sync the same whole copy.
    The inner optimizer is plain SGD: under Adam an entry whose gradient is rounding noise moves by a sizeable
    fraction of lr whichever noise it got ([Note: Adam's response to rounding] in tests/harness.py), and the outer
    Nesterov step carries that on; SGD leaves the comparison to the sync itself, at 1e-5."""
    from lightning_par import DataParallelStrategy

    kw = dict(sync="diloco", sync_every=4, fragments=2)
    dp = fit_and_record(seeded(sgd_gpt), DataLoader(corpus().train_set, batch_size=4), str(tmp_path / "dp"),
                        strategy=DataParallelStrategy(start_method="fork", **kw), devices=2, max_steps=5)
    core = fit4(tmp_path, "core", hybrid_at(layout, **kw), model=sgd_gpt, max_steps=5)
    replica_of = {r: i for peers in replica_peers(layout) for i, r in enumerate(peers)}  # rank -> its dp index
    replica_mean = (torch.tensor(dp[0]["losses"]) + torch.tensor(dp[1]["losses"])) / 2
    for rank, rec in enumerate(core):
        want = dp[replica_of[rank]]  # the core reports the mean over its replicas, DP each rank's own loss
        torch.testing.assert_close(torch.tensor(rec["losses"]), replica_mean, **TOL)
        own = set(rec["grads"][-1])  # the stage's own parameters (a stage may hold others it does not train)
        assert own and own <= set(want["params"])
        for name in own:
            torch.testing.assert_close(rec["params"][name], want["params"][name], **TOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    assert set().union(*(rec["grads"][-1] for rec in core)) == set(dp[0]["grads"][-1])  # every parameter checked
    for a, b in replica_peers(layout):  # step 5 was not synced: the replicas are apart
        assert any(not torch.equal(core[a]["params"][n], core[b]["params"][n]) for n in core[a]["grads"][-1])


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("layout", ["pp2_dp2", "tp2_dp2"])
def test_streaming_diloco_on_the_core_resumes_exactly_with_a_fragment_in_flight(tmp_path, layout):
    """2 steps an epoch, H = 4, 2 fragments: the checkpoint of step 2 is taken while fragment 0's sync is in flight
    (the save finishes it, as the next forward would); resumed, steps 3-8 are the uninterrupted run's on every rank,
    bit for bit (each its stage's or shard's part of both fragments and of the outer state)."""
    kw = dict(sync="diloco", sync_every=4, fragments=2)
    whole, resumed, path = fit_whole_then_resumed(fit4, tmp_path, lambda: hybrid_at(layout, **kw), epochs=4,
                                                  data=corpus(train_sequences=16).train_set)
    state = torch.load(path, weights_only=False)[SYNC_KEY]
    assert (state["since"], len(state["ranks"])) == (2, 4)
    assert all(r["sync"]["fragments"] == 2 for r in state["ranks"]), state["ranks"][0]["sync"]
    assert_resumed_exactly(whole, resumed, steps=8, resumed_at=2)
