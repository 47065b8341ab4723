"""The setup check's building blocks without processes ([Note: the setup check] in lightning_par/verify.py), and
Hugging Face's use_cache turned off under activation checkpointing ([Note: no key-value cache while recomputing])."""
import warnings

import pytest
import torch
from torch import nn

from lightning_par.memory.checkpointing import apply_activation_checkpointing, use_cache_off
from lightning_par.verify import apply_setup_check, perturb_, realize, record_inputs, refuse_if_different, tolerance


class Block(nn.Module):
    """A block whose forward needs more than its hidden state (a mask and a scale by keyword)."""

    def __init__(self, d=16):
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        nn.init.zeros_(self.proj.bias)  # as Hugging Face initializes every bias

    def forward(self, x, mask, *, scale=1.0):
        return self.proj(torch.relu(self.fc(x)) * scale) * mask


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        mask = (x.sum(-1, keepdim=True) > 0).float()
        for b in self.blocks:
            x = x + b(x, mask, scale=0.5)
        return x


def _inputs():
    net = Net()
    found = record_inputs(net, ["blocks.1"], lambda: net(torch.randn(2, 4, 16)))
    return net, found


def test_record_inputs_keeps_positional_and_keyword_inputs_of_the_first_call():
    net, found = _inputs()
    (x, mask), kwargs = found["blocks.1"]
    assert x.shape == (2, 4, 16) and mask.shape == (2, 4, 1) and kwargs == {"scale": 0.5}
    assert not x.requires_grad and all(p.grad is None for p in net.parameters())


def test_realize_gives_meta_inputs_seeded_values_and_keeps_real_ones():
    real = torch.ones(2)
    cos = torch.empty(1, 4, 8, device="meta")
    inputs = ((torch.empty(1, 4, 8, device="meta"),),
              {"position_embeddings": (cos, cos), "position_ids": torch.empty(1, 4, dtype=torch.long, device="meta"),
               "mask": torch.empty(4, dtype=torch.bool, device="meta"), "kept": real, "flag": True})
    (x,), kw = realize(inputs)
    assert x.device.type == "cpu" and x.shape == (1, 4, 8) and x.std() > 0.5
    assert torch.equal(kw["position_ids"], torch.arange(4).unsqueeze(0)) and kw["mask"].all()
    assert kw["kept"] is real and kw["flag"] is True and kw["position_embeddings"][0].shape == cos.shape
    (again,), _ = realize(inputs)
    assert torch.equal(again, x)  # seeded: every rank runs the check on the same values


def test_perturb_makes_zero_biases_non_zero_and_draws_the_same_on_every_call():
    a, b = Block(), Block()
    b.load_state_dict(a.state_dict())
    perturb_(a), perturb_(b)
    assert a.proj.bias.abs().min() > 0
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_tolerance_is_rounding_of_a_sum_of_width_terms():
    ref = torch.tensor([3.0])
    assert tolerance(ref, torch.float32, 64) == pytest.approx(16 * 8 * torch.finfo(torch.float32).eps * 4)
    assert tolerance(ref, torch.bfloat16, 64) > 1e3 * tolerance(ref, torch.float32, 64)


def test_the_check_passes_an_exact_rewrite_and_catches_a_doubled_bias_on_recorded_inputs():
    net, found = _inputs()
    block = net.blocks[1]
    same = apply_setup_check(block, lambda m: m, found["blocks.1"])
    assert same.ok and same.error <= same.allowed

    def doubled(m):  # the bias added once more (what a row-wise split that adds it on every rank does)
        m.proj.register_forward_hook(lambda mod, args, out: out + mod.bias)
        return m

    verdict = apply_setup_check(block, doubled, found["blocks.1"])
    assert not verdict.ok and verdict.key == "output 0" and verdict.error > 1e3 * verdict.allowed
    assert block.proj.bias.abs().max() == 0  # the original is untouched (the copy was perturbed)
    with pytest.raises(ValueError, match=r"context parallel: the setup check of 'blocks\.1' \(Block\) failed: the "
                                         r"rewritten block's output 0 differs from the original's by .*verify=False"):
        refuse_if_different(verdict, "blocks.1", block, "context parallel", "Use context_parallel_size=1.")
    raising = apply_setup_check(block, lambda m: (_ for _ in ()).throw(RuntimeError("no rule")), found["blocks.1"])
    assert not raising.ok and raising.describe() == "the rewritten block raised RuntimeError: no rule"


class CacheUser(nn.Module):
    """A Hugging Face-like model: a ``config.use_cache`` and a ``use_cache`` keyword."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"use_cache": True})()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
        self.seen = []

    def forward(self, x, use_cache=None):
        self.seen.append(self.config.use_cache if use_cache is None else use_cache)
        for layer in self.layers:
            x = layer(x)
        return x


def test_use_cache_is_off_while_training_with_one_warning():
    m = CacheUser()
    done = apply_activation_checkpointing(m, "full", blocks="layers")
    with pytest.warns(UserWarning, match=r"CacheUser is called with use_cache=True.*use_cache=False while training"):
        m(torch.randn(2, 4)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per application
        m(torch.randn(2, 4), use_cache=True)
        m.eval()
        m(torch.randn(2, 4))  # evaluation keeps the cache
    assert m.seen == [False, False, True]
    done.undo()
    m.train()
    m(torch.randn(2, 4))
    assert m.seen[-1] is True  # taken out with the checkpointing


def test_use_cache_off_leaves_modules_without_the_keyword_alone():
    undo = use_cache_off(nn.Linear(2, 2))
    undo()


def test_verify_is_a_checked_keyword_of_the_strategies_that_rewrite_blocks():
    from lightning_par import HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy

    for cls in (TensorParallelStrategy, PipelineParallelStrategy, HybridParallelStrategy):
        assert cls()._options.verify.verify is True and cls(verify=False)._options.verify.verify is False
    with pytest.raises(ValueError, match=r"`verify='no'` must be True or False"):
        TensorParallelStrategy(verify="no")
