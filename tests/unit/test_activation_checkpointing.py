"""lightning_par.memory.checkpointing in one process: the settings and their refusals, which blocks recompute (a
counting pre-hook on each block: twice per training step when checkpointed, once otherwise, once in eval), what
"selective" keeps (the ops run again in backward, counted by a dispatch mode), unchanged parameter names, both of
T5's stacks, the undo, and the strategies' refusals at construction."""
import collections
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import hf_model, tiny_gpt
from lightning_par import DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, \
    TensorParallelStrategy
from lightning_par._compat import torch_dispatch_mode
from lightning_par.memory.checkpointing import apply_activation_checkpointing, check_activation_checkpointing


@pytest.mark.parametrize("value", [None, "full", "selective", 1, 2, 7])
def test_settings(value):
    assert check_activation_checkpointing(value) == value


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "2", "Full", "yes", "", [1]])
def test_anything_else_is_refused_by_name(value):
    with pytest.raises(ValueError, match=re.escape(f"`activation_checkpointing={value!r}` is not a setting: choose")):
        check_activation_checkpointing(value)


@pytest.mark.parametrize("cls", [DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy,
                                 HybridParallelStrategy])
@pytest.mark.parametrize("value", [0, True, "ful"])
def test_every_strategy_refuses_a_bad_value_at_construction(cls, value):
    with pytest.raises(ValueError, match=re.escape(f"`activation_checkpointing={value!r}` is not a setting")):
        cls(activation_checkpointing=value)


OFFLOADING = {  # a layout of each strategy with a data-parallel axis of 2: what zero stage 3 shards over
    DataParallelStrategy: (dict(), 2),
    PipelineParallelStrategy: (dict(pipeline_parallel_size=2, data_parallel_size=2), 4),
    TensorParallelStrategy: (dict(tensor_parallel_size=2, data_parallel_size=2), 4),
    HybridParallelStrategy: (dict(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=2), 8)}


@pytest.mark.parametrize("cls", list(OFFLOADING), ids=lambda c: c.__name__)
def test_offload_needs_zero_stage_3_and_a_device(cls):
    import lightning.pytorch as pl

    sizes, devices = OFFLOADING[cls]
    with pytest.raises(ValueError, match=r"`offload='cpu'` needs `zero_stage=3` \(got zero_stage=2\)"):
        cls(offload="cpu", zero_stage=2, **sizes)
    with pytest.raises(ValueError, match=r"`offload='gpu'` must be None or 'cpu'"):
        cls(offload="gpu", zero_stage=3, **sizes)
    with pytest.raises(ValueError, match=r"`offload='cpu'` saves device memory .* trains on the CPU"):
        pl.Trainer(accelerator="cpu", devices=devices, strategy=cls(zero_stage=3, offload="cpu", **sizes),
                   logger=False)


@pytest.mark.parametrize("cls,sizes", [(PipelineParallelStrategy, dict(pipeline_parallel_size=2)),
                                       (TensorParallelStrategy, dict(tensor_parallel_size=2))])
def test_offload_with_one_replica_on_the_core_is_refused_not_ignored(cls, sizes):
    """The core shards over its dp axis only with several replicas: with one there is nothing to offload."""
    import lightning.pytorch as pl

    with pytest.raises(ValueError, match=r"`offload='cpu'` offloads FSDP's zero-stage-3 shards .* "
                                         r"data_parallel_size=1: nothing is sharded"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=cls(zero_stage=3, offload="cpu", **sizes), logger=False)


def _step(model, x, *, grad=True):
    """One training step's forward and backward (or an eval forward); the ops backward ran, by name."""
    ops = collections.Counter()

    class Count(torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with torch.set_grad_enabled(grad):
        torch.manual_seed(1)
        logits = model(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
    if grad:
        with Count():
            loss.backward()
    return loss.detach(), ops


def _count_calls(model):
    calls = collections.Counter()
    for i, block in enumerate(model.blocks):  # a pre-hook: an early-stopped recompute never reaches a post-hook
        block.register_forward_pre_hook(lambda m, a, i=i: calls.update([i]))
    return calls


@pytest.mark.parametrize("value,twice", [(None, set()), ("full", {0, 1, 2, 3}), (1, {0, 1, 2, 3}), (2, {0, 2}),
                                         (3, {0, 3}), ("selective", {0, 1, 2, 3})])
def test_which_blocks_recompute_and_the_same_numbers(value, twice):
    torch.manual_seed(0)
    base = tiny_gpt(n_layer=4, dropout=0.1)
    x = torch.randint(0, 32, (4, 16))
    ref = copy.deepcopy(base)
    ref_loss, _ = _step(ref, x)
    model = copy.deepcopy(base)
    applied = apply_activation_checkpointing(model, value)
    assert applied.blocks == [f"blocks.{i}" for i in sorted(twice)]
    calls = _count_calls(model)
    loss, _ = _step(model, x)
    assert dict(calls) == {i: 2 if i in twice else 1 for i in range(4)}
    assert torch.equal(loss, ref_loss)  # dropout 0.1: the recompute draws the same masks
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    calls.clear()
    _step(model, x, grad=False)  # eval / no_grad: nothing saved, nothing recomputed
    assert dict(calls) == {i: 1 for i in range(4)}


def test_selective_keeps_the_matmuls_and_recomputes_the_rest():
    torch.manual_seed(0)
    base = tiny_gpt(dropout=0.1)
    x = torch.randint(0, 32, (4, 16))
    ops = {}
    for value in (None, "full", "selective"):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, value)
        ops[value] = _step(model, x)[1]
    matmuls = ("mm", "addmm", "bmm")
    for op in matmuls:  # full runs the forward's matmuls again in backward; selective keeps their outputs
        assert ops["selective"][op] == ops[None][op]
    assert sum(ops["full"][op] for op in matmuls) > sum(ops[None][op] for op in matmuls)
    # the cheap ops recompute under both: each block's two LayerNorms and its GELU, two blocks
    for value, expected in ((None, (0, 0)), ("full", (4, 2)), ("selective", (4, 2))):
        assert (ops[value]["native_layer_norm"], ops[value]["gelu"]) == expected, value


def test_names_unchanged_and_undo():
    torch.manual_seed(0)
    model = tiny_gpt()
    names = list(model.state_dict())
    hooks = (dict(model.blocks[0]._forward_pre_hooks), dict(model.blocks[0]._forward_hooks))
    applied = apply_activation_checkpointing(model, "full")
    assert list(model.state_dict()) == names and not any("_checkpoint_wrapped_module" in n for n in names)
    plain = tiny_gpt()
    plain.load_state_dict(model.state_dict())  # a checkpoint saved with it loads without it (strict)
    model.load_state_dict(plain.state_dict())  # and the other way round
    with pytest.raises(RuntimeError, match="checkpointed already"):
        apply_activation_checkpointing(model, "full")
    applied.undo()
    assert (dict(model.blocks[0]._forward_pre_hooks), dict(model.blocks[0]._forward_hooks)) == hooks
    again = apply_activation_checkpointing(model, 2)  # a later run may choose another mode
    calls = _count_calls(model)
    _step(model, torch.randint(0, 32, (2, 16)))
    assert dict(calls) == {0: 2, 1: 1}
    again.undo()


def test_every_stack_is_checkpointed_and_k_counts_per_stack():
    t5 = hf_model("t5", num_layers=3)
    applied = apply_activation_checkpointing(t5, 2)
    assert applied.blocks == ["encoder.block.0", "encoder.block.2", "decoder.block.0", "decoder.block.2"]
    applied.undo()
    applied = apply_activation_checkpointing(t5, "full", blocks="decoder.block")
    assert applied.blocks == ["decoder.block.0", "decoder.block.1", "decoder.block.2",
                              "encoder.block.0", "encoder.block.1", "encoder.block.2"]
    applied.undo()


def test_a_module_without_a_block_stack_is_refused_naming_blocks():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"activation_checkpointing='full'` recomputes the blocks of a repeated "
                                         r"block stack.*Name the stack with `blocks='...'` \(DataParallelStrategy"):
        apply_activation_checkpointing(nn.ModuleDict({"net": net}), "full", owner="DataParallelStrategy")
    assert apply_activation_checkpointing(net, None).blocks == []  # off: nothing is looked for


@pytest.mark.parametrize("override,value", [("full", "full"), ("2", 2), ("selective", "selective"),
                                            ("null", None)])
@pytest.mark.parametrize("strategy", ["ddp", "pipeline", "tensor", "hybrid"])
def test_the_command_line_setting_reaches_the_strategy(strategy, override, value):
    """`strategy.activation_checkpointing=full` arrives as a string and `=2` as an int (the schema's field is
    untyped: OmegaConf has no int-or-string), and the strategy built from the config holds it."""
    from hydra.utils import instantiate

    from app_config import compose_app
    from lightning_par import config as schemas

    cfg = compose_app(f"strategy={strategy}", f"strategy.activation_checkpointing={override}",
                      "strategy.start_method=fork")
    schemas.check_keys(cfg)
    assert cfg.strategy.activation_checkpointing == value
    assert instantiate(cfg.strategy)._options.memory.activation_checkpointing == value
    bad = compose_app(f"strategy={strategy}", "strategy.activation_checkpointing=0")
    with pytest.raises(Exception, match="`activation_checkpointing=0` is not a setting"):
        instantiate(bad.strategy)
