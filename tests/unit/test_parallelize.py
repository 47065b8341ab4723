"""The parallelize order (lightning_par.parallelize): Lightning-free, its orders call the steps in the order written
in its docstring, and each step runs alone on a plain module, no processes."""
import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_par.parallelize as order
from lightning_par.options import BlockOptions, LayoutOptions, MemoryOptions, PipelineOptions, ShardingOptions, TensorOptions
from lightning_par.parallelize import steps
from lightning_par.topology import Topology

FOLDER = Path(order.__file__).parent


def test_the_order_knows_no_lightning():
    for path in FOLDER.glob("*.py"):
        imports = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in imports if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in imports if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if n.split(".")[0] == "lightning"], path.name


@pytest.mark.parametrize("apply_order", [order.parallelize_pipeline, order.parallelize_spmd, order.parallelize_replicas])
def test_each_order_calls_its_steps_in_the_written_order(apply_order):
    """The numbered list of the module docstring is the order of the calls in every ``parallelize_*``."""
    written = re.findall(r"^\s*\d+\. .*?:func:`(\w+)`", order.__doc__, re.M)
    calls = [n for n in ast.walk(ast.parse(inspect.getsource(apply_order)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in written]
    called = [n.func.id for n in sorted(calls, key=lambda n: (n.lineno, n.col_offset))]  # in the source's order
    called = list(dict.fromkeys(called))
    assert called == [w for w in written if w in called] and len(called) >= 5, called


def test_steps_with_nothing_to_do_make_nothing():
    module = nn.Linear(2, 2)
    assert steps.apply_setup_check(module, order.EngineOptions(), order.Groups()) is None  # nothing kept to check
    rank = order.Rank(device=torch.device("cpu"), rank=0, world_size=1, topology=Topology.resolve(1))
    assert steps.apply_expert_parallel(module, LayoutOptions(), order.Groups(), rank) is None  # nothing to divide


def test_the_compile_step_compiles_each_block_of_the_stack_alone():
    module = nn.Sequential(nn.Linear(4, 4), nn.Sequential(*(nn.Linear(4, 4) for _ in range(3))))
    rank = order.Rank(device=torch.device("cpu"), rank=0, world_size=1, topology=Topology.resolve(1))
    assert steps.apply_compile(module, BlockOptions(), rank).blocks == []  # compile=False: nothing
    made = steps.apply_compile(module, BlockOptions(blocks="1", compile="aot_eager"), rank)
    assert made.blocks == ["1.0", "1.1", "1.2"]
    x = torch.randn(2, 4)
    eager = module[1][2].__class__.forward(module[1][2], x)
    torch.testing.assert_close(module[1][2](x), eager, atol=0, rtol=0)  # aot_eager: the same kernels
    made.undo()
    assert "forward" not in vars(module[1][0])


def test_the_stage_split_balances_blocks_by_parameters():
    blocks = nn.Sequential(*(nn.Linear(4, 4) for _ in range(6)))
    stack = steps.BlockStack(path="blocks", container=blocks)
    topo = Topology.resolve(2, pipeline_parallel_size=2)
    split = steps.apply_stage_split(stack, PipelineOptions(), topo, profile=lambda c: pytest.fail("no profile"))
    assert split.counts == [3, 3] and split.bounds == [(0, 3), (3, 6)] and split.params == [20] * 6
    split = steps.apply_stage_split(stack, PipelineOptions(balance=[2, 4]), topo, profile=None)
    assert split.counts == [2, 4]


def test_steps_without_their_axis_make_nothing():
    module = nn.Sequential(nn.Linear(4, 4))
    topo = Topology.resolve(1)
    rank = order.Rank(device=torch.device("cpu"), rank=0, world_size=1, topology=topo)
    assert steps.find_tensor_plan(module, TensorOptions(), topo) is None
    assert steps.apply_tensor_parallel(module, None, TensorOptions(), order.Groups()) is None
    assert steps.apply_fsdp(module, ShardingOptions(zero_stage=3), MemoryOptions(), order.Groups(), rank) is None
    assert steps.apply_context(module, order.Groups(), blocks=None) is None


def test_placement_is_the_weights_readers_call():
    calls = []
    steps.apply_placement(nn.Linear(2, 2), lambda m, r, owned=None: calls.append((r, owned)), "reader", owned=None)
    assert calls == [("reader", None)]


def test_the_setup_check_keeps_one_moe_layer_per_kind_whole_with_its_recorded_inputs():
    """Step 7's material, taken before the experts are divided: a whole copy of the first MoE layer of each kind (two
    ListMoE layers: one kind) and its inputs in one run of the step; nothing at ep 1 or without a step."""
    from experts_models import HIDDEN, ListMoELM
    from lightning_par.option_groups import VerifyOptions

    torch.manual_seed(0)
    model, idx = ListMoELM(), torch.randint(0, 64, (2, 8))
    sample = lambda: (lambda: model(idx))  # noqa: E731 -- the user's step on one micro-batch
    cpu = torch.device("cpu")
    layers, inputs = steps.keep_expert_layers(model, LayoutOptions(expert_parallel_size=2), sample, cpu)
    assert list(layers) == ["layers.0"] and list(inputs) == ["layers.0"]
    copy, rel = layers["layers.0"]
    assert rel == "experts" and copy is not model.layers[0]
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), model.layers[0].parameters()))
    torch.testing.assert_close(inputs["layers.0"][0][0], model.embed(idx), rtol=0, atol=0)
    assert inputs["layers.0"][0][0].shape == (2, 8, HIDDEN)
    assert steps.keep_expert_layers(model, LayoutOptions(), sample, cpu) is None  # ep 1: nothing divided
    assert steps.keep_expert_layers(model, LayoutOptions(expert_parallel_size=2), None, cpu) is None  # no step
    off = order.EngineOptions(check=VerifyOptions(verify=False))
    assert steps.apply_setup_check(model, off, order.Groups(), experts=object(), kept=(layers, inputs)) is None
