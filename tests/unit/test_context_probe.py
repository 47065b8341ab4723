"""Context parallelism's setup check ([Note: the setup check of context parallelism] in lightning_par/context/probe.py),
one process, no group: what a module's first block receives and calls, and the refusals naming the module, what was
seen and the method that would serve it (an MLP: no sequence; eager attention: Ulysses; Bloom's ALiBi and a module's
own attention: none); the run ends after the first block and leaves the module as it was."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from context_models import family_model
from lightning_par.context.probe import check_context_parallel, probe_first_block
from models import hf_model, tiny_gpt

IDX = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))


def _hf(model):
    return lambda: model(input_ids=IDX, use_cache=False)


class OwnAttention(nn.Module):
    """A block whose attention is its own softmax(q kᵀ) v."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return x + torch.softmax(q @ k.transpose(-1, -2), -1) @ v


class OwnStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([OwnAttention(), OwnAttention()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_sdpa_blocks_are_served_by_every_method_and_the_run_stops_after_the_first_block():
    gpt = tiny_gpt()
    ran = []
    gpt.blocks[1].register_forward_hook(lambda *_: ran.append(1))
    seen = check_context_parallel(gpt, lambda: gpt(IDX), method="ring")
    assert seen.served_by() == ("ring", "allgather", "ulysses") and seen.sdpa_calls == 1
    assert seen.hidden_shape == (2, 16, 16) and not ran  # the second block never ran
    llama = hf_model("llama", attn_implementation="sdpa")
    assert check_context_parallel(llama, _hf(llama), method="allgather").hf_calls == 1


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_eager_attention_is_refused_by_the_ring_naming_ulysses(method):
    model = family_model("gemma2", attn_implementation="eager")
    with pytest.raises(ValueError, match=rf"context_parallel_method='{method}'\) cannot serve `Gemma2ForCausalLM`'s "
                                         r"block `model.layers.0` \(Gemma2DecoderLayer\), which received a hidden "
                                         r"state of shape \[2, 16, 32\] and made 0 call\(s\) of "
                                         r"F.scaled_dot_product_attention, 1 call\(s\) through Hugging Face's .*"
                                         r"Use context_parallel_method='ulysses'"):
        check_context_parallel(model, _hf(model), method=method)
    assert model.config._attn_implementation == "eager"  # restored
    assert check_context_parallel(model, _hf(model), method="ulysses").served_by() == ("ulysses",)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_attention_of_a_module_s_own_is_refused_by_every_method(method):
    bloom = family_model("bloom", attn_implementation="eager")
    with pytest.raises(ValueError, match=r"cannot serve `BloomForCausalLM`'s block `transformer.h.0` \(BloomBlock\).*"
                                         r"no method serves its attention.*baddbmm"):
        check_context_parallel(bloom, _hf(bloom), method=method)
    own = OwnStack()
    with pytest.raises(ValueError, match=r"`OwnStack`'s block `blocks.0` \(OwnAttention\).*no method serves"):
        check_context_parallel(own, lambda: own(torch.randn(2, 16, 8)), method=method)


def test_a_hidden_state_without_a_sequence_dimension_is_refused():
    mlp = nn.Sequential(*(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2)))
    with pytest.raises(ValueError, match=r"`Sequential`'s block `0` \(Sequential\), which received a hidden state of "
                                         r"shape \[4, 8\].*no sequence dimension to cut"):
        check_context_parallel(mlp, lambda: mlp(torch.randn(4, 8)), method="ring")


def test_the_probe_leaves_buffers_and_random_state_as_they_were():
    model = nn.Sequential(*(nn.Sequential(nn.BatchNorm1d(16), nn.Dropout(0.5)) for _ in range(2)))
    before = model[0][0].running_mean.clone()
    state = torch.random.get_rng_state()
    probe_first_block(model, lambda: model(torch.randn(4, 16, 3) + 5))
    assert torch.equal(model[0][0].running_mean, before) and torch.equal(torch.random.get_rng_state(), state)
