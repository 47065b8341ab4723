"""Finding routed experts on unchanged modules, and the refusals that come before any collective."""
import pytest
from torch import nn

from experts_models import ListMoELM, deepseek_v3, mixtral, qwen2_moe
from lightning_par.experts import check_expert_layout, find_experts
from lightning_par.experts.discovery import describe


@pytest.mark.parametrize("factory,layers", [(mixtral, [0, 1]), (qwen2_moe, [0, 1]), (deepseek_v3, [1])])
def test_fused_hugging_face_experts_found(factory, layers):
    found = find_experts(factory())
    assert [c.name for c in found] == [f"model.layers.{i}.mlp.experts" for i in layers]
    assert {(c.kind, c.num_experts, tuple(c.tensors)) for c in found} == {("fused", 4, ("gate_up_proj", "down_proj"))}
    assert "model.layers.%d.mlp.experts: fused, 4 experts (gate_up_proj, down_proj)" % layers[0] in describe(found)


def test_shared_experts_and_routers_are_not_experts():
    names = [c.name for c in find_experts(qwen2_moe())] + [c.name for c in find_experts(deepseek_v3())]
    assert not any("shared" in n or n.endswith("gate") for n in names)


def test_per_expert_module_lists_found():
    found = find_experts(ListMoELM())
    assert [(c.name, c.kind, c.num_experts) for c in found] == [("layers.0.experts", "list", 4),
                                                                 ("layers.1.experts", "list", 4)]
    assert found[0].parent is not None and found[0].parent.experts is found[0].module


def test_a_glob_names_experts():
    assert [c.name for c in find_experts(mixtral(), "*.1.mlp.experts")] == ["model.layers.1.mlp.experts"]


def test_a_glob_matching_nothing_is_refused():
    with pytest.raises(ValueError, match=r"`experts='\*\.moe\.experts'` matches no module of MixtralForCausalLM"):
        find_experts(mixtral(), "*.moe.experts")


def test_a_glob_matching_no_experts_is_refused():
    with pytest.raises(ValueError, match=r"`experts='\*\.self_attn'` matches `model.layers.0.self_attn`"):
        find_experts(mixtral(), "*.self_attn")


def test_a_module_without_experts_is_refused():
    dense = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"`expert_parallel_size=2`: Sequential has no routed experts"):
        check_expert_layout(find_experts(dense), 2, "Sequential", None)


def test_ep_not_dividing_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"`expert_parallel_size=3` does not divide the 4 experts of "
                                         r"`model.layers.0.mlp.experts`"):
        check_expert_layout(find_experts(mixtral()), 3, "MixtralForCausalLM", None)
