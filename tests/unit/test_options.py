"""Each option is defined once, in a frozen group of ``lightning_par.options``: the constructors' flat keywords and
the Hydra schemas are generated from the groups ([Note: flat keywords, grouped options])."""
import ast
import dataclasses
import doctest
import inspect
from pathlib import Path

import pytest

from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                           TensorParallelStrategy, config, options)
from lightning_par.strategies._engine import EngineOptions

# The keywords (and defaults) each constructor took when its signature was written out by hand.
TODAY = {
    DataParallelStrategy: dict(
        comm_hook=None, powersgd_rank=1, powersgd_start_iter=1000, zero_stage=0, offload=None,
        activation_checkpointing=None, blocks=None, lr_scaling="none",
        reference_batch_size=None, weights=None, weights_prefix="", start_method="popen", timeout=1800.0,
        nonfinite="error", find_unused_parameters=False, bucket_cap_mb=None, gradient_as_bucket_view=False,
        static_graph=False, process_group_backend=None, fault_tolerance=None, min_replicas=1, ft_timeout=60.0,
        save_distributed_checkpoint=False, async_save=False),
    HybridParallelStrategy: dict(
        data_parallel_size="auto", pipeline_parallel_size=1, tensor_parallel_size=1, zero_stage=0,
        mesh_order="pp_dp_tp", microbatches=None, schedule="1f1b", stages_per_rank=1, blocks=None, balance="params",
        strict_batch_semantics=False, plan="auto", sequence_parallel=False, loss_parallel=False,
        activation_checkpointing=None, weights=None,
        weights_prefix="", nonfinite="error", fault_tolerance=None, min_replicas=1, ft_timeout=60.0,
        save_distributed_checkpoint=False, async_save=False, start_method="popen", timeout=1800.0,
        process_group_backend=None),
    PipelineParallelStrategy: dict(
        pipeline_parallel_size="auto", data_parallel_size="auto", microbatches=None, schedule="1f1b",
        stages_per_rank=1, blocks=None, balance="params", strict_batch_semantics=False,
        activation_checkpointing=None, zero_stage=0, weights=None,
        weights_prefix="", nonfinite="error", fault_tolerance=None, min_replicas=1, ft_timeout=60.0,
        save_distributed_checkpoint=False, async_save=False, start_method="popen", timeout=1800.0,
        process_group_backend=None),
    TensorParallelStrategy: dict(
        tensor_parallel_size="auto", data_parallel_size="auto", plan="auto", sequence_parallel=False,
        loss_parallel=False, activation_checkpointing=None, zero_stage=0, weights=None, weights_prefix="",
        nonfinite="error", fault_tolerance=None,
        min_replicas=1, ft_timeout=60.0, save_distributed_checkpoint=False, async_save=False, start_method="popen",
        timeout=1800.0, process_group_backend=None),
}
SYNC = {"sync", "sync_every", "outer_lr", "outer_momentum", "fragments"}  # local SGD / DiLoCo on the data axis
HOOKS = {"comm_hook", "powersgd_rank", "powersgd_start_iter"}  # DDP's communication hooks on the core's dp axis too
VERIFY = {"verify"}  # the setup check of rewritten blocks (lightning_par.verify)
ADDED = {DataParallelStrategy: SYNC,  # offload: zero stage 3's shards in host memory, on the core's dp axis too
         PipelineParallelStrategy: {"mesh_order", "offload", *SYNC, *HOOKS, *VERIFY},  # the core's
         TensorParallelStrategy: {"mesh_order", "blocks", "offload", *SYNC, *HOOKS, *VERIFY},  # blocks: AC's stack
         HybridParallelStrategy: {"context_parallel_size", "context_parallel_method", "offload", *SYNC, *HOOKS,
                                  *VERIFY}}  # the presets fix cp to 1
SCHEMAS = {DataParallelStrategy: config.DataParallelStrategyConfig, HybridParallelStrategy: config.HybridStrategyConfig,
           PipelineParallelStrategy: config.PipelineStrategyConfig, TensorParallelStrategy: config.TensorStrategyConfig}
COMPOSITE = {DataParallelStrategy: options.DataParallelOptions}  # the others: CoreOptions
PRESET = {PipelineParallelStrategy: ("tensor_parallel_size", "tensor", "pipeline_parallel_size"),
          TensorParallelStrategy: ("pipeline_parallel_size", "pipeline", "tensor_parallel_size")}


def test_doctests():
    assert doctest.testmod(options).failed == 0


@pytest.mark.parametrize("cls", list(TODAY), ids=lambda c: c.__name__)
def test_the_hydra_schema_is_the_groups_fields_and_keeps_todays_flat_keys(cls):
    schema = {f.name: f.default for f in dataclasses.fields(SCHEMAS[cls]) if f.name != "_target_"}
    composite = COMPOSITE.get(cls, options.CoreOptions)
    fixed, without, own = PRESET.get(cls, (None, None, None))
    expected = {name: ("auto" if name == own else param.default)
                for name, (group, param) in composite.fields().items() if name != fixed and group != without
                and not (fixed and name in ("context_parallel_size", "context_parallel_method"))}
    assert schema == expected
    assert set(schema) == set(TODAY[cls]) | ADDED.get(cls, set())
    assert {k: schema[k] for k in TODAY[cls]} == TODAY[cls]  # same names, same defaults
    assert "microbatches" in config.PipelineStrategyConfig.__dataclass_fields__  # strategy.microbatches


def test_every_group_is_frozen_and_every_name_is_in_one_group():
    for composite in (options.CoreOptions, options.DataParallelOptions):
        for f in dataclasses.fields(composite):
            group = f.type if isinstance(f.type, type) else getattr(options, f.type)
            assert group.__dataclass_params__.frozen, group
        assert len(composite.fields()) == sum(len(dataclasses.fields(getattr(composite(), f.name)))
                                              for f in dataclasses.fields(composite))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.PipelineOptions().schedule = "gpipe"


def test_no_strategy_file_writes_an_option_default_again():
    """``ft_timeout: float = 60.0`` and its kind live in the groups only, not in a constructor or helper."""
    names = set(options.CoreOptions.fields()) | set(options.DataParallelOptions.fields())
    strategies = Path(options.__file__).parent / "strategies"
    written = []
    for path in strategies.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                with_defaults = a.args[len(a.args) - len(a.defaults):] + [
                    k for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                written += [f"{path.name}:{node.name}({arg.arg}=...)" for arg in with_defaults if arg.arg in names]
    assert not written


@pytest.mark.parametrize("preset", list(PRESET), ids=lambda c: c.__name__)
def test_a_preset_fixes_the_size_its_name_excludes_and_nothing_else(preset):
    fixed, without, own = PRESET[preset]
    given = dict(zero_stage=1, nonfinite="skip", timeout=60, weights_prefix="net.", mesh_order="dp_pp_tp")
    given.update({"microbatches": 4, "schedule": "gpipe"} if without == "tensor" else {"sequence_parallel": True})
    core = HybridParallelStrategy(**{fixed: 1, own: "auto"}, **given)
    assert preset(**given)._options == core._options
    with pytest.raises(TypeError, match=rf"{preset.__name__}.__init__\(\) got an unexpected keyword argument '{fixed}'"):
        preset(**{fixed: 2})


@pytest.mark.parametrize("group, kwargs, match", [
    (options.PipelineOptions, dict(schedule="zigzag"), r"`schedule='zigzag'` is not a pipeline schedule"),
    (options.LayoutOptions, dict(mesh_order="tp_dp_pp"), r"`mesh_order='tp_dp_pp'` must be one of"),
    (options.TensorOptions, dict(loss_parallel="yes"), r"`loss_parallel='yes'` must be True or False"),
    (options.ShardingOptions, dict(zero_stage=4), r"zero_stage=4"),
    (options.FaultToleranceOptions, dict(ft_timeout=0), r"`ft_timeout=0` must be a finite positive number"),
    (options.LaunchOptions, dict(timeout=-1), r"`timeout=-1` must be a finite positive number of seconds"),
    (options.CheckpointOptions, dict(async_save=1), r"`async_save=1` must be True or False"),
    (options.WeightsOptions, dict(weights_prefix=3), r"`weights_prefix=3` must be a string"),
    (options.BlockOptions, dict(blocks=3), r"`blocks=3` must be the dotted name of the block container"),
    (options.MemoryOptions, dict(activation_checkpointing=0), r"`activation_checkpointing=0` is not a setting"),
    (options.MemoryOptions, dict(offload="disk"), r"`offload='disk'` must be None or 'cpu'"),
])
def test_each_group_checks_its_own_values_with_the_strategies_messages(group, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group(**kwargs)
    cls = DataParallelStrategy if set(kwargs) <= set(TODAY[DataParallelStrategy]) else HybridParallelStrategy
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_checks_across_groups_are_the_composites():
    with pytest.raises(ValueError, match=r"`fault_tolerance='torchft'` does not support `zero_stage=1` on the hybrid"):
        options.CoreOptions.from_flat(dict(fault_tolerance="torchft", zero_stage=1))
    with pytest.raises(ValueError, match=r"`zero_stage=3` shards with FSDP.*comm_hook='fp16', static_graph=True cannot"):
        options.DataParallelOptions.from_flat(dict(zero_stage=3, comm_hook="fp16", static_graph=True))
    with pytest.raises(ValueError, match=r"`offload='cpu'` needs `zero_stage=3` \(got zero_stage=0\)"):
        options.DataParallelOptions.from_flat(dict(offload="cpu"))


def test_the_engine_options_are_the_strategys_groups_resolved_for_the_layout():
    o = HybridParallelStrategy(schedule="interleaved_1f1b", stages_per_rank=2, balance=[1, 3], zero_stage=1)._options
    engine = EngineOptions(pipeline=o.pipeline, tensor=o.tensor, sharding=o.sharding, stages=2)
    assert (engine.microbatches, engine.given_microbatches, engine.stages_per_rank) == (4, None, 2)
    assert (engine.balance, engine.zero_stage, engine.plan) == ((1, 3), 1, "auto")
    one_stage = dataclasses.replace(engine, stages=1)
    assert (one_stage.microbatches, one_stage.stages_per_rank) == (2, 1)


def test_constructors_show_their_keywords():
    sig = inspect.signature(PipelineParallelStrategy)
    assert list(sig.parameters)[:3] == ["data_parallel_size", "pipeline_parallel_size", "mesh_order"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in sig.parameters.values())
    assert sig.parameters["ft_timeout"].default == 60.0 and sig.parameters["ft_timeout"].annotation is float
    assert "accelerator" not in inspect.signature(DataParallelStrategy).parameters  # as before: the Trainer's own
