"""A Hugging Face MoE file in the per-expert layout (as ``save_pretrained`` writes it) read as the fused expert
tensors the module holds ([Note: per-expert files read as fused experts] in lightning_par/experts/hf_files.py)."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from experts_models import deepseek_v3, mixtral, qwen2_moe
from lightning_par.materialize.load import open_module_weights


def _saved(factory, tmp_path):
    torch.manual_seed(0)
    model = factory()
    model.save_pretrained(str(tmp_path))
    with torch.device("meta"):
        meta = factory()
    return model, meta, str(tmp_path / "model.safetensors")


@pytest.mark.parametrize("factory,file_expert", [
    (mixtral, "model.layers.0.block_sparse_moe.experts.0.w1.weight"),
    (qwen2_moe, "model.layers.0.mlp.experts.0.gate_proj.weight"),
    (deepseek_v3, "model.layers.1.mlp.experts.0.gate_proj.weight"),
])
def test_a_save_pretrained_file_reads_as_the_fused_module(tmp_path, factory, file_expert):
    """Every entry of the module (fused experts, Mixtral's router renamed from ``block_sparse_moe``) reads equal to
    the saved model's; a box of experts [1, 3) and rows across the gate / up boundary reads only those bytes."""
    model, meta, path = _saved(factory, tmp_path)
    with safe_open(path, "pt") as f:
        assert file_expert in f.keys() and not any(k.endswith("gate_up_proj") for k in f.keys())
    state = model.state_dict()
    with open_module_weights(path, meta) as reader:
        for name, want in state.items():
            torch.testing.assert_close(reader.read_into(name, torch.empty_like(want)), want, atol=0, rtol=0,
                                       msg=lambda m: f"{name}: {m}")
    name = next(n for n in state if n.endswith("experts.gate_up_proj"))
    whole = state[name]
    half = whole.shape[1] // 2
    box = ((1, 2), (half - 3, 6), (0, whole.shape[2]))  # experts 1-2, the last 3 gate rows and the first 3 up rows
    with open_module_weights(path, meta) as reader:
        got = reader.read_into(name, torch.empty(2, 6, whole.shape[2]), box)
        assert reader.bytes_read == got.numel() * got.element_size()
    torch.testing.assert_close(got, whole[1:3, half - 3:half + 3], atol=0, rtol=0)


def test_a_file_lacking_an_expert_is_refused_by_the_name_check(tmp_path):
    """Not converted: the strict check lists the fused tensors the module misses."""
    _, meta, path = _saved(qwen2_moe, tmp_path)
    with safe_open(path, "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if ".experts.3." not in k}
    save_file(state, str(tmp_path / "less.safetensors"))
    with pytest.raises(ValueError, match=r"missing .*model.layers.0.mlp.experts.gate_up_proj"):
        open_module_weights(str(tmp_path / "less.safetensors"), meta)
