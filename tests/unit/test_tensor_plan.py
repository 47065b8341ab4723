"""Tensor-parallel plans without processes: auto-detection, Hugging Face plans, user globs, bad input."""

import warnings

import pytest
from torch import nn

from lightning_par.models import GPT
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.tensor.plan import FUSED, auto_plan, build_plan, find_megatron_pairs, hf_plan


def gpt(**kw):
    cfg = dict(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16)
    cfg.update(kw)
    return GPT(**cfg)


def test_auto_plan_on_reference_gpt():
    plan = build_plan(gpt(), 2)
    for i in range(2):
        b = f"blocks.{i}"
        assert plan.styles[f"{b}.attn"] == plan.styles[f"{b}.mlp"] == "prepare"
        for name in ("q_proj", "k_proj", "v_proj"):
            assert plan.styles[f"{b}.attn.{name}"] == "colwise"
        assert plan.styles[f"{b}.attn.out_proj"] == "rowwise"
        assert plan.styles[f"{b}.mlp.fc"] == "colwise" and plan.styles[f"{b}.mlp.proj"] == "rowwise"
    assert len(plan.styles) == 2 * 8  # nothing else: embeddings, norms and the tied lm head stay replicated
    assert list(plan.styles)[0] == "blocks.0.attn"  # parents are applied before their children
    text = plan.describe(gpt())
    assert "blocks.0.attn.q_proj: colwise" in text and "lm_head" in text


def test_pairs_fused_qkv_gqa_and_sequential():
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    class GQA(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 8)

    root = nn.ModuleDict({"fused": Fused(), "gqa": GQA(),
                          "seq": nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)),
                          "chain": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)),
                          "stack": nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 8)])})
    pairs = find_megatron_pairs(root)
    assert pairs["gqa"] == (["gqa.q", "gqa.k", "gqa.v"], "gqa.o")
    assert pairs["seq"] == (["seq.0"], "seq.2")
    assert "fused" not in pairs  # fused qkv writes 3x the width the projection reads: not a pair by shape
    assert "chain" not in pairs and "stack" not in pairs


def test_head_count_not_divisible_names_module_heads_and_t():
    with pytest.raises(ValueError, match=r"blocks\.0\.attn.*n_head=2.*tensor_parallel_size=4"):
        build_plan(gpt(n_head=2), 4)


def test_dimension_not_divisible_names_module_dim_and_t():
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q_proj.*out_features=18.*tensor_parallel_size=4"):
        build_plan(gpt(n_embd=18, n_head=1), 4)


class WithMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


def test_multihead_attention_left_replicated_with_warning():
    with pytest.warns(UserWarning, match=r"MultiheadAttention 'attn' is left replicated"):
        plan = build_plan(WithMHA(), 2)
    assert not any(n.startswith("attn") for n in plan.styles)
    assert plan.styles["mlp.0"] == "colwise" and "attn" in plan.replicated
    with pytest.warns(UserWarning, match=r"'attn\.out_proj' is inside nn\.MultiheadAttention"):
        plan = build_plan(WithMHA(), 2, {"attn.out_proj": "rowwise"})
    assert "attn.out_proj" not in plan.styles


def test_user_plan_overrides():
    plan = build_plan(gpt(), 2, {"blocks.*.mlp.*": "replicate"})
    assert plan.styles["blocks.0.mlp.fc"] == "replicate" and "blocks.0.mlp" not in plan.styles
    assert plan.styles["blocks.1.attn.q_proj"] == "colwise"


def test_user_plan_glob_that_matches_nothing_is_refused_with_names_that_exist():
    with pytest.raises(ValueError) as err:
        build_plan(gpt(), 2, {"blocks.*.mlp.fc": "colwise", "nowhere.*": "colwise"})
    msg = str(err.value)
    assert "plan glob 'nowhere.*' (style 'colwise') matches no module of GPT" in msg
    # the names it offers are the first ten linear layers, in module order, and how many more there are
    assert "'blocks.0.attn.q_proj', 'blocks.0.attn.k_proj', 'blocks.0.attn.v_proj', 'blocks.0.attn.out_proj', " \
           "'blocks.0.mlp.fc', 'blocks.0.mlp.proj', 'blocks.1.attn.q_proj'" in msg
    assert "(and 3 more)" in msg and "Correct the glob or remove the entry" in msg
    # a model without linear layers lists its modules instead
    with pytest.raises(ValueError, match=r"'decoder\.\*' .* such as '0', '1'\."):
        build_plan(nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4)), 2, {"decoder.*": "replicate"})


def test_user_plan_bad_style_and_bad_target():
    with pytest.raises(ValueError, match=r"'diagonal' must be one of"):
        build_plan(gpt(), 2, {"blocks.*.mlp.fc": "diagonal"})
    with pytest.raises(ValueError, match=r"blocks\.0\.ln_1.*applies to nn\.Linear"):
        build_plan(gpt(), 2, {"blocks.0.ln_1": "colwise"})


def test_strategy_rejects_bad_arguments_before_any_process():
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        TensorParallelStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="'sideways' must be one of"):
        TensorParallelStrategy(plan={"a": "sideways"})
    with pytest.raises(ValueError, match="start_method='thread'"):
        TensorParallelStrategy(start_method="thread")
    with pytest.raises(ValueError, match="timeout=0"):
        TensorParallelStrategy(timeout=0)
    with pytest.raises(TypeError):
        TensorParallelStrategy(tensor_parallel_sizes=2)  # unknown key
    with pytest.raises(TypeError):
        TensorParallelStrategy(2)  # keyword-only


def test_hugging_face_plan_and_auto_plan_agree_on_qwen2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = nn.ModuleDict({"lm": transformers.Qwen2ForCausalLM(cfg)})
    hf = hf_plan(model)
    assert hf is not None and hf.styles["lm.model.layers.1.self_attn.q_proj"] == "colwise"
    auto = auto_plan(model)
    assert auto.styles == hf.styles  # the auto plan finds exactly the Megatron pairs HF lists
    plan = build_plan(model, 2)
    assert plan.styles["lm.model.layers.0.self_attn"] == plan.styles["lm.model.layers.0.mlp"] == "prepare"
    with pytest.raises(ValueError, match=r"num_key_value_heads=2.*tensor_parallel_size=4"):
        build_plan(model, 4)


def test_sequence_parallel_plan_marks_blocks_and_norms():
    plan = build_plan(gpt(), 2, sequence_parallel=True)
    assert plan.styles["blocks.0"] == "sequence_block" and plan.styles["blocks.1"] == "sequence_block_last"
    assert plan.styles["blocks.0.ln_1"] == plan.styles["blocks.1.ln_2"] == "sequence"
    assert "ln_f" not in plan.styles  # outside the block stack: full sequences (see the plan's note)


def test_loss_parallel_plan_shards_head_and_tied_embedding():
    plan = build_plan(gpt(), 2, loss_parallel=True)
    assert plan.styles["lm_head"] == "vocab_head" and plan.styles["tok_emb"] == "vocab_embedding"
    assert "pos_emb" not in plan.styles
    with pytest.raises(ValueError, match=r"'lm_head'.*out_features=30.*tensor_parallel_size=4"):
        build_plan(gpt(vocab_size=30), 4, loss_parallel=True)
    with pytest.raises(ValueError, match="found no output head"):
        build_plan(WithMHA(), 2, loss_parallel=True)


def test_tied_weight_sharded_on_one_side_only_is_refused():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par import patches
    from lightning_par.tensor.parallelize import parallelize

    from torch.testing._internal.distributed.fake_pg import FakeStore

    # a one-rank process group is enough to apply a plan (no other process); torch's fake backend starts no
    # thread, where a gloo group's threads would outlive it in this process (the mesh keeps the group) and every
    # later fork-started test would inherit a group whose threads it does not have
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        model = gpt()
        plan = build_plan(model, 1, {"lm_head": "colwise"})
        with pytest.raises(ValueError, match=r"lm_head\.weight shares its weight with tok_emb\.weight"):
            parallelize(model, plan, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
        assert patches.pending() == []  # the refusal took its sharding rules out of DTensor again
    finally:
        dist.destroy_process_group()


def test_a_plan_that_shards_nothing_warns():
    with pytest.warns(UserWarning, match="shards no module of Sequential"):
        build_plan(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)), 2)


def test_fused_qkv_is_split_part_by_part_and_its_parts_must_divide():
    import torch.nn.functional as F

    class FusedAttention(nn.Module):  # nanoGPT's layout: q, k, v side by side, split with the global width
        def __init__(self, d=16, heads=2):
            super().__init__()
            self.n_head, self.n_embd = heads, d
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)

        def forward(self, x):
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    class Block(nn.Module):
        def __init__(self, d=16, heads=2):
            super().__init__()
            self.attn = FusedAttention(d, heads)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    model = nn.ModuleDict({"h": nn.ModuleList([Block(), Block()])})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left replicated, so nothing warns
        plan = build_plan(model, 2)
    assert plan.styles["h.0.attn.c_attn"] == FUSED and plan.parts["h.0.attn.c_attn"] == 3
    assert plan.styles["h.1.attn.c_proj"] == "rowwise" and plan.styles["h.1.attn"] == "prepare"
    assert plan.styles["h.0.mlp.0"] == "colwise" and plan.styles["h.0.mlp.2"] == "rowwise"
    assert "h.0.attn.c_attn: fused_colwise (3 parts)" in plan.describe()
    # 3 parts of width 6: the width, not 3 x 6 = 18, must divide by the tensor-parallel size
    odd = nn.ModuleDict({"h": nn.ModuleList([Block(d=6, heads=2)])})
    with pytest.raises(ValueError, match=r"'h\.0\.attn\.c_attn' fuses 3 projections of width 6 .* tensor_parallel_size=4"):
        build_plan(odd, 4)
