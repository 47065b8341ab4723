"""The ``compile`` option and :mod:`lightning_par.compile` without processes: values checked at construction and
from the Hydra app, one graph serving every block of one class (one per class where layer types alternate),
parameter names and state dicts unchanged, the user's ``torch.compile`` undone and reapplied per block, the
refusals naming the value."""
import copy

import pytest
import torch
from torch import nn

from app_config import compose_app
from models import tiny_gpt
from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                           TensorParallelStrategy, train)
from lightning_par._compat import compile_counters, reset_compile_counters
from lightning_par.compile import (apply_compile, check_compile, compile_keywords, compiler_of, is_compiled,
                                   take_user_compile)
from lightning_par.memory.checkpointing import apply_activation_checkpointing

STRATEGIES = [DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy]


@pytest.fixture()
def fresh_dynamo():
    """dynamo's caches and counters empty (its cache is per code object, shared across tests)."""
    torch._dynamo.reset()
    reset_compile_counters()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("value,kept", [(False, False), (True, True), ("aot_eager", "aot_eager"),
                                        ({"mode": "max-autotune-no-cudagraphs", "fullgraph": True},
                                         {"mode": "max-autotune-no-cudagraphs", "fullgraph": True})])
def test_every_strategy_takes_compile(cls, value, kept):
    assert cls(compile=value)._options.stack.compile == kept


@pytest.mark.parametrize("value,match", [
    ("inductr", r"`compile='inductr'` is not a torch.compile backend here \('inductr'\)"),
    ({"backend": "aot_eagr"}, r"is not a torch.compile backend here \('aot_eagr'\)"),
    ({"mode": "fastest"}, r"'fastest' is not a torch.compile mode; choose one of .*'max-autotune'"),
    ({"fullgrph": True}, r"torch.compile takes no keyword 'fullgrph'"),
    ({"mode": "max-autotune", "options": {"epilogue_fusion": False}}, "`mode` or `options`, not both"),
    (3, r"`compile=3` must be False, True"),
])
def test_bad_values_are_refused_at_construction_naming_them(value, match):
    for cls in STRATEGIES:
        with pytest.raises(ValueError, match=match):
            cls(compile=value)


@pytest.mark.parametrize("kw,named", [({"context_parallel_size": 2}, "context_parallel_size=2"),
                                      ({"expert_parallel_size": 2}, "expert_parallel_size=2"),
                                      ({"sync": "diloco"}, "sync='diloco'"),
                                      ({"fault_tolerance": "torchft"}, "fault_tolerance='torchft'")])
def test_what_compile_does_not_compose_with_is_refused_by_name(kw, named):
    with pytest.raises(ValueError, match=f"`compile=True` is not composed with `{named}`"):
        HybridParallelStrategy(compile=True, **kw)
    if not set(kw) & {"context_parallel_size", "expert_parallel_size"}:  # keywords of the hybrid only
        with pytest.raises(ValueError, match=f"is not composed with `{named}`"):
            DataParallelStrategy(compile="aot_eager", **kw)


def test_keywords_of_each_value():
    assert compile_keywords(False) is None and compile_keywords(True) == {}
    assert compile_keywords("aot_eager") == {"backend": "aot_eager"}
    assert compile_keywords({"dynamic": False}) == {"dynamic": False}
    assert check_compile({"options": {"epilogue_fusion": False}}) == {"options": {"epilogue_fusion": False}}


@pytest.mark.parametrize("override,expected", [("strategy.compile=true", True),
                                               ("strategy.compile=aot_eager", "aot_eager"),
                                               ("strategy.compile={mode: max-autotune-no-cudagraphs}",
                                                {"mode": "max-autotune-no-cudagraphs"})])
@pytest.mark.parametrize("group", ["ddp", "hybrid", "pipeline", "tensor"])
def test_the_hydra_key(group, override, expected):
    strategy = train.build_strategy(compose_app(f"strategy={group}", override).strategy)
    assert strategy._options.stack.compile == expected


def test_the_hydra_key_refuses_an_unknown_backend():
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="`compile='inductr'` is not a torch.compile backend"):
        train.build_strategy(compose_app("strategy.compile=inductr").strategy)


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ac", [None, "full", "selective"])
def test_one_graph_serves_every_block_and_names_stay(fresh_dynamo, ac):
    """Six blocks of one class, fullgraph (the hooks of activation checkpointing stay outside the graph): dynamo
    compiles one graph for the forward, and the module computes what the eager one does, names unchanged."""
    torch.manual_seed(0)
    model = tiny_gpt(n_layer=6)
    eager = copy.deepcopy(model)
    apply_activation_checkpointing(model, ac)
    done = apply_compile(model, compiler_of({"backend": "aot_eager", "fullgraph": True}))
    assert done.blocks == [f"blocks.{i}" for i in range(6)] and all(is_compiled(b) for b in model.blocks)
    assert list(model.state_dict()) == list(eager.state_dict())
    x = torch.randint(0, 32, (2, 16))
    for m in (model, eager):
        out = m(x)
        (out[0] if isinstance(out, tuple) else out).pow(2).mean().backward()
    assert compile_counters()["graphs"] == 1 and compile_counters()["graph_breaks"] == 0
    g, e = _grads(model), _grads(eager)
    assert g.keys() == e.keys()
    for name in e:
        torch.testing.assert_close(g[name], e[name], atol=1e-6, rtol=0.0)
    copied = copy.deepcopy(model)  # a copy runs its own blocks' forward, compiled
    assert is_compiled(copied.blocks[0]) and copied.blocks[0].forward.__self__ is copied.blocks[0]
    done.undo()
    assert not any(is_compiled(b) for b in model.blocks)


class Sliding(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Full(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.relu(self.lin(x))


class Alternating(nn.Module):
    """A stack whose blocks alternate two layer types (as sliding and full attention)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Sliding() if i % 2 else Full() for i in range(6)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_alternating_layer_types_get_one_graph_per_type(fresh_dynamo):
    model = Alternating()
    apply_compile(model, compiler_of("aot_eager"), blocks="layers")
    x = torch.randn(4, 8, requires_grad=True)  # every block's input needs grad: one configuration
    model(x).sum().backward()
    assert compile_counters()["graphs"] == 2


@pytest.mark.parametrize("use_cache", [False, True])
def test_hugging_face_blocks_with_and_without_a_kv_cache(fresh_dynamo, use_cache):
    """A tiny Hugging Face Llama (3 layers), compiled per block: computes what the eager model does either way;
    one graph for every layer with ``use_cache=False``, one graph per layer with ``use_cache=True`` (the limit
    docs/compile.md names: each layer's graph guards on its own ``DynamicCache`` layer's Python state, indexed by
    the layer's number; a change of transformers that lifts it fails here, and the limitation line goes)."""
    from models import hf_model

    torch.manual_seed(0)
    model = hf_model("llama", num_hidden_layers=3)
    eager = copy.deepcopy(model)
    apply_compile(model, compiler_of("aot_eager"), blocks="model.layers")
    x = torch.randint(0, 32, (2, 16))
    for m in (model, eager):
        m(input_ids=x, use_cache=use_cache).logits.pow(2).mean().backward()
    counts = compile_counters()
    assert (counts["graphs"], counts["graph_breaks"]) == (3 if use_cache else 1, 0), counts
    g, e = _grads(model), _grads(eager)
    assert g.keys() == e.keys() and g
    for name in e:
        torch.testing.assert_close(g[name], e[name], atol=1e-6, rtol=0.0)


def test_blocks_the_user_compiled_are_unwrapped_and_compiled_with_the_users_keywords(fresh_dynamo):
    """``torch.compile(block, backend=...)`` per block: the wrappers are replaced by the blocks (names without
    ``_orig_mod``), and each block compiles with the user's own compiler (its backend: a counting one here)."""
    calls = []

    def counting_backend(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        return gm.forward

    torch.manual_seed(0)
    model = tiny_gpt(n_layer=3)
    names = list(model.state_dict())
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=counting_backend)
    assert any("_orig_mod" in n for n in model.state_dict())
    taken = take_user_compile(model)
    assert taken.unwrapped == ["blocks.0", "blocks.1", "blocks.2"] and not taken.whole_module
    assert list(model.state_dict()) == names
    apply_compile(model, compiler_of(False, taken.compiler))
    model(torch.randint(0, 32, (2, 16)))
    assert len(calls) == 1  # one graph, from the user's backend, for the three blocks


def test_a_module_compiled_through_lightning_gives_its_compiler():
    from lightning.pytorch.utilities.compile import from_compiled

    model = from_compiled(torch.compile(tiny_gpt(), backend="aot_eager"))
    taken = take_user_compile(model)
    assert taken.whole_module and taken.compiler is not None and taken.unwrapped == []


def test_compile_without_a_block_stack_is_refused_naming_blocks():
    with pytest.raises(ValueError, match=r"`compile=True` compiles the blocks of a repeated block stack.*blocks="):
        apply_compile(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), compiler_of(True))
