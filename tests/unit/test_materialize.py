"""The meta build, the materialization of a share, its init and the weights check (no processes)."""
import doctest
import functools

import pytest
import torch
from torch import nn

import lightning_par.materialize.meta as meta_module
import lightning_par.peak_memory as peak_memory_module
import lightning_par.pipeline.ends as ends_module
from lightning_par.materialize import (free_parameters, initialize, materialize, meta_parameters, open_module_weights,
                                       read_weights)
from lightning_par.pipeline.ends import first_owner, record_uses, stage_needs
from models import deep_gpt




@pytest.mark.parametrize("module", [meta_module, ends_module, peak_memory_module])
def test_docstring_examples(module):
    assert doctest.testmod(module, raise_on_error=True).attempted > 0


def test_meta_parameters_real_buffers_ties_kept_and_the_hook_removed():
    with meta_parameters():
        gpt = deep_gpt()
        bn = nn.BatchNorm1d(4)
    assert all(p.is_meta for p in gpt.parameters())
    assert gpt.lm_head.weight is gpt.tok_emb.weight
    assert not bn.running_mean.is_meta and bn.running_var.tolist() == [1.0] * 4
    assert not nn.Linear(2, 2).weight.is_meta  # outside the context: built as usual


def test_init_is_the_modules_own_and_depends_on_the_seed_and_name_only():
    def build(seed):
        with meta_parameters():
            m = deep_gpt()
        assert initialize(m, materialize(m, torch.device("cpu")), seed=seed) == []
        return m

    a, b, c = build(7), build(7), build(8)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        if p.dim() == 2:
            assert not torch.equal(p, r), name
            assert 0.015 < p.std().item() < 0.025, (name, p.std().item())  # GPT._init_weights: normal(0, 0.02)
    assert not torch.equal(a.blocks[0].attn.q_proj.weight, a.blocks[1].attn.q_proj.weight)
    assert torch.equal(a.blocks[0].ln_1.weight, torch.ones(16))


def test_what_no_init_writes_is_reported_by_name():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, 3)
            self.scale = nn.Parameter(torch.ones(3))  # set in the constructor only: lost on the meta device

    with meta_parameters():
        m = Scaled()
    made = materialize(m, torch.device("cpu"))
    assert initialize(m, made, seed=0) == ["scale"]
    assert initialize(m, made, seed=0, skip=["scale"]) == []  # a weights file supplies it


def test_owned_names_only_are_materialized_and_free_parameters_keeps_ties():
    with meta_parameters():
        m = deep_gpt()
    made = materialize(m, torch.device("cpu"), owned=lambda n: n.startswith(("blocks.0.", "tok_emb")))
    assert set(made) == {n for n, _ in m.named_parameters() if n.startswith(("blocks.0.", "tok_emb"))}
    assert not m.lm_head.weight.is_meta and m.lm_head.weight is m.tok_emb.weight  # tied: one tensor
    assert m.blocks[1].attn.q_proj.weight.is_meta and m.ln_f.weight.is_meta
    plain = deep_gpt()
    assert free_parameters(plain, ["lm_head.weight", "ln_f.bias"]) == (32 * 16 + 16) * 4
    assert plain.tok_emb.weight.is_meta and plain.lm_head.weight is plain.tok_emb.weight
    assert plain.ln_f.bias.is_meta and not plain.ln_f.weight.is_meta


def test_weights_checked_against_the_whole_meta_module_then_read(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = deep_gpt()
    state = {k: v.clone() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    good = str(tmp_path / "good.safetensors")
    save_file(state, good)
    with meta_parameters():
        m = deep_gpt()
    materialize(m, torch.device("cpu"))
    reader = open_module_weights(good, m)  # the tied head is served by the embedding's entry
    read_weights(m, reader)
    assert reader.bytes_read == sum(v.numel() * 4 for v in state.values())
    for k, v in source.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
    state["ln_f.weight"] = torch.ones(5)
    state["extra.weight"] = torch.ones(2)
    del state["blocks.1.mlp.fc.bias"]
    bad = str(tmp_path / "bad.safetensors")
    save_file(state, bad)
    with pytest.raises(ValueError, match=r"(?s)1 missing.*blocks\.1\.mlp\.fc\.bias.*1 unexpected.*extra\.weight.*"
                                         r"1 mis-shaped.*ln_f\.weight: file \(5,\)"):
        open_module_weights(bad, m)


def test_where_the_step_uses_the_ends_and_which_stage_needs_them():
    with meta_parameters():
        m = deep_gpt()
    idx = torch.zeros(2, 8, dtype=torch.long, device="meta")
    step = record_uses(m, m.blocks, {id(p) for p in m.blocks.parameters()}, lambda: m._loss((idx, idx)))
    with torch.no_grad():
        step()
    assert step.uses == {"tok_emb.weight": {("before", -1), ("after", 3)}, "pos_emb.weight": {("before", -1)},
                         "ln_f.weight": {("after", 3)}, "ln_f.bias": {("after", 3)}}
    first, last = stage_needs(step.uses, [(0, 0, 2)], 2), stage_needs(step.uses, [(1, 2, 4)], 2)
    assert [first(n) for n in ("tok_emb.weight", "pos_emb.weight", "ln_f.weight")] == [True, True, False]
    assert [last(n) for n in ("tok_emb.weight", "pos_emb.weight", "ln_f.weight")] == [True, True, True]
    assert first_owner(step.uses, [(0, 2), (2, 4)], 1) == {"tok_emb.weight": 0, "pos_emb.weight": 0,
                                                          "ln_f.weight": 1, "ln_f.bias": 1}


@pytest.mark.parametrize("kwargs,match", [({"weights": 3}, r"`weights=3` must be a path"),
                                          ({"weights_prefix": None}, r"`weights_prefix=None` must be a string")])
def test_weights_arguments_are_checked_by_every_strategy(kwargs, match):
    from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy

    for cls in (DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy):
        with pytest.raises(ValueError, match=match):
            cls(**kwargs)


def test_release_frees_a_copy_that_refers_to_itself_without_a_collection():
    """A parallelized copy wraps its own ``forward`` (a cycle): dropping the last name of it frees nothing until the
    garbage collector runs; ``release`` frees its parameters, gradients and buffers at once."""
    import gc

    from lightning_par.materialize import release
    from lightning_par.peak_memory import TensorPeak

    gc.disable()
    try:
        meter = TensorPeak()
        meter.start()
        copy = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256))
        copy.forward = functools.partial(copy.forward)  # the module -> its bound forward -> the module
        copy(torch.randn(4, 64)).sum().backward()
        meter.mark("built")
        release(copy)
        del copy
        meter.stop()
    finally:
        gc.enable()
    kept = (64 * 256 + 256 + 2 * 256) * 4 * 2 + 2 * 256 * 4  # parameters and their gradients, the running stats
    assert meter.marks["built"] >= kept and meter.held < 1024, (meter.marks, meter.held)


@pytest.fixture
def fake_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield DeviceMesh("cpu", [0, 1])
    finally:
        dist.destroy_process_group()


def test_a_sharded_meta_module_is_initialized_one_module_of_whole_temporaries_at_a_time(fake_mesh):
    """[Note: initializing a materialized share]: each DTensor is initialized whole on a temporary of which the rank
    keeps its shard; the temporaries of a module go before the next module's are made (they were all kept until
    the end: the whole model's sharded part)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_par.peak_memory import TensorPeak

    with meta_parameters():
        model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    for layer in model:
        layer.weight = nn.Parameter(distribute_tensor(layer.weight, fake_mesh, [Shard(0)]))
    meter = TensorPeak()
    meter.start()
    made = materialize(model, torch.device("cpu"))
    assert initialize(model, made, seed=0) == []
    meter.stop()
    shard, whole = 32 * 64 * 4, 64 * 64 * 4
    # one module's whole temporary (and its NaN check's mask of booleans) beside the shards, never the four
    assert meter.held == 4 * shard and meter.peak <= 4 * shard + whole + whole // 4 + 1024, (meter.held, meter.peak)
    plain = nn.Linear(64, 64, bias=False)  # the shard holds the rows of the module's own init
    with torch.random.fork_rng():
        from lightning_par.materialize.init import module_seed

        torch.manual_seed(module_seed(0, "2"))
        plain.reset_parameters()
    torch.testing.assert_close(model[2].weight.to_local(), plain.weight[:32].detach())
