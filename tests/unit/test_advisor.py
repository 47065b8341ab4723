"""Advisor arithmetic on known cases, and the measured activation probe."""
import dataclasses

import pytest
import torch

from lightning_par.advisor import (Layout, ModuleProfile, advise, estimate, korthikanti_bytes_per_layer,
                                   profile_lightning_module)
from lightning_par.advisor.memory import stage_blocks, tp_activation_factor
from lightning_par.models import GPT

MiB = 1024**2


def toy_profile(**overrides) -> ModuleProfile:
    """4 blocks of 1000 params (all shardable), 100 embedding params, no activations unless given."""
    base = dict(total_params=4100, block_params=(1000,) * 4, first_params=100, last_params=0, tied_params=0,
                shardable_block_params=4000, block_activation_bytes=(0,) * 4, first_activation_bytes=0,
                last_activation_bytes=0, hidden_size=8, seq_len=4, num_heads=4, dtype_bytes=4)
    base.update(overrides)
    return ModuleProfile(**base)


def test_mixed_precision_adam_costs_16_bytes_per_parameter_and_zero1_shards_the_optimizer():
    prof = toy_profile()
    psi = prof.total_params
    dp = estimate(prof, Layout(data_parallel_size=4), batch_size=8, precision="bf16-mixed", optimizer="adamw")
    assert dp.param_bytes + dp.grad_bytes + dp.optimizer_bytes == 16 * psi
    z1 = estimate(prof, Layout(data_parallel_size=4, zero_stage=1), batch_size=8, precision="bf16-mixed")
    assert z1.optimizer_bytes == 8 * psi // 4
    assert estimate(prof, Layout(), 8, optimizer="sgd").optimizer_bytes == 0


def test_zero2_and_zero3_shard_gradients_and_parameters_and_count_fsdp_gathers_and_bytes():
    prof = toy_profile()
    psi, n = prof.total_params, 4
    z0, z1, z2, z3 = (estimate(prof, Layout(data_parallel_size=n, zero_stage=z), batch_size=8) for z in range(4))
    assert (z2.param_bytes, z2.grad_bytes, z2.optimizer_bytes) == (4 * psi // n, 4 * psi // n, 8 * psi // n)
    assert (z3.param_bytes, z3.grad_bytes) == (4 * psi // n, 4 * psi // n)
    # the all-gathered unsharded parameters: every unit for the step (2), one block beside the root unit (3)
    assert z2.activation_bytes - z0.activation_bytes == 4 * psi
    root = prof.first_params + prof.last_params
    assert z3.activation_bytes - z0.activation_bytes == 4 * (max(prof.block_params) + root)
    # FSDP's bytes: reduce-scatter the gradients, all-gather the parameters once (2) or, but for the root
    # unit (which stays gathered), twice (3)
    assert z2.comm_bytes == int((n - 1) / n * psi * (4 + 4))
    assert z3.comm_bytes == int((n - 1) / n * (psi * (4 + 4) + (psi - root) * 4))
    assert z1.comm_bytes == int(2 * (n - 1) / n * 4 * psi + (n - 1) / n * 4 * psi)


def test_data_parallel_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_gradients():
    prof = toy_profile()
    for n in (2, 4):
        e = estimate(prof, Layout(data_parallel_size=n), batch_size=8)
        assert e.comm_bytes == int(2 * (n - 1) / n * 4 * prof.total_params)
    assert estimate(prof, Layout(), 8).comm_bytes == 0


def test_a_16_bit_comm_hook_halves_only_the_replicas_gradient_all_reduce():
    prof = toy_profile()
    for hook in ("fp16", "bf16"):
        for layout in (Layout(data_parallel_size=4), Layout(data_parallel_size=2, zero_stage=1),
                       Layout(data_parallel_size=2, pipeline_parallel_size=2, microbatches=2)):
            plain, hooked = (estimate(prof, dataclasses.replace(layout, comm_hook=h), batch_size=8)
                             for h in (None, hook))
            # what the dp ring all-reduce sends: 2 (N - 1) / N of the stage's gradients, fp32 (4 B) or 16-bit (2 B)
            n, stage_params = layout.data_parallel_size, hooked.param_bytes / 4
            assert plain.comm_bytes - hooked.comm_bytes == pytest.approx(2 * (n - 1) / n * stage_params * 2, abs=1)
    psgd = estimate(prof, Layout(data_parallel_size=4, comm_hook="powersgd"), batch_size=8)  # not modeled: whole
    assert psgd.comm_bytes == estimate(prof, Layout(data_parallel_size=4), batch_size=8).comm_bytes


def test_pipeline_splits_block_parameters_and_1f1b_holds_p_over_m_of_gpipe_activations():
    prof = toy_profile(block_activation_bytes=(100,) * 4)
    gpipe = estimate(prof, Layout(pipeline_parallel_size=2, microbatches=8, schedule="gpipe"), batch_size=16)
    ofob = estimate(prof, Layout(pipeline_parallel_size=2, microbatches=8, schedule="1f1b"), batch_size=16)
    assert gpipe.param_bytes == 4 * (2000 + 100)  # busiest stage: 2 blocks + the embedding
    assert ofob.activation_bytes / gpipe.activation_bytes == pytest.approx(2 / 8)
    # 8 micro-batches of 2 samples, one boundary each way: b*s*h*4 bytes per message
    assert gpipe.comm_bytes == 8 * 2 * 4 * 8 * 4


def test_tensor_parallel_shards_linear_parameters_and_counts_four_all_reduces_per_layer():
    prof = toy_profile()
    tp = estimate(prof, Layout(tensor_parallel_size=2), batch_size=2)
    assert tp.param_bytes == 4 * (4000 // 2 + 100)
    assert tp.comm_bytes == int(4 * 4 * 2 * (2 - 1) / 2 * 2 * 4 * 8 * 4)  # layers × 4 × ring × b·s·h·bytes
    assert tp_activation_factor(2, sequence_parallel=True) == pytest.approx(0.5)
    assert tp_activation_factor(2, sequence_parallel=False) == pytest.approx(22 / 34)


def test_korthikanti_formula():
    # sbh(34 + 5as/h) without parallelism
    assert korthikanti_bytes_per_layer(128, 2, 64, 4) == pytest.approx(128 * 2 * 64 * (34 + 5 * 4 * 128 / 64))


def test_stage_blocks_are_contiguous_and_cover_everything():
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(ValueError, match="stages=3"):
        stage_blocks(2, 3)


def test_the_rule_data_parallel_when_it_fits_then_pipeline_then_tensor():
    prof = toy_profile(block_activation_bytes=(1000,) * 4)
    fits = advise(prof, devices=4, device_memory=10 * MiB, batch_size=8)
    assert fits.choice.layout == Layout(data_parallel_size=4)
    dp_bytes = estimate(prof, Layout(data_parallel_size=4), 8).total_bytes
    zero_bytes = estimate(prof, Layout(data_parallel_size=4, zero_stage=1), 8).total_bytes
    zero = advise(prof, devices=4, device_memory=dp_bytes - 1, batch_size=8)
    assert zero.choice.layout == Layout(data_parallel_size=4, zero_stage=1)
    # without zero stages 2 / 3 and checkpointing (the seeds' table): a pipeline
    pipe = advise(prof, devices=4, device_memory=zero_bytes - 1, batch_size=8, zero_stages=(0, 1),
                  checkpointing=(None,))
    assert pipe.choice.layout.pipeline_parallel_size == 2 and pipe.choice.layout.tensor_parallel_size == 1
    assert "pipeline across layers" in pipe.why
    # with them (an untimed profile prices communication at zero): the next zero stage that fits
    z2 = advise(prof, devices=4, device_memory=zero_bytes - 1, batch_size=8)
    assert z2.choice.layout == Layout(data_parallel_size=4, zero_stage=2), z2.table()
    # one enormous layer: no pipeline stage fits, tensor parallel must split it
    big = toy_profile(block_params=(1000, 1000, 1000, 400_000), total_params=403_100,
                      shardable_block_params=403_000)
    choice = advise(big, devices=4, device_memory=4 * 410_000 + 2_000_000 // 4, batch_size=8).choice
    assert choice is not None and choice.layout.tensor_parallel_size > 1
    nothing = advise(big, devices=2, device_memory=1000, batch_size=8)
    assert nothing.choice is None and "no layout fits" in nothing.why
    assert "recommended" in nothing.table()


def test_measured_profile_of_the_reference_gpt():
    torch.manual_seed(0)
    gpt = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    batch = (torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16)))
    prof = profile_lightning_module(gpt, batch)
    assert prof.total_params == sum(p.numel() for p in gpt.parameters())
    assert prof.block_params == tuple(sum(p.numel() for p in b.parameters()) for b in gpt.blocks)
    assert prof.tied_params == gpt.tok_emb.weight.numel()
    assert (prof.hidden_size, prof.seq_len, prof.num_heads) == (16, 16, 2)
    # per-sample activations do not depend on the probe's batch
    half = profile_lightning_module(gpt, tuple(t[:2] for t in batch))
    assert half.block_activation_bytes == prof.block_activation_bytes
    # a block saves at least its 4 linear inputs and 2 layer-norm inputs (s·h fp32 each) and at most a few
    # dozen such tensors: the same order as Korthikanti's 34 bytes·sbh in 16-bit
    sh4 = 16 * 16 * 4
    assert 6 * sh4 <= prof.block_activation_bytes[0] <= 40 * sh4
    # what tensor parallelism leaves whole: each layer norm's input and output (4 s·h) and its mean and rstd
    # (s each); q, k, v, attention and the MLP's hidden are shards ([Note: what tensor parallelism leaves whole])
    assert prof.block_whole_bytes == (4 * sh4 + 2 * 2 * 16 * 4,) * 2
    # with sequence parallelism only what the column-parallel layers read, gathered: the two norms' outputs
    assert prof.block_whole_sp_bytes == (2 * sh4,) * 2
    # after the blocks its largest saved tensor is the log-softmax of the logits (16 tokens × 32 words, fp32)
    assert prof.head_largest_bytes == 16 * 32 * 4 < prof.last_activation_bytes
    assert dataclasses.replace(prof).n_blocks == 2


def test_advise_cli_with_no_arguments_prints_a_recommendation(capsys):
    from lightning_par.advise import main

    main([])
    out = capsys.readouterr().out
    assert "recommended: DP" in out and "Korthikanti" in out


def test_advise_cli_recommends_a_pipeline_when_memory_is_short(capsys):
    from lightning_par.advise import main

    # 12 MiB: two replicas need more even fully sharded; a pipeline halves the activations of its stages (and holds
    # a gradient copy and its sends beside them), at a bubble of 1/4 of the step, while checkpointing recomputes
    main(["model.n_layer=4", "--devices", "2", "--device-memory-gb", str(12 / 1024), "--batch-size", "32"])
    out = capsys.readouterr().out
    last = out.splitlines()[-1]
    assert last.startswith("recommended: ") and "none fits" not in last, out
    # whichever is cheaper on this machine's timing, the other is priced beside it
    assert "PP2" in last and "AC " in last and "step time" in last, out


def cp_profile(**overrides) -> ModuleProfile:
    """The toy profile at 8 tokens with SDPA in every block: K and V 256 bytes a sample, the attention's output
    128, a block's saved activations 1000, embeddings 40 and logits 60 a sample."""
    base = dict(seq_len=8, block_activation_bytes=(1000,) * 4, first_activation_bytes=40, last_activation_bytes=60,
                block_kv_bytes=(256,) * 4, kv_dtype_bytes=4, block_attention_bytes=(128,) * 4)
    return toy_profile(**{**base, **overrides})


def test_context_parallel_layout_counts_its_devices_and_names_the_axis():
    lay = Layout(data_parallel_size=2, context_parallel_size=2, tensor_parallel_size=2)
    assert lay.devices == 8 and lay.name == "CP2 × TP2 × DP2"
    assert Layout(context_parallel_size=4).name == "CP4"
    with pytest.raises(ValueError, match="context_parallel_size=0"):
        Layout(context_parallel_size=0)


def test_context_parallel_divides_the_blocks_activations_and_keeps_the_model_states():
    prof = cp_profile()
    one, cp2 = (estimate(prof, Layout(context_parallel_size=c), batch_size=2) for c in (1, 2))
    assert (cp2.param_bytes, cp2.grad_bytes, cp2.optimizer_bytes) == (one.param_bytes, one.grad_bytes,
                                                                      one.optimizer_bytes)
    # [Note: the advisor under context parallelism]: the blocks (and the ring output's copy) / cp; with one stage the
    # loss runs on the pieces (the head's 60 B and the largest tensor its backward makes once more, / cp) and the
    # embeddings' 40 B stay whole (a profile that does not say which tensor is the head's largest: all 60 B)
    assert one.activation_bytes == 2 * (4 * 1000 + 40 + 60 + 60)
    assert cp2.activation_bytes == 2 * (4 * (1000 + 128) // 2 + 40 + 60 // 2 + 60 // 2)
    # dp × cp: the replicas split the batch, the cp ranks of one share it; ZeRO shards over dp only
    dpcp = estimate(prof, Layout(data_parallel_size=2, context_parallel_size=2, zero_stage=1), batch_size=4)
    assert dpcp.activation_bytes == cp2.activation_bytes and dpcp.optimizer_bytes == one.optimizer_bytes // 2


def test_context_parallel_bytes_are_the_ring_and_the_gradients_over_the_group():
    prof = cp_profile()
    psi4 = 4 * prof.total_params
    # one stage: the loss runs on the pieces, nothing is gathered leaving the stack (a pipeline stage gathers)
    for c in (2, 4):
        kv = 256 * 2 / c  # this rank's K and V
        ring = (c - 1) * kv + (c - 1) * kv + c * kv  # forward; backward: the K/V again, their gradients c hops
        cp = estimate(prof, Layout(context_parallel_size=c), batch_size=2)
        assert cp.comm_bytes == int(4 * ring + 2 * (c - 1) / c * psi4), c
    # full checkpointing runs each block's ring forward again; selective keeps its output
    full = estimate(prof, Layout(context_parallel_size=2, activation_checkpointing="full"), batch_size=2)
    sel = estimate(prof, Layout(context_parallel_size=2, activation_checkpointing="selective"), batch_size=2)
    plain = estimate(prof, Layout(context_parallel_size=2), batch_size=2)
    assert full.comm_bytes - plain.comm_bytes == 4 * 256 and sel.comm_bytes == plain.comm_bytes
    # bf16 K/V: the ring's gradient accumulators stay float32, twice the bytes of the K/V
    half = estimate(dataclasses.replace(prof, kv_dtype_bytes=2, block_kv_bytes=(128,) * 4),
                    Layout(context_parallel_size=2), batch_size=2)
    assert half.comm_bytes == int(4 * (128 + 128 + 2 * 256) + psi4)
    # dp 2 × cp 2: the gradients are all-reduced over dp and over cp
    dpcp = estimate(prof, Layout(data_parallel_size=2, context_parallel_size=2), batch_size=4)
    assert dpcp.comm_bytes == plain.comm_bytes + int(psi4)


def test_context_parallel_is_refused_without_sdpa_or_when_2cp_does_not_divide_the_sequence():
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        estimate(toy_profile(), Layout(context_parallel_size=2), batch_size=2)
    with pytest.raises(ValueError, match="2·cp = 8 chunks"):
        estimate(cp_profile(seq_len=4), Layout(context_parallel_size=4), batch_size=2)
    with pytest.raises(ValueError, match="does not compose with sequence_parallel"):
        estimate(cp_profile(), Layout(context_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True), 2)
    with pytest.raises(ValueError, match="pipeline at zero_stage 2 / 3"):
        estimate(cp_profile(), Layout(2, 2, context_parallel_size=2, zero_stage=3, microbatches=2), batch_size=4)


def test_candidates_include_context_parallel_only_for_sdpa_blocks_and_strategy_supported_layouts():
    from lightning_par.advisor import candidate_layouts

    assert {lay.context_parallel_size for lay in candidate_layouts(toy_profile(), 4, 8)} == {1}
    long = cp_profile(seq_len=16)
    cands = candidate_layouts(long, 4, 8)
    assert {lay.context_parallel_size for lay in cands} == {1, 2, 4}
    assert all(lay.devices == 4 for lay in cands)
    assert not [lay for lay in cands if lay.context_parallel_size > 1 and lay.pipeline_parallel_size > 1
                and lay.zero_stage >= 2]  # refused by the strategy
    assert {lay.context_parallel_size for lay in candidate_layouts(long, 4, 8, schedule="interleaved_1f1b")} == {1}
    assert {lay.context_parallel_size for lay in candidate_layouts(long, 4, 8, context=False)} == {1}


def eager_profile(**overrides) -> ModuleProfile:
    """:func:`cp_profile` with eager attention through Hugging Face's attention interface (no SDPA call): q, k, v and
    the output 400 bytes a sample per block."""
    base = dict(block_kv_bytes=(), kv_dtype_bytes=0, block_attention_bytes=(), block_interface_calls=(1,) * 4,
                block_attention_io_bytes=(400,) * 4)
    return cp_profile(**{**base, **overrides})


def test_eager_attention_through_the_interface_is_estimated_and_proposed_with_ulysses_only():
    from lightning_par.advisor import candidate_layouts
    from lightning_par.advisor.context import ulysses_bytes

    prof = eager_profile(seq_len=16)
    assert prof.context_methods == ("ulysses",) and cp_profile().context_methods == ("ring", "allgather", "ulysses")
    assert toy_profile().context_methods == ()  # an attention of the module's own: no method
    psi4 = 4 * prof.total_params
    for c in (2, 4):  # 4 all-to-alls of (c-1)/c of this rank's q, k, v and output, forward and backward
        est = estimate(prof, Layout(context_parallel_size=c, context_parallel_method="ulysses"), batch_size=2)
        assert est.comm_bytes == int(4 * ulysses_bytes(400 * 2 / c, c) + 2 * (c - 1) / c * psi4), c
        assert est.context_bytes == 0  # no ring working set
        assert ulysses_bytes(400 * 2 / c, c) == (c - 1) / c * 2 * (400 * 2 / c)
    with pytest.raises(ValueError, match="made none.*Ulysses serves it"):
        estimate(prof, Layout(context_parallel_size=2), batch_size=2)
    with pytest.raises(ValueError, match="2 query heads over context_parallel_size=4"):
        estimate(prof, Layout(context_parallel_size=4, tensor_parallel_size=2, context_parallel_method="ulysses"), 2)
    with pytest.raises(ValueError, match="neither scaled_dot_product_attention nor"):
        estimate(toy_profile(seq_len=16), Layout(context_parallel_size=2, context_parallel_method="ulysses"), 2)
    cands = [lay for lay in candidate_layouts(prof, 8, 8) if lay.context_parallel_size > 1]
    assert cands and {lay.context_parallel_method for lay in cands} == {"ulysses"}
    assert all((4 // lay.tensor_parallel_size) % lay.context_parallel_size == 0 for lay in cands)
    assert "CP2 ulysses" in cands[0].name or any("CP2 ulysses" in lay.name for lay in cands)


def test_the_probe_and_the_cli_see_eager_attention_and_propose_ulysses(capsys):
    from lightning_par.advise import main

    main(["model=hf", "model.config={model_type: gemma2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4,"
          " num_key_value_heads: 2, head_dim: 8, intermediate_size: 64, attn_implementation: eager}", "data.seq_len=64",
          "--batch-size", "2", "--devices", "4", "--device-memory-gb", "0.002"])
    out = capsys.readouterr().out
    # q and the output 64 tokens × 4 heads × 8 × 4 B each, k and v 2 heads: what Ulysses's all-to-alls carry
    assert "context_parallel_method='ulysses'" in out and "24,576 B per block and sample" in out, out
    assert " CP2 ulysses × DP2 " in out and " CP4 ulysses " in out and " CP2 × " not in out, out


def test_a_long_sequence_that_fits_nowhere_else_is_advised_context_parallel():
    # one sequence (no data parallel), activations far above the weights: cp 2 halves the blocks' share at no
    # recompute and no bubble; a pipeline of one micro-batch would idle half the time
    prof = cp_profile(seq_len=16, block_activation_bytes=(400_000,) * 4, block_attention_bytes=(512,) * 4)
    one = estimate(prof, Layout(), batch_size=1).total_bytes
    cp2 = estimate(prof, Layout(context_parallel_size=2), batch_size=1).total_bytes
    assert cp2 < 0.6 * one
    adv = advise(prof, devices=2, device_memory=(cp2 + one) // 2, batch_size=1)
    assert adv.choice is not None and adv.choice.layout == Layout(context_parallel_size=2), adv.table()
    assert "context parallel across the sequence" in adv.why and "CP2" in adv.table()
    assert "pipeline stages: PP2" in adv.why  # the cheapest of the other kinds, priced beside it


def test_the_probe_measures_the_keys_and_values_sdpa_receives():
    torch.manual_seed(0)
    gpt = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    batch = (torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16)))
    prof = profile_lightning_module(gpt, batch)
    sh4 = 16 * 16 * 4
    assert prof.block_kv_bytes == (2 * sh4,) * 2 and prof.kv_dtype_bytes == 4 and prof.sdpa_blocks
    assert prof.block_attention_bytes == (sh4,) * 2
    mixed = profile_lightning_module(gpt, batch, precision="bf16-mixed")
    assert mixed.block_kv_bytes == (sh4,) * 2 and mixed.kv_dtype_bytes == 2  # autocast's dtype


def test_advise_cli_proposes_context_parallel_for_a_long_sequence(capsys):
    from lightning_par.advise import main

    # one sequence of 1024 tokens on 2 devices of 20 MiB: one head (no tensor split), no replica to split the batch;
    # cp 2 halves the blocks' activations at the ring's bytes, a pipeline of one micro-batch idles half the step;
    # a corpus of one batch (the probe reads one; sampling the default 2,304 sequences of 1,025 tokens took 80%)
    args = ["model.n_head=1", "data.seq_len=1024", "data.train_sequences=16", "data.val_sequences=1", "--devices",
            "2", "--device-memory-gb", str(20 / 1024), "--batch-size", "1"]
    main(args)
    out = capsys.readouterr().out
    assert "context parallelism: considered" in out, out
    assert out.splitlines()[-1].startswith("recommended: CP2 — "), out
    main([*args, "--no-context-parallel"])
    out = capsys.readouterr().out
    assert "CP2" not in out and out.splitlines()[-1].startswith("recommended: PP2"), out


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_probe_reads_grouped_query_kv_heads_and_sees_eager_attention_through_the_interface(impl):
    from models import causal_lm

    torch.manual_seed(0)
    module = causal_lm("llama", attn_implementation=impl)()  # 4 query heads, 2 k/v heads of 8: K, V 16 B a token
    batch = (torch.randint(0, 32, (2, 16)), torch.randint(0, 32, (2, 16)))
    prof = profile_lightning_module(module, batch)
    if impl == "eager":  # no SDPA call for the ring to route: Ulysses serves it through the attention interface
        assert not prof.sdpa_blocks and prof.context_methods == ("ulysses",)
        # per sample: q and the output 16 × 4 × 8 × 4 B, K and V 16 × 2 × 8 × 4 B
        assert prof.block_interface_calls == (1, 1)
        assert prof.block_attention_io_bytes == (2 * 16 * 4 * 8 * 4 + 2 * 16 * 2 * 8 * 4,) * 2
        assert {(c.layout.context_parallel_size, c.layout.context_parallel_method)
                for c in advise(prof, 2, 2**30, 2).candidates} == {(1, "ring"), (2, "ulysses")}
        return
    assert prof.block_interface_calls == (1, 1)  # sdpa through the interface too: its bytes counted once
    assert prof.block_attention_io_bytes == (2 * 16 * 4 * 8 * 4 + 2 * 16 * 2 * 8 * 4,) * 2
    assert prof.block_kv_bytes == (2 * 16 * 2 * 8 * 4,) * 2 and prof.block_attention_bytes == (16 * 4 * 8 * 4,) * 2
    assert {c.layout.context_parallel_size for c in advise(prof, 2, 2**30, 1).candidates} == {1, 2}


def moe_profile(**overrides) -> ModuleProfile:
    """The toy profile with 800 of each block's 1000 parameters routed experts (4 experts, top-2), none of them
    linears, 200 dense linears per block."""
    base = dict(block_expert_params=(800,) * 4, num_experts=4, expert_top_k=2, shardable_block_params=800,
                expert_linear_params=0)
    return toy_profile(**{**base, **overrides})


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_holds_dense_plus_experts_over_ep_and_zero1_shards_by_holders(ep):
    prof = moe_profile()
    dense, experts = 100 + 4 * 200, 4 * 800
    e = estimate(prof, Layout(data_parallel_size=4, expert_parallel_size=ep), batch_size=8)
    assert e.param_bytes == e.grad_bytes == 4 * (dense + experts // ep)
    assert e.optimizer_bytes == 8 * (dense + experts // ep)
    holders = 4 // ep
    z1 = estimate(prof, Layout(data_parallel_size=4, zero_stage=1, expert_parallel_size=ep), batch_size=8)
    assert z1.optimizer_bytes == 8 * dense // 4 + 8 * (experts // ep) // holders
    assert Layout(data_parallel_size=4, expert_parallel_size=ep).name == f"DP4 × EP{ep}"


def test_expert_parallel_comm_is_the_two_rings_and_the_all_to_all_formula():
    prof = moe_profile()
    dense, experts, ep, dp = 100 + 4 * 200, 4 * 800, 2, 4
    e = estimate(prof, Layout(data_parallel_size=dp, expert_parallel_size=ep), batch_size=8)
    rings = 2 * (dp - 1) / dp * dense * 4 + 2 * (2 - 1) / 2 * experts / ep * 4  # dense over dp, experts over 2
    tokens = 8 // dp * prof.seq_len  # a rank's rows of the micro-batch
    all_to_all = 4 * 4 * tokens * prof.hidden_size * 2 * (ep - 1) / ep * 4  # 4 MoE blocks, out/back, fw/bw, fp32
    assert e.comm_bytes == int(rings + all_to_all)


def test_expert_parallel_candidates_and_refusals():
    from lightning_par.advisor import candidate_layouts

    names = {lay.name for lay in candidate_layouts(moe_profile(), 4, 8, checkpointing=(None,), context=False)}
    assert {"DP4 × EP2", "DP4 × EP4", "DP4 × EP2 × ZeRO-1", "TP2 × DP2 × EP2"} <= names
    assert not any("EP" in n and ("ZeRO-2" in n or "ZeRO-3" in n) for n in names)
    assert not any("EP" in lay.name for lay in candidate_layouts(toy_profile(), 4, 8, checkpointing=(None,)))
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 must be a positive integer dividing"):
        Layout(data_parallel_size=4, expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 with zero_stage=3 is refused"):
        Layout(data_parallel_size=4, zero_stage=3, expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2: the module has no routed experts"):
        estimate(toy_profile(), Layout(data_parallel_size=4, expert_parallel_size=2), 8)


def test_the_probe_and_the_cli_see_the_experts_of_a_hugging_face_moe(capsys):
    from lightning_par.advise import main

    main(["model=hf", "model.config={model_type: mixtral, hidden_size: 32, num_hidden_layers: 2, num_attention_heads:"
          " 4, num_key_value_heads: 2, intermediate_size: 32, num_local_experts: 4, num_experts_per_tok: 2}",
          "--devices", "4", "--device-memory-gb", "1", "--no-context-parallel"])
    out = capsys.readouterr().out
    assert "expert parallelism: considered" in out and "top-2" in out, out
    assert " DP4 × EP2 " in out and " DP4 × EP4 " in out, out


def test_the_probe_of_a_per_expert_moe_takes_its_layers_not_an_experts_list_as_the_blocks():
    from experts_models import MoEModule

    prof = profile_lightning_module(MoEModule("list_blocks"), (torch.randint(0, 64, (2, 8)),))
    assert prof.n_blocks == 2 and prof.moe_blocks == 2 and prof.num_experts == 4 and prof.expert_top_k == 2
    assert 0 < sum(prof.block_expert_params) == prof.expert_linear_params < prof.total_params
