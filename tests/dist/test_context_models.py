"""Context parallelism on unchanged modules (lightning_par.context.apply_context_parallel) on real gloo ranks: the
reference GPT and tiny Hugging Face Llama, Qwen2 and BERT (SDPA attention, a padding mask for BERT) at cp 2 and 4
give one process's loss and, averaged over the group, every gradient (float32, 1e-5); also under full and selective
activation checkpointing, where selective keeps the attention op's outputs (no all-gather is run again in backward)
and full recomputes it. Removing it leaves no hook behind."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_par.comm import CommCounter, count_comm
from lightning_par.context import apply_context_parallel
from lightning_par.memory.checkpointing import apply_activation_checkpointing
from harness import TIMEOUT_S, free_port, start_ranks
from models import hf_model, tiny_gpt

B, S = 2, 16


def _build(family):
    torch.manual_seed(0)
    if family == "gpt":
        return tiny_gpt()
    extra = dict(pad_token_id=0) if family == "bert" else {}
    return hf_model(family, attn_implementation="sdpa", **extra)


def _loss(family, model, idx, targets):
    if family == "gpt":
        logits = model(idx)
    elif family == "bert":
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, -5:] = 0  # the second sequence is padded: an explicit mask over the whole sequence
        logits = model(input_ids=idx, attention_mask=mask).logits
    else:
        logits = model(input_ids=idx, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _check(family, cp, group, checkpointing=None, method="ring"):
    model = _build(family)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(1, 32, (B, S), generator=g), torch.randint(0, 32, (B, S), generator=g)
    ref_loss = _loss(family, reference, idx, targets)
    ref_loss.backward()
    hooks = _hooks(model)
    undo_ac = apply_activation_checkpointing(model, checkpointing).undo if checkpointing else None
    applied = apply_context_parallel(model, group, method=method)
    counter = CommCounter()
    with count_comm(counter):
        loss = _loss(family, model, idx, targets)
        forward = dict(counter.calls)
        loss.backward()
    applied.remove()
    if undo_ac:
        undo_ac()
    assert _hooks(model) == hooks, "hooks were left behind"
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    got, want = _grads(model), _grads(reference)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad / cp, want[name], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{family} cp{cp} {checkpointing} {name}: {m}")
    return forward, dict(counter.calls)


def _worker(rank, cp, port, families):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", rank=rank, world_size=cp, init_method=f"tcp://127.0.0.1:{port}")
    try:
        group = dist.new_group(list(range(cp)))
        for family in families:
            _check(family, cp, group)
        if "gpt" in families:
            n_layer = 2
            _check("gpt", cp, group, method="allgather")
            # selective keeps the op's outputs: backward runs only the op's backward (all-gather: the reduce-scatter;
            # ring: K/V again, cp - 1 hops, and their gradients, cp hops); full recomputes the op's forward too
            _, calls = _check("gpt", cp, group, checkpointing="selective", method="allgather")
            assert calls.get("all_gather[bwd]", 0) == 0 and calls["reduce_scatter[bwd]"] == n_layer, calls
            _, calls = _check("gpt", cp, group, checkpointing="full", method="allgather")
            assert calls["all_gather[bwd]"] == n_layer and calls["reduce_scatter[bwd]"] == n_layer, calls
            _, calls = _check("gpt", cp, group, checkpointing="selective")
            assert calls["send[bwd]"] == n_layer * (2 * cp - 1), calls
            _, calls = _check("gpt", cp, group, checkpointing="full")
            assert calls["send[bwd]"] == n_layer * (3 * cp - 2), calls
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("families", [("gpt",), ("llama", "qwen2", "bert")], ids=["gpt", "hf"])
def test_context_parallel_equals_one_process(cp, families):
    start_ranks(_worker, (cp, free_port(), families), nprocs=cp)


class _Blk(torch.nn.Module):
    """A block taking an extra tensor; with ``attend=False`` it mixes nothing across positions (no SDPA)."""

    def __init__(self, attend=True):
        super().__init__()
        self.lin, self.attend = torch.nn.Linear(4, 4), attend

    def forward(self, x, extra=None):
        y = self.lin(x)
        if self.attend:
            y = F.scaled_dot_product_attention(y[:, None], y[:, None], y[:, None], is_causal=True)[:, 0]
        return y


class _Stack(torch.nn.Module):
    def __init__(self, attend=True):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Blk(attend), _Blk(attend)])

    def forward(self, x, extra=None):
        for b in self.blocks:
            x = b(x, extra)
        return x


def _refused(group, model, call, error, match):
    applied = apply_context_parallel(model, group)
    try:
        with pytest.raises(error, match=match):
            call()
    finally:
        applied.remove()
    q = torch.randn(1, 2, 4, 8)  # no mode is left routing SDPA: cross-attention runs as usual
    F.scaled_dot_product_attention(q, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))


def _refusal_worker(rank, cp, port):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", rank=rank, world_size=cp, init_method=f"tcp://127.0.0.1:{port}")
    try:
        group = dist.new_group(list(range(cp)))
        gpt = tiny_gpt()
        _refused(group, gpt, lambda: gpt(torch.zeros(2, 10, dtype=torch.long)), ValueError,
                 r"sequence entering `blocks.0` .* length 10 into 2 × context_parallel_size = 4")
        drop = tiny_gpt(dropout=0.1)
        _refused(group, drop, lambda: drop(torch.zeros(2, 16, dtype=torch.long)), ValueError,
                 r"dropout_p == 0 only; SDPA was called with dropout_p=0.1")
        stack, x = _Stack(), torch.randn(2, 8, 4)
        _refused(group, stack, lambda: stack(x, torch.randn(8, 3, 8)), ValueError,
                 r"enters `blocks.0` as extra along the sequence \(length 8\), and this tensor of shape \(8, 3, 8\) "
                 r"has that length in dimensions \[0, 2\]")
        plain = _Stack(attend=False)
        _refused(group, plain, lambda: plain(x), RuntimeError,
                 r"Block `blocks.0` \(_Blk\) ran without calling `torch.nn.functional.scaled_dot_product_attention`")
        # a tensor with the sequence in one dimension is cut along it, a key mask [.., 1, S] is kept whole
        applied = apply_context_parallel(stack, group)
        out = stack(x, torch.randn(3, 8))
        applied.remove()
        torch.testing.assert_close(out, stack(x))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_context_parallel_refusals_name_the_block_and_leave_nothing_behind():
    start_ranks(_refusal_worker, (2, free_port()), nprocs=2)
