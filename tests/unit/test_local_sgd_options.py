"""``sync="local_sgd" | "diloco"`` (lightning_par.dp.local_sgd): the options, their refusals by name, the command
line, and the outer step's numbers on one process."""
import doctest

import pytest
import torch

from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                           TensorParallelStrategy, train)
from lightning_par.dp import local_sgd
from app_config import compose_app


def test_doctests():
    assert doctest.testmod(local_sgd).failed == 0


def test_defaults_are_todays_ddp_and_the_papers_outer_step():
    s = DataParallelStrategy()._dp_options.sync
    assert (s.sync, s.sync_every, s.outer_lr, s.outer_momentum, s.fragments) == ("every_step", 1, 0.7, 0.9, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sync="async"), r"`sync='async'` must be one of 'every_step', 'local_sgd', 'diloco'"),
    (dict(sync="diloco", sync_every=0), r"`sync_every=0` must be an integer >= 1"),
    (dict(sync="local_sgd", sync_every=2.5), r"`sync_every=2.5` must be an integer >= 1"),
    (dict(sync="diloco", outer_lr=0), r"`outer_lr=0` must be a finite positive number"),
    (dict(sync="diloco", outer_momentum=1.0), r"`outer_momentum=1.0` must be a number in \[0, 1\)"),
    (dict(sync="diloco", fragments=2), r"`fragments=2` needs `sync_every` to be a multiple of it \(got sync_every=1\)"),
    (dict(sync="diloco", sync_every=6, fragments=4), r"`fragments=4` needs .* Use sync_every=4"),
    (dict(sync="local_sgd", sync_every=4, fragments=2), r"`fragments=2` \(streaming DiLoCo\) needs sync='diloco'"),
    (dict(sync="diloco", sync_every=4, fragments=2, fault_tolerance="torchft"),
     r"`fragments=2` \(streaming DiLoCo\) with `fault_tolerance='torchft'` is not supported"),
    (dict(sync="diloco", zero_stage=1), r"`sync='diloco'` does not support `zero_stage=1`.*Use zero_stage=0"),
    (dict(sync="local_sgd", zero_stage=3), r"`sync='local_sgd'` does not support `zero_stage=3`"),
    (dict(sync="local_sgd", comm_hook="bf16"), r"`sync='local_sgd'` trains each replica without DDP's gradient "
                                               r"all-reduce, so the DDP options comm_hook='bf16' have nothing"),
    (dict(sync="diloco", static_graph=True, bucket_cap_mb=5), r"bucket_cap_mb=5, static_graph=True have nothing .* Drop them"),
])
def test_refused_at_construction_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataParallelStrategy(**kwargs)


def test_fault_tolerance_takes_the_sync():
    s = DataParallelStrategy(sync="diloco", sync_every=8, fault_tolerance="torchft")
    assert s.fault_tolerance == "torchft" and not s._ft.per_step_commit()
    assert DataParallelStrategy(fault_tolerance="torchft")._ft.per_step_commit()


def test_the_hybrid_core_takes_the_sync_options():
    o = HybridParallelStrategy(sync="diloco", sync_every=4, pipeline_parallel_size=2)._options.sync
    assert (o.sync, o.sync_every, o.fragments) == ("diloco", 4, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sync="diloco", zero_stage=1), r"`sync='diloco'` does not support `zero_stage=1`"),
    (dict(sync="diloco", sync_every=4, fragments=2, fault_tolerance="torchft"),
     r"`fragments=2` \(streaming DiLoCo\) with `fault_tolerance='torchft'` is not supported"),
])
def test_the_hybrid_core_refuses_what_does_notcompose_app(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridParallelStrategy(**kwargs)


@pytest.mark.parametrize("cls, sizes", [(HybridParallelStrategy, dict(pipeline_parallel_size=2)),
                                        (PipelineParallelStrategy, dict(pipeline_parallel_size=2)),
                                        (TensorParallelStrategy, dict(tensor_parallel_size=2))])
@pytest.mark.parametrize("sync", ["local_sgd", "diloco"])
def test_the_hybrid_core_takes_the_sync_under_torchft(cls, sizes, sync):
    """The groups meet on torchft's quorum at syncs only, as DataParallelStrategy's (one wiring, in the core)."""
    s = cls(sync=sync, sync_every=4, fault_tolerance="torchft", **sizes)
    assert s.fault_tolerance == "torchft" and s._options.sync.sync == sync and not s._ft.per_step_commit()
    assert cls(fault_tolerance="torchft", **sizes)._ft.per_step_commit()


def test_the_command_line_sets_the_sync():
    strategy = train.build_strategy(compose_app("strategy.sync=diloco", "strategy.sync_every=8").strategy)
    s = strategy._dp_options.sync
    assert isinstance(strategy, DataParallelStrategy) and (s.sync, s.sync_every, s.outer_lr) == ("diloco", 8, 0.7)
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match=r"`sync_every=0` must be an integer >= 1"):
        train.build_strategy(compose_app("strategy.sync=local_sgd", "strategy.sync_every=0").strategy)


def test_sync_batchnorm_is_refused_at_launch():
    import lightning.pytorch as pl

    with pytest.raises(ValueError, match=r"`Trainer\(sync_batchnorm=True\)` with `sync='local_sgd'` is not supported"):
        pl.Trainer(accelerator="cpu", devices=2, sync_batchnorm=True, logger=False,
                   strategy=DataParallelStrategy(sync="local_sgd", sync_every=2, start_method="fork"))


def test_one_replicas_outer_step_is_nesterov_sgd_on_the_parameter_change(monkeypatch):
    """One replica (the all-reduce of one rank is the identity): two syncs of DiLoCo, by hand."""
    monkeypatch.setattr(local_sgd.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(local_sgd.dist, "all_reduce", lambda t, op=None, group=None: None)
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    sync = local_sgd.PeriodicSync([w], sync="diloco", every=2, outer_lr=0.5, outer_momentum=0.9)
    theta, buf = w.detach().clone(), None
    for k in range(4):
        with torch.no_grad():
            w.sub_(0.1 * (k + 1))  # an inner step
        local = w.detach().clone()
        synced = sync.step()
        assert synced == (k % 2 == 1) and sync.since == (0 if synced else 1)
        if synced:
            delta = theta - local
            buf = delta if buf is None else 0.9 * buf + delta
            theta = theta - 0.5 * (delta + 0.9 * buf)
            torch.testing.assert_close(w.detach(), theta, atol=0, rtol=1e-6)
    state = sync.state_dict()
    again = local_sgd.PeriodicSync([torch.nn.Parameter(torch.zeros(2))], sync="diloco", every=2, outer_lr=0.5,
                                   outer_momentum=0.9)
    again.load_state_dict(state)
    torch.testing.assert_close(again.synced[0], theta)
    torch.testing.assert_close(again.outer.state_dict()["state"][0]["momentum_buffer"], buf)
    with pytest.raises(ValueError, match=r"was saved with `sync='diloco'`; this run has sync='local_sgd'"):
        local_sgd.PeriodicSync([w], sync="local_sgd", every=2).load_state_dict(state)


def test_streaming_schedule_and_a_fragment_read_before_its_sync_finished():
    """torchft's schedule (fragment f at (f + 1) H / F + k H); a fragment still in flight when the next optimizer
    step ends, although its parameters got gradients (no module of it ran forward to finish it), is refused."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    sync = local_sgd.PeriodicSync([a, b], sync="diloco", every=4, replicas=1, fragments=[[0], [1]])
    assert sync.offsets == [2, 4]
    due = []
    for step in range(1, 9):
        sync.step()
        due.append(sorted(sync.pending))
    assert due == [[], [0], [], [1], [], [0], [], [1]]
    a.grad = torch.zeros(2)  # fragment 0 is started at the next step's end ...
    sync.step()
    sync.step()
    with pytest.raises(RuntimeError, match=r"parameter 0 .* of fragment 0 has a gradient, but no module holding"):
        sync.step()  # ... and its parameter was used by that step without its sync having finished
