"""Context parallelism combined with the other axes, on real gloo ranks against one process on the same global
batches (issue 24's matrix beyond tests/dist/test_context_strategy.py): pp 2 × cp 2 × tp 2 and pp 2 × dp 2 × cp 2
with the reference GPT (8 ranks), Hugging Face Llama under pp 2 × cp 2, each also with activation checkpointing
(counted: a checkpointed block runs its forward twice a micro-batch); Llama under pp 2 × cp 2 × tp 2, pp 2 × cp 4
(GPT), Qwen2 and BERT under pp 2 × cp 2; Llama, Qwen2 and BERT at cp 4; a checkpoint
saved under pp 2 × cp 2 (a file or a DCP directory) resuming on one device and the other way round.

Each run is compared as tests/dist/test_hybrid.py compares: every rank's losses, every gradient it holds (tensor
shards gathered) and the parameters its stage trains (fp32 1e-5, Adam's response to rounding allowed: [Note: Adam's
response to rounding] in tests/harness.py); together the ranks hold every gradient. Two AdamW steps: the
exactness of a step does not need eight, and the 8-rank runs share two cores.
"""
import glob

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from harness import (TIMEOUT_S, SharesSequences, assert_close_records, assert_matches, fit_and_record, hybrid,
                     one_process_fit, reference_loader, seeded)
from models import causal_lm, corpus, deep_gpt
from lightning_par.checkpoint import cli as checkpoint_cli
from lightning_par.models import GPT

DATA = corpus(train_sequences=32)



class CountsForwards(SharesSequences):
    """:class:`SharesSequences`, and fails the run unless each block of the stage starts ``expected`` forwards in the
    first step (one per micro-batch, twice that where activation checkpointing recomputes it in backward)."""

    def __init__(self, expected: int):
        self.expected, self.calls, self.handles = expected, {}, []

    def on_train_start(self, trainer, pl_module):
        for i, block in enumerate(self.stage_blocks(trainer)):
            self.calls[i] = 0
            self.handles.append(block.register_forward_pre_hook(
                lambda m, a, i=i: self.calls.__setitem__(i, self.calls[i] + 1)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if batch_idx == 0:
            for h in self.handles:
                h.remove()
            if set(self.calls.values()) != {self.expected}:
                raise AssertionError(f"forwards per block in the first step: {self.calls}, not {self.expected}")


def forwards(microbatches: int, checkpointing) -> CountsForwards:
    return CountsForwards(microbatches * (1 if checkpointing is None else 2))


def first_stage(rec: dict, block0: str) -> bool:
    return any(n.startswith(block0) for n in rec["grads"][0])


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("checkpointing", [None, "full"])
def test_pp2_cp2_tp2_gpt_matches_one_process(tmp_path, checkpointing):
    """8 ranks, rank = (pp·2 + cp)·2 + tp (cp just outside tp): ranks 0-3 hold the first stage. Each tp pair shards
    the blocks' weights while the cp pairs split every sequence; 2 micro-batches of 2. Full activation
    checkpointing recomputes each stage's blocks in backward, the attention across the cp group and the tp
    collectives included."""
    ref = one_process_fit(deep_gpt, DATA.train_set, 4, max_steps=2)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "h"),
                         strategy=hybrid(pipeline_parallel_size=2, context_parallel_size=2, tensor_parallel_size=2,
                                         microbatches=2, activation_checkpointing=checkpointing),
                         devices=8, max_steps=2, callbacks=[forwards(2, checkpointing)])
    assert len(got) == 8
    assert_matches(ref, got)
    assert [first_stage(rec, "blocks.0.") for rec in got] == [True] * 4 + [False] * 4
    for rec in got:  # every rank returns and logs one device's loss
        assert rec["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=1e-5)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("mesh_order,checkpointing", [("pp_dp_tp", None), ("dp_pp_tp", "selective")])
def test_pp2_dp2_cp2_gpt_matches_one_process(tmp_path, mesh_order, checkpointing):
    """8 ranks, 2 replicas of a pp 2 × cp 2 pipeline, each replica half of the global batch of 8. Mesh (pp, dp, cp):
    rank = (pp·2 + dp)·2 + cp, or with "dp_pp_tp" (dp, pp, cp): rank = (dp·2 + pp)·2 + cp. Selective activation
    checkpointing saves the attention across the group (one op) and recomputes the rest of each block."""
    ref = one_process_fit(deep_gpt, DATA.train_set, 8, max_steps=2)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "h"),
                         strategy=hybrid(pipeline_parallel_size=2, data_parallel_size=2, context_parallel_size=2,
                                         microbatches=2, mesh_order=mesh_order,
                                         activation_checkpointing=checkpointing),
                         devices=8, max_steps=2, callbacks=[forwards(2, checkpointing)])
    assert len(got) == 8
    assert_matches(ref, got)
    firsts = [0, 1, 2, 3] if mesh_order == "pp_dp_tp" else [0, 1, 4, 5]
    assert [first_stage(rec, "blocks.0.") for rec in got] == [r in firsts for r in range(8)]
    for rec in got:  # the mean over the replicas: the global batch's loss
        assert rec["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=1e-5)


LLAMA = causal_lm("llama", call={"use_cache": False}, attn_implementation="sdpa", max_position_embeddings=16)
QWEN2 = causal_lm("qwen2", call={"use_cache": False}, attn_implementation="sdpa", max_position_embeddings=16)
BERT = causal_lm("bert", attn_implementation="sdpa")  # bidirectional


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("schedule,checkpointing", [("1f1b", None), ("zero_bubble", "full")])
def test_pp2_cp2_hugging_face_llama_matches_one_process(tmp_path, schedule, checkpointing):
    """One Llama block per stage; the rotary cos/sin that the model computes on the whole sequence before its blocks
    are cut on each stage's first block (ranks (pp, cp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)). Zero bubble splits the
    backward of the recomputed (fully checkpointed) blocks into input and weight gradients."""
    ref = one_process_fit(LLAMA, DATA.train_set, 4, max_steps=2)
    got = fit_and_record(seeded(LLAMA), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "l"),
                         strategy=hybrid(pipeline_parallel_size=2, context_parallel_size=2, microbatches=2,
                                         schedule=schedule, activation_checkpointing=checkpointing),
                         devices=4, max_steps=2, callbacks=[forwards(2, checkpointing)])
    assert len(got) == 4
    assert_matches(ref, got)
    assert [first_stage(rec, "model.model.layers.0.") for rec in got] == [True, True, False, False]


PIPELINED = {"llama-pp2-cp2-tp2": (LLAMA, dict(context_parallel_size=2, tensor_parallel_size=2)),
             "gpt-pp2-cp4": (deep_gpt, dict(context_parallel_size=4)),
             "qwen2-pp2-cp2": (QWEN2, dict(context_parallel_size=2)),
             "bert-pp2-cp2": (BERT, dict(context_parallel_size=2))}


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("case", list(PIPELINED))
def test_more_pipelined_layouts_match_one_process(tmp_path, case):
    """Beyond the issue's matrix, each a few seconds: Llama under pp 2 × cp 2 × tp 2 (8 ranks), cp 4 inside a
    pipeline (GPT, chunks of 2 tokens), Qwen2 and BERT (bidirectional, 2 blocks per stage) under pp 2 × cp 2."""
    factory, sizes = PIPELINED[case]
    devices = 2 * sizes["context_parallel_size"] * sizes.get("tensor_parallel_size", 1)
    ref = one_process_fit(factory, DATA.train_set, 4, max_steps=2)
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "m"),
                         strategy=hybrid(pipeline_parallel_size=2, microbatches=2, **sizes), devices=devices,
                         max_steps=2, callbacks=[forwards(2, None)])
    assert len(got) == devices
    assert_matches(ref, got)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family", ["llama", "qwen2", "bert"])
def test_cp4_hugging_face_matches_one_process(tmp_path, family):
    """cp 4 on sequences of 16: every rank holds chunks i and 7 − i of 2 tokens (Llama and Qwen2: causal,
    grouped-query attention with 4 heads over 2 key/value heads; BERT: bidirectional)."""
    factory = {"llama": LLAMA, "qwen2": QWEN2, "bert": BERT}[family]
    ref = one_process_fit(factory, DATA.train_set, 4, max_steps=2)
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "q"),
                         strategy=hybrid(context_parallel_size=4), devices=4, max_steps=2,
                         callbacks=[SharesSequences()])
    assert len(got) == 4
    for r, rec in enumerate(got):
        try:
            assert_close_records(ref, rec)
        except AssertionError as err:
            raise AssertionError(f"rank {r}: {err}") from None


# [Note: the pp 2 × cp 2 checkpoint round trip]
# Context parallelism shards no parameter and a pipeline's checkpoint is one consolidated file under the module's
# own names by default (stages assembled on rank 0), or with save_distributed_checkpoint=True a DCP directory that
# each stage writes its part of; one device (plain Lightning) reads files only, so a directory reaches it through
# `lightning-par-checkpoint convert`. The runs stop with max_epochs (DESIGN.md, "Learned in round 2"): 2 epochs of 2
# steps, saved at the end of epoch 0, resumed for epoch 1, which must continue as the uninterrupted one-device run
# (losses and every parameter a rank trains, 1e-5: the resumed steps are two, from the same state up to rounding).
CKPT_DATA = corpus(train_sequences=16)
CKPT_BATCH = 8  # 2 steps an epoch; pp2 × cp2 has one replica, so one device's loader is the same


def pp2_cp2(dcp: bool = False) -> dict:
    return dict(strategy=hybrid(pipeline_parallel_size=2, context_parallel_size=2, microbatches=2,
                                save_distributed_checkpoint=dcp), devices=4)


def ckpt_run(tmp, name, *, epochs, ckpt_path=None, save=False, **layout):
    callbacks = [ModelCheckpoint(dirpath=str(tmp / name / "ckpt"), save_top_k=-1, every_n_epochs=1)] if save else []
    recs = fit_and_record(seeded(deep_gpt), reference_loader(CKPT_DATA.train_set, CKPT_BATCH), str(tmp / name),
                          max_steps=-1, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=save,
                          ckpt_path=None if ckpt_path is None else str(ckpt_path), **layout)
    return recs, tmp / name / "ckpt" / "epoch=0-step=2.ckpt"


def assert_continues(whole: dict, recs: list[dict], what: str) -> None:
    covered = set()
    for rec in recs:
        assert rec["global_step"] == 4, what
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(whole["losses"][2:]), atol=1e-5,
                                   rtol=1e-5, msg=lambda m: f"{what}: {m}")
        trained = rec["grads"][-1].keys()  # a pipeline stage's copies of the other stage's blocks are stale
        covered |= trained
        for name in trained:
            torch.testing.assert_close(rec["params"][name], whole["params"][name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{what} {name}: {m}")
    assert covered == set(whole["params"]), what


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("dcp", [False, True])
def test_a_checkpoint_saved_under_pp2_cp2_resumes_on_one_device_and_the_other_way_round(tmp_path, dcp):
    """[Note: the pp 2 × cp 2 checkpoint round trip]: pp 2 × cp 2 saves (a file, or a DCP directory converted for
    one device), one device resumes, and a one-device file resumes under pp 2 × cp 2; the DCP directory also
    resumes under pp 2 × cp 2 itself."""
    whole = ckpt_run(tmp_path, "whole", epochs=2)[0][0]
    _, saved = ckpt_run(tmp_path, "pp", epochs=1, save=True, **pp2_cp2(dcp))
    assert saved.is_dir() == dcp and (not dcp or glob.glob(str(saved / "*.distcp")))
    as_file = saved
    if dcp:
        as_file = tmp_path / "converted.ckpt"
        assert checkpoint_cli.main(["convert", str(saved), str(as_file)]) == 0
        assert_continues(whole, ckpt_run(tmp_path, "pp-again", epochs=2, ckpt_path=saved, **pp2_cp2(dcp))[0],
                         "pp2 x cp2 -> pp2 x cp2 (DCP)")
    GPT.load_from_checkpoint(str(as_file), strict=True, map_location="cpu")  # the unchanged module takes it
    assert_continues(whole, ckpt_run(tmp_path, "one", epochs=2, ckpt_path=as_file)[0], "pp2 x cp2 -> one device")

    _, saved_one = ckpt_run(tmp_path, "single", epochs=1, save=True)
    assert_continues(whole, ckpt_run(tmp_path, "back", epochs=2, ckpt_path=saved_one, **pp2_cp2(dcp))[0],
                     "one device -> pp2 x cp2")
