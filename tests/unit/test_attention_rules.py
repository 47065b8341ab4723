"""Head-parallel attention rules without processes and without a GPU (see [Note: attention kernels under head
parallelism]): the rule functions on fake shapes, and every SDPA kernel's sharding propagated through DTensor's
own propagator on fake specs over a fake two-rank process group (no kernel runs)."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_par.tensor import attention
from lightning_par.tensor.attention import (cpu_backward, cpu_forward, cudnn_backward, cudnn_forward, mask_placement,
                                            register_attention_rules, unregister_attention_rules)

B, H, L, E = 2, 4, 8, 8
R, S = Replicate(), Shard(1)
aten = torch.ops.aten


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, device="meta", dtype=dtype)


# -- the rule functions ---------------------------------------------------------------------------------

def test_mask_placement_follows_the_head_dim():
    assert mask_placement(None, H) is None
    assert mask_placement(meta(L, L), H) == R  # broadcast over batch and heads
    assert mask_placement(meta(B, 1, L, L), H) == R  # one row for all heads
    assert mask_placement(meta(B, H, L, L), H) == S  # one row per head: split with them
    assert mask_placement(meta(H, L, L), H) == Shard(0)  # 3-D: broadcasting aligns dim 0 with the heads
    assert mask_placement(meta(B, 1, L, L), 1) == R


def test_cpu_rules_shard_by_head_and_place_the_mask():
    q = meta(B, H, L, E)
    # (outputs, inputs): inputs are q, k, v, dropout_p, is_causal, attn_mask (None: not a tensor)
    assert cpu_forward(q, q, q, 0.0, True) == [([R, R], [R, R, R, None, None, None]),
                                               ([S, S], [S, S, S, None, None, None])]
    assert cpu_forward(q, q, q, attn_mask=meta(B, 1, L, L))[1] == ([S, S], [S, S, S, None, None, R])
    assert cpu_forward(q, q, q, attn_mask=meta(B, H, L, L))[1] == ([S, S], [S, S, S, None, None, S])
    lse = meta(B, H, L)
    assert cpu_backward(q, q, q, q, q, lse, 0.0, False) == [([R] * 3, [R] * 6 + [None] * 3),
                                                            ([S] * 3, [S] * 6 + [None] * 3)]
    assert cpu_backward(q, q, q, q, q, lse, 0.0, False, attn_mask=meta(L, L))[1] == ([S] * 3, [S] * 6 + [None, None, R])


def test_cudnn_rules_answer_only_with_a_mask():
    q, lse, seed = meta(B, H, L, E), meta(B, H, L, 1), meta(dtype=torch.int64)
    assert cudnn_forward(q, q, q, None, True) is None  # torch's strategy is right there
    assert cudnn_backward(q, q, q, q, q, lse, seed, seed, None, None, None, L, L, 0.0, True) is None
    heads_out = [S, S] + [None] * 6 + [None]  # output, logsumexp, 6 non-DTensor outputs, no debug mask
    assert cudnn_forward(q, q, q, meta(B, 1, L, L), True) == [
        ([R, R] + [None] * 7, [R] * 4 + [None] * 4), (heads_out, [S, S, S, R] + [None] * 4)]
    assert cudnn_forward(q, q, q, meta(B, H, L, L), True)[1] == (heads_out, [S, S, S, S] + [None] * 4)
    # without log-sum-exp the kernel returns an empty one: replicated, as torch places it
    assert cudnn_forward(q, q, q, meta(L, L), False)[1][0][:2] == [S, R]
    # backward: philox seed and offset replicated, the broadcasting bias too, absent sequence offsets None
    got = cudnn_backward(q, q, q, q, q, lse, seed, seed, meta(B, 1, L, L), None, None, L, L, 0.0, False)
    assert got[1] == ([S] * 3, [S] * 6 + [R, R, R] + [None] * 6)


# -- through DTensor's propagator -------------------------------------------------------------------------

@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    unregister_attention_rules()  # whatever an earlier test in this process registered: start from torch's
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield DeviceMesh("cpu", [0, 1])
    finally:
        unregister_attention_rules()
        dist.destroy_process_group()


def spec(mesh, shape, placement, dtype=torch.float32):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    t = meta(*shape, dtype=dtype)
    return DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))


def kernel_calls(mesh, p, mask):
    """``(op, args, kwargs)`` of every SDPA kernel and its backward with q, k, v (and what derives from them)
    placed ``p``; ``mask`` (a spec or None) where the kernel takes one."""
    q, lse, lse4 = (spec(mesh, s, p) for s in [(B, H, L, E), (B, H, L), (B, H, L, 1)])
    seed = spec(mesh, (), R, torch.int64)
    calls = {
        aten._scaled_dot_product_flash_attention_for_cpu.default: ([q, q, q, 0.0, True], {"attn_mask": mask}),
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            ([q, q, q, q, q, lse, 0.0, True], {"attn_mask": mask}),
        aten._scaled_dot_product_efficient_attention.default: ([q, q, q, mask, True, 0.0, False], {}),
        aten._scaled_dot_product_efficient_attention_backward.default:
            ([q, q, q, q, mask, q, lse, seed, seed, 0.0, [True, True, True, False], False], {}),
        aten._scaled_dot_product_cudnn_attention.default: ([q, q, q, mask, True, 0.0, False, False], {}),
        aten._scaled_dot_product_cudnn_attention_backward.default:
            ([q, q, q, q, q, lse4, seed, seed, mask, None, None, L, L, 0.0, False], {}),
    }
    if mask is None:  # flash takes no mask
        calls[aten._scaled_dot_product_flash_attention.default] = ([q, q, q, 0.0, True], {})
        calls[aten._scaled_dot_product_flash_attention_backward.default] = (
            [q, q, q, q, q, lse, None, None, L, L, 0.0, True, spec(mesh, (2,), R, torch.int64), seed], {})
    return calls


def propagate(op, args, kwargs):
    from torch.distributed.tensor._op_schema import OpSchema

    prop = DTensor._op_dispatcher.sharding_propagator  # the schema info as DTensor's dispatcher passes it
    return prop.propagate_op_sharding(OpSchema(op, tuple(args), kwargs, schema_info=prop.op_to_schema_info.get(op)))


def placements(output_spec):
    specs = output_spec if isinstance(output_spec, tuple) else (output_spec,)
    return [s.placements[0] for s in specs if s is not None]


# the mask as each kernel sees it: the efficient kernel gets it expanded to (B, H, L, S) by SDPA, the CPU and
# cuDNN kernels as the model gave it
MASKS = {"none": None, "per-head": (B, H, L, L), "broadcast": (B, 1, L, L), "2-D": (L, L)}
EXPANDED_ONLY = (aten._scaled_dot_product_efficient_attention.default,
                 aten._scaled_dot_product_efficient_attention_backward.default)


CPU_KERNELS = (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("p", [S, R], ids=["heads", "replicated"])
def test_every_kernel_keeps_its_inputs_layout(mesh, p, mask):
    register_attention_rules()
    m = spec(mesh, MASKS[mask], R) if MASKS[mask] else None
    for op, (args, kwargs) in kernel_calls(mesh, p, m).items():
        if op in EXPANDED_ONLY and mask in ("broadcast", "2-D"):
            args = [spec(mesh, (B, H, L, L), R) if a is m else a for a in args]
        if op in CPU_KERNELS and mask == "per-head" and p == S:
            # the CPU kernel's mask is a keyword argument, which DTensor never redistributes: a mask with a row
            # per head reaches it split with the heads (SplitAttentionMasks does that before the call)
            kwargs = {"attn_mask": spec(mesh, MASKS[mask], S)}
        out = propagate(op, args, kwargs)
        got = placements(out.output_spec)
        assert got and all(x == p for x in got[:1]), (op, got)
        # head-sharded q, k, v stay where they are: nothing of them is gathered (a replicated mask is cut locally)
        if out.redistribute_schema is not None:
            moved = [(a, b) for a, b in zip(args, out.redistribute_schema.args_schema) if hasattr(a, "placements")
                     and a.placements != b.placements]
            assert all(a is m or tuple(a.shape) == (B, H, L, L) for a, _ in moved), (op, moved)
        if p == S:  # every tensor output that has a head dim is sharded on it
            assert all(x in (S, R) for x in got) and got[0] == S, (op, got)


def test_registrations_exist_for_every_kernel_and_are_given_back(mesh):
    from lightning_par.tensor.rules import strategy_of

    cpu = [aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten._scaled_dot_product_flash_attention_for_cpu_backward.default]
    cudnn = [aten._scaled_dot_product_cudnn_attention.default,
             aten._scaled_dot_product_cudnn_attention_backward.default]
    torch_only = [aten._scaled_dot_product_flash_attention.default,
                  aten._scaled_dot_product_flash_attention_backward.default,
                  aten._scaled_dot_product_efficient_attention.default,
                  aten._scaled_dot_product_efficient_attention_backward.default]
    # what serves each kernel, in DTensor's lookup order (torch 2.14 keeps most of them as single-dim strategies)
    serving = lambda: {op: strategy_of(op) for op in cpu + cudnn + torch_only}  # noqa: E731
    before = serving()
    assert not any(before[op] for op in cpu)  # DTensor has no strategy for the CPU kernel
    register_attention_rules()
    assert set(attention.rules()) == set(cpu + cudnn)
    for op in cpu + cudnn:  # ours (register_sharding / in front of torch's)
        assert strategy_of(op) is not None and strategy_of(op) is not before[op], op
    for op in torch_only:  # torch's strategies serve these kernels as they are
        assert strategy_of(op) is before[op] is not None, op
    # cuDNN with a broadcasting mask: torch's strategy fails, ours shards by head
    calls = kernel_calls(mesh, S, spec(mesh, (B, 1, L, L), R))
    fwd = aten._scaled_dot_product_cudnn_attention.default
    assert placements(propagate(fwd, *calls[fwd]).output_spec)[:2] == [S, S]
    unregister_attention_rules()
    assert serving() == before
    try:  # without the rule: torch 2.13's strategy fails, torch 2.14's gathers q, k and v
        without = placements(propagate(fwd, *calls[fwd]).output_spec)[:2]
    except AssertionError as error:
        assert "input_specs(3) != strategies(4" in str(error)
    else:
        assert without == [R, R]


def test_cpu_kernel_never_needs_its_keyword_mask_moved(mesh):
    """A per-head mask still replicated (not split before the call) cannot be split by DTensor (a keyword
    argument): the rule then offers only the replicated layout, so q, k and v are gathered, never computed
    against a mask with the wrong heads; a split mask offers only the split layout."""
    register_attention_rules()
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = spec(mesh, (B, H, L, E), S)
    whole = propagate(fwd, [q, q, q, 0.0, False], {"attn_mask": spec(mesh, (B, H, L, L), R)})
    assert placements(whole.output_spec) == [R, R]
    assert [a.placements[0] for a in whole.redistribute_schema.args_schema[:3]] == [R, R, R]
    # the same q, k, v with the mask split: a decision of its own (DTensor's cache keys the keyword mask)
    split = propagate(fwd, [q, q, q, 0.0, False], {"attn_mask": spec(mesh, (B, H, L, L), S)})
    assert placements(split.output_spec) == [S, S]
    assert cpu_forward(q, q, q, attn_mask=spec(mesh, (B, H, L, L), S)) == [([S, S], [S, S, S, None, None, S])]


def test_every_rule_of_ours_is_taken_out_again(mesh):
    """The strategy's teardown calls restore_rules: DTensor's strategies, schema infos and split-size adjusters
    are then what they were before our first registration (fused split/cat rules and the KV-cache cat too)."""
    from lightning_par.tensor.parallelize import register_rules
    from lightning_par.tensor.rules import restore_rules, strategy_of

    prop = DTensor._op_dispatcher.sharding_propagator
    # every table DTensor looks strategies up in (the single-dim ones from torch 2.14 on)
    names = ("op_strategy_funcs", "op_to_schema_info", "op_to_scalar_shape_adjuster", "op_single_dim_strategy_funcs",
             "op_to_schema_info_for_single_dim_strategy")
    tables = lambda: [dict(getattr(prop, name, {})) for name in names]  # noqa: E731
    cat, split, cpu = aten.cat.default, aten.split.Tensor, aten._scaled_dot_product_flash_attention_for_cpu.default
    before, served = tables(), {op: strategy_of(op) for op in (cat, split)}
    register_rules()
    for op in (cat, split):  # wrapped (KV cache, fused parts), wherever torch kept its strategy
        assert strategy_of(op) is not None and strategy_of(op) is not served[op], op
    assert strategy_of(cpu) is not None
    restore_rules()
    assert tables() == before
    register_rules()  # a later run registers them again
    assert strategy_of(cpu) is not None


def test_a_rule_that_cannot_be_installed_warns_once_and_changes_nothing(mesh, monkeypatch):
    """An op DTensor serves with nothing our rule could stand in front of: no silent ``False``, a warning (once)
    naming the op and what running without the rule costs, and DTensor's tables as they were."""
    from lightning_par.tensor import rules

    monkeypatch.setattr(rules, "_warned", set())
    op = aten._scaled_dot_product_flash_attention_for_cpu.default  # no strategy in DTensor before ours
    prop = DTensor._op_dispatcher.sharding_propagator
    before = dict(prop.op_strategy_funcs), dict(prop.op_to_schema_info)
    with pytest.warns(UserWarning, match=r"_scaled_dot_product_flash_attention_for_cpu.*: q, k and v are gathered"):
        assert rules.wrap_strategy(op, lambda op_schema: None, "q, k and v are gathered") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rules.wrap_strategy(op, lambda op_schema: None, "q, k and v are gathered") is False
    assert (dict(prop.op_strategy_funcs), dict(prop.op_to_schema_info)) == before
    assert rules.strategy_of(op) is None
