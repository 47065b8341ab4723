"""The single-process pieces of context parallelism (lightning_par.context): the load-balanced layout, the block
kernel against SDPA (output, log-sum-exp merge, backward; causal, GQA, masks), and the refusals made before any
collective (no block stack, eager attention, dropout, cross-attention)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.context import OPS, apply_context_parallel, check_divisible, context_attention
from lightning_par.context import group_positions, local_positions, shard
from lightning_par.context.kernel import block_backward, block_bias, block_forward, merge
from lightning_par.memory.checkpointing import SAVED_OPS
from models import hf_model


def test_each_rank_holds_chunk_i_and_its_mirror():
    assert local_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert sorted(group_positions(16, 4).tolist()) == list(range(16))
    x = torch.arange(16.0, requires_grad=True)
    shard(x, 0, 4, 1).sum().backward()
    assert x.grad.nonzero().flatten().tolist() == [2, 3, 12, 13]  # the gradient lands where the piece came from


def test_a_length_that_2cp_does_not_divide_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"length 12 .* 2 × context_parallel_size = 8"):
        check_divisible(12, 4)


def _qkv(h=4, hk=4, s=12, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, s, e, generator=g, dtype=torch.float64).float().requires_grad_() for n in (h, hk, hk)]


@pytest.mark.parametrize("rows", [128, 5])  # one chunk of queries, or chunks of 5 rows (12 = 5 + 5 + 2)
@pytest.mark.parametrize("kind", ["causal", "bidirectional", "gqa", "bool", "additive"])
def test_block_kernel_and_merge_equal_sdpa(kind, rows):
    hk = 2 if kind == "gqa" else 4
    q, k, v = _qkv(hk=hk)
    s, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
    mask = {"bool": torch.rand(2, 1, s, s) > 0.3, "additive": torch.randn(2, 4, s, s)}.get(kind)
    if kind == "bool":
        mask |= torch.eye(s, dtype=torch.bool)
    causal = kind in ("causal", "gqa")
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=kind == "gqa")
    dout = torch.randn_like(ref)
    ref.backward(dout)
    pos = torch.arange(s)
    groups = 4 // hk
    out, lse = block_forward(q, k, v, scale, block_bias(pos, pos, causal, mask), groups, rows)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # two disjoint key sets merged by their log-sum-exp give the same output
    halves = [pos[:5], pos[5:]]
    parts = [block_forward(q, k[..., p, :], v[..., p, :], scale,
                           block_bias(pos, p, causal, None if mask is None else mask[..., p]), groups, rows)
             for p in halves]
    merged, merged_lse = merge(*parts[0], *parts[1])
    torch.testing.assert_close(merged, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)
    dq, dk, dv = block_backward(q, k, v, scale, block_bias(pos, pos, causal, mask), out, lse, dout, groups, rows)
    for mine, full in zip((dq, dk, dv), (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, full, atol=1e-5, rtol=1e-5)


def test_a_row_with_no_key_gets_zero_output_and_merges_away():
    q, k, v = _qkv(s=4)
    nothing = torch.zeros(4, 4, dtype=torch.bool)
    out, lse = block_forward(q, k, v, 0.5, block_bias(torch.arange(4), torch.arange(4), False, nothing))
    assert torch.isinf(lse).all() and (out == 0).all()
    some = block_forward(q, k, v, 0.5, None)
    torch.testing.assert_close(merge(out, lse, *some)[0], some[0])


def test_the_attention_ops_are_kept_by_selective_checkpointing():
    assert set(OPS) <= SAVED_OPS


def test_dropout_and_cross_attention_are_refused_by_name():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"dropout_p == 0 only; SDPA was called with dropout_p=0.1"):
        context_attention(q, k, v, dropout_p=0.1, group=None)
    with pytest.raises(ValueError, match=r"12 queries against 6 keys"):
        context_attention(q, k[..., :6, :], v[..., :6, :], group=None)
    with pytest.raises(ValueError, match=r"method='flash'"):
        context_attention(q, k, v, group=None, method="flash")


def test_a_module_without_a_block_stack_is_refused():
    with pytest.raises(ValueError, match=r"Context parallelism cuts the sequence inside a block stack, and No block"):
        apply_context_parallel(nn.Linear(4, 4), group=None)


def test_eager_attention_is_refused_naming_the_fix():
    model = hf_model("llama", attn_implementation="eager")
    with pytest.raises(ValueError, match=r"attn_implementation='eager'.*attn_implementation=\"sdpa\""):
        apply_context_parallel(model, group=None)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_the_guard_leaves_a_routing_mode_that_a_base_exception_left_entered():
    """A pipeline stage ends its step with ``StopStage``, a ``BaseException`` that always-call hooks do not see."""
    from lightning_par.context.apply import ContextParallel
    from lightning_par.context.intercept import RouteAttention

    class Stop(BaseException):
        pass

    applied, mode = ContextParallel(path="blocks", group=None, method="ring", seq_dim=1), RouteAttention(None)
    with pytest.raises(Stop):
        with applied.guard():
            mode.__enter__()
            applied._modes.append((None, mode))
            raise Stop()
    assert not applied._modes
    q = torch.randn(1, 2, 4, 8)
    F.scaled_dot_product_attention(q, q, q)  # not routed: the mode is gone
    assert mode.calls == 0


def test_the_hydra_override_reaches_the_strategy():
    from app_config import compose_app
    from lightning_par import train

    cfg = compose_app("strategy=hybrid", "strategy.context_parallel_size=2")
    strategy = train.build_strategy(cfg.strategy)
    assert strategy._options.layout.context_parallel_size == 2


def test_layouts_context_parallelism_does_not_compose_with_yet_are_named():
    from lightning_par.context.layout import check_context_layout

    check_context_layout(1, pipeline_parallel_size=4, zero_stage=3)  # nothing to check without cp
    check_context_layout(2, pipeline_parallel_size=2, zero_stage=1, schedule="gpipe")
    with pytest.raises(ValueError, match=r"`context_parallel_size=2` with `zero_stage=3` .* Use zero_stage=0 or 1"):
        check_context_layout(2, pipeline_parallel_size=2, zero_stage=3)
    with pytest.raises(ValueError, match=r"`schedule='interleaved_1f1b'` .* Use schedule='1f1b', 'gpipe'"):
        check_context_layout(2, pipeline_parallel_size=2, schedule="interleaved_1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match=r"`context_parallel_size=2` with `fault_tolerance='torchft'`"):
        check_context_layout(2, pipeline_parallel_size=1, fault_tolerance="torchft")


def test_the_cp_axis_sits_just_outside_tp_and_sizes_that_miss_the_world_are_named():
    from lightning_par.topology import DP_OUTERMOST, Topology

    t = Topology.resolve(8, context_parallel_size=2, tensor_parallel_size=2)  # dp "auto": 8 / (cp × tp) = 2
    assert (t.data_parallel_size, t.axes, t.shape) == (2, ("pp", "dp", "cp", "tp"), (1, 2, 2, 2))
    assert t.all_groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]] and t.sampler_kwargs(2) == {"num_replicas": 2,
                                                                                            "rank": 0}
    assert Topology.resolve(8, context_parallel_size=2, tensor_parallel_size=2, order=DP_OUTERMOST).axes == (
        "dp", "pp", "cp", "tp")
    assert "cp" not in Topology.resolve(4).axes  # without cp the mesh is as before
    with pytest.raises(ValueError, match=r"`data_parallel_size=2`, `pipeline_parallel_size=1`, "
                                         r"`context_parallel_size=2` and `tensor_parallel_size=1` multiplied \(4\) "
                                         r"should equal the world size \(6\)"):
        Topology.resolve(6, data_parallel_size=2, context_parallel_size=2,
                         named=("data_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                                "tensor_parallel_size"))


def test_the_method_is_a_strategy_keyword_and_a_hydra_key():
    from app_config import compose_app
    from lightning_par import HybridParallelStrategy, train

    cfg = compose_app("strategy=hybrid", "strategy.context_parallel_size=2", "strategy.context_parallel_method=ulysses")
    assert train.build_strategy(cfg.strategy)._options.layout.context_parallel_method == "ulysses"
    assert HybridParallelStrategy(context_parallel_size=2)._options.layout.context_parallel_method == "ring"
    with pytest.raises(ValueError, match=r"`context_parallel_method='flash'` must be 'ring' .* 'allgather' .* "
                                         r"'ulysses'"):
        HybridParallelStrategy(context_parallel_size=2, context_parallel_method="flash")
