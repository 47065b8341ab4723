"""The advisor's activation memory under activation checkpointing: formulas against hand-computed values, the
estimate per mode, the time cost, and the plan it recommends when the activations do not fit."""
import pytest
import torch

from lightning_par.advisor import (Layout, ModuleProfile, advise, estimate, korthikanti_bytes_per_layer,
                                   korthikanti_stack_bytes, profile_lightning_module)
from lightning_par.advisor.choose import bubble_share
from lightning_par.advisor.memory import backward_gradient_bytes, block_kept_bytes, checkpointed, recompute_share
from lightning_par.models import GPT

MiB = 1024**2


def ac_profile(**overrides) -> ModuleProfile:
    """4 blocks of 1000 params; per sample each block saves 1000 B, its input is 100 B and its matmul / attention
    outputs 300 B; timed: a step 3 s a sample, the blocks' forward 1 s, 20% of it outside the kept ops."""
    base = dict(total_params=4100, block_params=(1000,) * 4, first_params=100, last_params=0, tied_params=0,
                shardable_block_params=4000, block_activation_bytes=(1000,) * 4, first_activation_bytes=0,
                last_activation_bytes=0, hidden_size=8, seq_len=4, num_heads=4, dtype_bytes=4,
                block_input_bytes=100, selective_bytes=(300,) * 4, step_s_per_sample=3.0,
                block_forward_s_per_sample=1.0, selective_recompute_share=0.2)
    base.update(overrides)
    return ModuleProfile(**base)


def test_korthikanti_per_layer_in_16_bit_for_every_mode_and_parallelism():
    s, b, h, a = 2048, 1, 4096, 32
    sbh = s * b * h
    assert korthikanti_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)     # 114 sbh here
    assert korthikanti_bytes_per_layer(s, b, h, a, t=4) == sbh * (10 + 6 + 5 * a * s / (h * 4))
    # 5as/(ht) = 80 / 4 here
    assert korthikanti_bytes_per_layer(s, b, h, a, t=4, sequence_parallel=True) == sbh * (34 / 4 + 20)
    # full: the layer's 16-bit input; selective: + the matmul and attention outputs, 10sbh elements, 20sbh bytes
    assert korthikanti_bytes_per_layer(s, b, h, a, checkpointing="full") == 2 * sbh
    assert korthikanti_bytes_per_layer(s, b, h, a, checkpointing="selective") == 22 * sbh
    # TP2: column-parallel outputs halved, the row-parallel partial sums and their all-reduced outputs whole
    assert korthikanti_bytes_per_layer(s, b, h, a, t=2, checkpointing="selective") == sbh * (2 + 8 + 4 + 4)
    assert korthikanti_bytes_per_layer(s, b, h, a, t=2, sequence_parallel=True,
                                       checkpointing="selective") == sbh * (1 + 8 + 4 + 2)
    assert korthikanti_bytes_per_layer(s, b, h, a, t=2, sequence_parallel=True, checkpointing="full") == sbh
    # the example: 0.96 GB (10^9) per layer and sequence at s=2048, h=4096, a=32
    assert korthikanti_bytes_per_layer(s, b, h, a) == pytest.approx(0.956e9, rel=1e-3)


def test_korthikanti_stack_keeps_the_inputs_and_recomputes_one_layer():
    s, b, h, a = 2048, 1, 4096, 32
    sbh, off = s * b * h, 114 * s * b * h
    assert korthikanti_stack_bytes(8, s, b, h, a) == 8 * off
    # full: the last layer recomputes its whole activations beside the 7 inputs before it
    assert korthikanti_stack_bytes(8, s, b, h, a, checkpointing="full") == 7 * 2 * sbh + off
    # every 3rd of 8: layers 0, 3, 6 keep their input, 5 keep everything; when layer 6 recomputes, layer 7 has
    # freed its activations already: the peak is at the start of backward
    assert korthikanti_stack_bytes(8, s, b, h, a, checkpointing=3) == 5 * off + 3 * 2 * sbh
    # every 2nd of 3: layers 0 and 2 keep inputs; layer 2 recomputes beside layers 0 and 1
    assert korthikanti_stack_bytes(3, s, b, h, a, checkpointing=2) == 2 * sbh + off + off
    assert korthikanti_stack_bytes(8, s, b, h, a, checkpointing="selective") == 7 * 22 * sbh + off
    # fp32 doubles it: the same arithmetic with 4-byte elements (the probe measures in the training dtype)
    with pytest.raises(ValueError, match="activation_checkpointing=0 must be None"):
        korthikanti_stack_bytes(8, s, b, h, a, checkpointing=0)


@pytest.mark.parametrize("bad", [0, -1, True, "yes", 1.5])
def test_a_bad_checkpointing_mode_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=f"activation_checkpointing={bad!r}"):
        Layout(activation_checkpointing=bad)


def test_every_kth_block_counts_in_the_whole_stack():
    assert [checkpointed(2, i) for i in range(5)] == [True, False, True, False, True]
    assert [checkpointed(1, i) for i in range(3)] == [True] * 3
    assert not checkpointed(None, 0) and checkpointed("full", 3) and checkpointed("selective", 1)


def test_estimate_per_mode_on_one_device_by_hand():
    prof = ac_profile()
    acts = {mode: estimate(prof, Layout(activation_checkpointing=mode), batch_size=2).activation_bytes
            for mode in (None, "full", 2, "selective")}
    # kept per sample × 2 samples, + the last block's recompute (its 1000 B less what it kept) and the gradients its
    # backward holds beside it (its output's, 100 B, and two inputs' worth of hidden ones: 300 B) × 2 samples
    assert acts[None] == 4 * 1000 * 2
    assert acts["full"] == 4 * 100 * 2 + (900 + 300) * 2
    # block 2 recomputes after block 3 freed its 1000 B: 2 × 100 + 1000 + 1000 + 300 beside it, 200 B over the
    # forward's end
    assert acts[2] == (2 * 100 + 2 * 1000 + 200) * 2
    assert acts["selective"] == 4 * (100 + 300) * 2 + (600 + 300) * 2
    # parameters, gradients and optimizer state do not change
    assert len({estimate(prof, Layout(activation_checkpointing=m), 2).param_bytes for m in acts}) == 1


def test_estimate_under_pipeline_tensor_and_sequence_parallel_by_hand():
    prof = ac_profile()
    # PP2, 1F1B, m=4, batch 8: micro-batches of 2; stage 0 holds min(p, m) = 2 in flight, each block its input
    pp = estimate(prof, Layout(pipeline_parallel_size=2, microbatches=4, activation_checkpointing="full"), 8)
    assert pp.activation_bytes == 2 * 100 * 2 * 2 + (900 + 300) * 2
    # every 2nd block of the stack: stage 1 holds blocks 2 (checkpointed) and 3 (not), one micro-batch in flight
    lay = Layout(pipeline_parallel_size=2, microbatches=4, schedule="gpipe", activation_checkpointing=2)
    gpipe = estimate(prof, lay, 8)  # GPipe: 4 micro-batches in flight on both stages; block 2's recompute comes
    # after block 3 freed its activations: 100 + 1000 + 300 of gradients beside it, 200 B over what it kept
    assert gpipe.activation_bytes == (100 + 1000) * 2 * 4 + 200 * 2
    # TP2: a block's share (10 + 24/2) / 34 without checkpointing; the input stays whole, 1/2 with SP
    tp_off = block_kept_bytes(prof, 0, None, t=2)
    assert tp_off == pytest.approx(1000 * 22 / 34)
    assert block_kept_bytes(prof, 0, "full", t=2) == 100
    assert block_kept_bytes(prof, 0, "full", t=2, sequence_parallel=True) == 50
    assert block_kept_bytes(prof, 0, "selective", t=2) == pytest.approx(100 + 300 * (8 / 2 + 2 + 2) / 10)
    assert block_kept_bytes(prof, 0, "selective", t=2, sequence_parallel=True) == pytest.approx(
        50 + 300 * (8 / 2 + 2 + 1) / 10)
    tp = estimate(prof, Layout(tensor_parallel_size=2, activation_checkpointing="full"), 2)
    # the output's gradient whole (100 B), the hidden ones 1/2: 2 × 100 / 2
    assert tp.activation_bytes == int(4 * 100 * 2 + (tp_off - 100 + 100 + 100) * 2)
    # a probe that found which saved bytes a tensor-parallel rank holds whole: those once, the rest / t; with
    # sequence parallelism only the gathered inputs of the column-parallel layers (and what is not from the input)
    split = ac_profile(block_whole_bytes=(250,) * 4, block_whole_sp_bytes=(120,) * 4)
    assert block_kept_bytes(split, 0, None, t=2) == 250 + 750 / 2
    assert block_kept_bytes(split, 0, None, t=2, sequence_parallel=True) == 120 + 880 / 2
    assert block_kept_bytes(ac_profile(), 0, None, t=2, sequence_parallel=True) == 500  # without: Korthikanti's 1/t
    assert block_kept_bytes(split, 0, None, t=1) == 1000
    assert block_kept_bytes(split, 0, "full", t=2) == 100
    tp_split = estimate(split, Layout(tensor_parallel_size=2, activation_checkpointing="full"), 2)
    assert tp_split.activation_bytes == int(4 * 100 * 2 + (625 - 100 + 100 + 100) * 2)


def test_recompute_time_from_the_probe_and_the_pipeline_bubble():
    prof = ac_profile()
    assert recompute_share(prof, None) == 0
    assert recompute_share(prof, "full") == pytest.approx(1 / 3)         # 1 s of blocks' forward in a 3 s step
    assert recompute_share(prof, 2) == pytest.approx(1 / 6)              # half of the blocks
    assert recompute_share(prof, "selective") == pytest.approx(0.2 / 3)  # only the ops it does not keep
    untimed = ac_profile(step_s_per_sample=0.0)
    assert recompute_share(untimed, "full") == pytest.approx(1 / 3)      # the forward again: a third of a step
    assert bubble_share(Layout(pipeline_parallel_size=4, microbatches=8)) == pytest.approx(3 / 8)
    assert bubble_share(Layout(pipeline_parallel_size=4, microbatches=8, schedule="zero_bubble")) == pytest.approx(
        0.25)


def test_a_model_that_fits_by_parameters_but_not_activations_gets_checkpointing_with_its_time_cost():
    prof = ac_profile(block_activation_bytes=(100_000,) * 4, block_input_bytes=1000, selective_bytes=(30_000,) * 4)
    states = estimate(prof, Layout(), 4)
    assert states.activation_bytes > 10 * (states.param_bytes + states.grad_bytes + states.optimizer_bytes)
    full = estimate(prof, Layout(activation_checkpointing="full"), 4).total_bytes
    adv = advise(prof, devices=1, device_memory=full, batch_size=4)
    assert adv.choice.layout == Layout(activation_checkpointing="full")
    assert "activation checkpointing" in adv.why and "+33% step time (recompute 33%)" in adv.why
    selective = estimate(prof, Layout(activation_checkpointing="selective"), 4).total_bytes
    assert selective > full
    cheaper = advise(prof, devices=1, device_memory=selective, batch_size=4)
    assert cheaper.choice.layout.activation_checkpointing == "selective", cheaper.table()
    assert "+7% step time" in cheaper.why
    table = adv.table()
    assert "single × AC full" in table and "+33%" in table and "recompute 33%" in table


def test_checkpointing_is_weighed_against_more_pipeline_stages_and_a_higher_zero_stage():
    prof = ac_profile(block_activation_bytes=(100_000,) * 4, block_input_bytes=1000, selective_bytes=(30_000,) * 4)
    # 2 devices: DP2 ZeRO-3 alone does not fit; checkpointing (+33%) or a pipeline of 8 micro-batches (bubble
    # 1/8) does: the pipeline is cheaper, and checkpointing is priced beside it
    pp = estimate(prof, Layout(pipeline_parallel_size=2, microbatches=8), 16).total_bytes
    assert estimate(prof, Layout(data_parallel_size=2, zero_stage=3), 16).total_bytes > pp
    adv = advise(prof, devices=2, device_memory=pp, batch_size=16, microbatches=8)
    assert adv.choice.layout == Layout(pipeline_parallel_size=2, microbatches=8), adv.table()
    assert "bubble 12%" in adv.why and "activation checkpointing: " in adv.why, adv.why
    # a pipeline of 2 micro-batches (bubble 1/2) costs more than selective checkpointing (0.2 of the forward);
    # the logits (held by the last stage for one micro-batch, by a replica for all of them) keep DP2 ZeRO-3 above
    # the pipeline's stage 0, which holds a gradient copy and its sends beside the same activations
    prof = ac_profile(block_activation_bytes=(100_000,) * 4, block_input_bytes=1000, selective_bytes=(30_000,) * 4,
                      last_activation_bytes=2000)
    pp2 = estimate(prof, Layout(pipeline_parallel_size=2, microbatches=2), 16).total_bytes
    assert estimate(prof, Layout(data_parallel_size=2, zero_stage=3), 16).total_bytes > pp2
    adv2 = advise(prof, devices=2, device_memory=pp2, batch_size=16, microbatches=2)
    assert adv2.choice.layout == Layout(data_parallel_size=2, activation_checkpointing="selective"), adv2.table()
    assert "+7% step time (recompute 7%)" in adv2.why and "pipeline stages: PP2(1f1b, m=2) +50%" in adv2.why


def test_zero_stages_2_and_3_are_proposed_and_chosen_when_they_fit():
    prof = ac_profile(block_activation_bytes=(10,) * 4, step_s_per_sample=0.0)
    names = {c.layout.name for c in advise(prof, devices=4, device_memory=MiB, batch_size=8).candidates}
    assert {"DP4 × ZeRO-2", "DP4 × ZeRO-3", "DP4 × ZeRO-3 × AC full"} <= names
    z2 = estimate(prof, Layout(data_parallel_size=4, zero_stage=2), 8).total_bytes
    z3 = estimate(prof, Layout(data_parallel_size=4, zero_stage=3), 8).total_bytes
    assert z3 < z2
    adv = advise(prof, devices=4, device_memory=z3, batch_size=8)
    assert adv.choice.layout == Layout(data_parallel_size=4, zero_stage=3), adv.table()


def test_the_probe_measures_block_inputs_matmul_outputs_and_times_the_step():
    torch.manual_seed(0)
    gpt = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    batch = (torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16)))
    prof = profile_lightning_module(gpt, batch)
    sh4 = 16 * 16 * 4  # one s × h fp32 tensor per sample
    assert prof.block_input_bytes == sh4
    # q, k, v, attention, output projection, up (4h) and down projection: 10 sh, and the attention's logsumexp
    assert all(10 * sh4 <= b <= 10 * sh4 + 16 * 2 * 4 for b in prof.selective_bytes), prof.selective_bytes
    assert prof.step_s_per_sample > 0 and 0 < prof.block_forward_s_per_sample < prof.step_s_per_sample
    assert 0 < prof.selective_recompute_share < 1


def test_advise_cli_recommends_checkpointing_when_activations_do_not_fit_one_device(capsys):
    from lightning_par.advise import main

    main(["model.n_layer=4", "--devices", "1", "--device-memory-gb", str(10 / 1024)])
    out = capsys.readouterr().out
    assert "activation checkpointing, kept per block and sample (timed by the probe): off " in out, out
    assert "full 16,384 B" in out  # its input: 64 tokens × 64 wide × 4 bytes
    last = out.splitlines()[-1]
    assert last.startswith("recommended: single × AC full") and "step time (recompute " in last, out


def test_a_pipeline_stage_counts_the_previous_steps_gradients_and_its_sends():
    # [Note: what a pipeline stage holds beyond the model]: stage 0 of PP2, 4 micro-batches of 4 samples × 4 tokens
    # × width 8 in fp32 (a boundary message: 512 B): its 2100 parameters' gradients once more, 4 sends kept to the
    # step's end and 1 posted gradient receive
    est = estimate(ac_profile(), Layout(pipeline_parallel_size=2, microbatches=4), 16)
    assert est.pipeline_bytes == 2100 * 4 + 512 * (4 + 1)
    assert est.total_bytes == (est.param_bytes + est.grad_bytes + est.optimizer_bytes + est.activation_bytes
                               + est.pipeline_bytes)
    assert estimate(ac_profile(), Layout(data_parallel_size=2), 16).pipeline_bytes == 0


def test_a_checkpointed_backward_peaks_at_the_loss_or_at_a_recompute_with_its_gradients():
    # [Note: a checkpointed backward's gradients]: the head's saved tensors (500 B a sample, its largest 200 B)
    # and the gradient the loss's backward makes of that largest one beside the kept inputs, or block 3's
    # recompute with its gradients (1000 + 300 B beside blocks 0-2's inputs) after the loss's and the head's
    # backward freed theirs: the larger of the two, not their sum
    prof = ac_profile(last_activation_bytes=500, head_largest_bytes=200)
    full = estimate(prof, Layout(activation_checkpointing="full"), batch_size=2).activation_bytes
    assert full == (3 * 100 + 1000 + 300) * 2  # the recompute is the larger
    big = estimate(ac_profile(last_activation_bytes=1200, head_largest_bytes=600),
                   Layout(activation_checkpointing="full"), 2)
    assert big.activation_bytes == (4 * 100 + 1200 + 600) * 2  # the loss's moment is the larger
    # a profile that does not say which of the head's tensors is largest: all of them, once more
    assert estimate(ac_profile(last_activation_bytes=1200), Layout(activation_checkpointing="full"),
                    2).activation_bytes == (4 * 100 + 2 * 1200) * 2
    # without checkpointing the loss's moment is the peak too: every block's activations beside it
    assert estimate(prof, Layout(), 2).activation_bytes == (4 * 1000 + 500 + 200) * 2
    # GPipe's last stage: 4 micro-batches of 2 in flight; the one that recomputes has freed its head's tensors,
    # the other three keep theirs
    lay = Layout(pipeline_parallel_size=2, microbatches=4, schedule="gpipe", activation_checkpointing="full")
    gpipe = estimate(prof, lay, 8)  # stage 1: blocks 2 and 3, each keeps its input
    assert gpipe.activation_bytes == ((2 * 100 + 500) * 4 + (100 + 1000 + 300 - 2 * 100 - 500)) * 2


def test_the_gradients_beside_a_recompute_split_as_the_block_does():
    prof = ac_profile()  # block input 100 B a sample
    assert backward_gradient_bytes(prof) == 300  # the output's gradient + 2 inputs of hidden gradients
    assert backward_gradient_bytes(prof, t=2) == 100 + 100  # the hidden ones are column-parallel: 1/t
    assert backward_gradient_bytes(prof, t=2, sequence_parallel=True) == 50 + 100  # the output's too
    assert backward_gradient_bytes(prof, c=2) == 150  # context parallel: each rank's rows
