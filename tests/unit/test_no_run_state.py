"""State of a run kept where the run owns it: a module parallelized by an earlier Trainer is recognised from the
module itself (its DTensor parameters on a ``tp`` mesh), not from a registry, and a later Trainer of a different
tensor-parallel size is refused by name; DTensor and plain parameters are stepped apart through torch's optimizer
step hooks, which the strategy removes again (``optimizer.step`` is never replaced)."""
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_par.strategies._engine import EngineOptions, Groups, Host
from lightning_par.strategies._spmd_engine import SpmdEngine
from lightning_par.tensor.parallelize import parallelized_size


@pytest.fixture
def tp_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _engine(tp: int) -> SpmdEngine:
    strategy = SimpleNamespace(topology=SimpleNamespace(tensor_parallel_size=tp), is_global_zero=False)
    host = Host(open_weights=None, place_share=None, install_precision=None, record_one_device_order=None,
                lightning_setup=None, lightning_teardown=None)
    return SpmdEngine(strategy, EngineOptions(), Groups(), host)


def test_a_parallelized_module_is_read_from_its_parameters(tp_mesh):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert parallelized_size(model) is None and not _engine(2)._parallelized_before(model)
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight, tp_mesh, [Shard(0)]))
    assert parallelized_size(model) == 2
    engine = _engine(2)
    assert engine._parallelized_before(model) and engine.plan is None  # the plan is the earlier Trainer's
    with pytest.raises(ValueError, match=r"Sequential was parallelized by an earlier Trainer with "
                                         r"tensor_parallel_size=2, and this strategy has tensor_parallel_size=1.*"
                                         r"Use tensor_parallel_size=2, or build the module anew"):
        _engine(1)._parallelized_before(model)


def test_dtensor_and_plain_parameters_are_stepped_apart_through_step_hooks(tp_mesh):
    import torch

    from lightning_par.tensor.mixed import split_step_by_kind

    sharded = nn.Parameter(distribute_tensor(torch.ones(4, 2), tp_mesh, [Shard(0)]))
    plain = nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([sharded, plain], lr=0.1, foreach=True)
    groups = opt.param_groups
    for p in (sharded, plain):
        p.grad = torch.ones_like(p)
    with pytest.raises(Exception, match="mixed torch.Tensor and DTensor"):
        opt.step()  # torch's foreach step refuses the mix in one group
    hooks = split_step_by_kind(opt)
    opt.step()
    assert opt.param_groups is groups and "step" not in vars(opt)  # the user's layout outside the step
    assert float(plain.detach()[0]) < 1 and float(sharded.to_local().detach()[0, 0]) < 1
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: (_ for _ in ()).throw(RuntimeError("closure")))  # no post-hook runs
    opt.step()  # the next step's pre-hook puts the user's groups back before it splits them again
    assert opt.param_groups is groups
    hooks.remove()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
