"""sequence_parallel and loss_parallel with several pipeline stages (the hybrid core), on real gloo ranks (fork)
against one process on the same global batches (fp32, 1e-5): the reference GPT (lm head tied to the token
embedding, so the tie spans the first and the last stage, both vocabulary-sharded under loss_parallel) and a
tiny Hugging Face Llama built from a config; and the bytes that cross a stage boundary under sequence
parallelism (1/tp of the replicated case, counted by lightning_par.comm)."""
import os
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from harness import (TIMEOUT_S, assert_matches, fit_and_record, free_port, hybrid, one_process_fit, SavePredictions,
                     seeded, start_ranks)
from models import CausalLM, deep_gpt, hf_model
from lightning_par.comm import CommCounter, count_comm
from lightning_par.pipeline.p2p import _HEADER_BYTES
from lightning_par.tensor.boundary import StageBoundary
from test_hybrid import DATA

FLAGS = {"sp": dict(sequence_parallel=True), "lp": dict(loss_parallel=True),
         "sp+lp": dict(sequence_parallel=True, loss_parallel=True)}
SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2}  # schedule -> stages_per_rank


class LitLlama(CausalLM):
    """A user's wrapper of a Hugging Face Llama built from a config (grouped-query attention, rotary tables
    passed to every layer, untied head); nothing in it knows about parallelism."""

    def __init__(self):
        super().__init__(hf_model("llama", num_hidden_layers=4, tie_word_embeddings=False,
                                  attn_implementation="sdpa"), call={"use_cache": False})


MODELS = {"gpt": deep_gpt, "llama": LitLlama}


def _largest_loss_gap(ref: dict, got: list[dict]) -> float:
    return max(abs(a - b) for rec in got for a, b in zip(rec["losses"], ref["losses"]))


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", list(MODELS))
def test_pp2_tp2_matches_one_process(tmp_path, model, schedule, flags):
    """Ranks (pp, dp, tp): 0=(0,0,0) 1=(0,0,1) 2=(1,0,0) 3=(1,0,1); 3 AdamW steps of 4 micro-batches, then
    a validation pass (its loss computed on vocabulary shards under loss_parallel)."""
    if model == "llama":
        pytest.importorskip("transformers")
    factory = MODELS[model]
    val = DataLoader(DATA.val_set, batch_size=8)
    settings = dict(limit_val_batches=2, check_val_every_n_epoch=None, val_check_interval=3)
    ref = one_process_fit(factory, DATA.train_set, 8, val_loader=val, **settings)
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "h"),
                         strategy=hybrid(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                                         microbatches=4, schedule=schedule, stages_per_rank=SCHEDULES[schedule],
                                         **FLAGS[flags]),
                         devices=4, val_loader=val, **settings)
    assert len(got) == 4
    assert_matches(ref, got)
    for rec in got:  # every rank returns and logs plain values equal to one device's
        for key in ("train_loss", "val_loss"):
            assert rec["metrics"][key] == pytest.approx(ref["metrics"][key], abs=1e-5), key
    print(f"{model} pp2×tp2 {schedule} {flags}: largest loss gap {_largest_loss_gap(ref, got):.2e}")


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("schedule", ["gpipe", "zero_bubble"])
def test_other_schedules_match_one_process(tmp_path, schedule):
    ref = one_process_fit(deep_gpt, DATA.train_set, 8)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "h"),
                         strategy=hybrid(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                                         microbatches=4, schedule=schedule, **FLAGS["sp+lp"]), devices=4)
    assert_matches(ref, got)
    print(f"gpt pp2×tp2 {schedule} sp+lp: largest loss gap {_largest_loss_gap(ref, got):.2e}")


@pytest.mark.timeout(TIMEOUT_S)
def test_checkpoint_validate_and_predict_under_sequence_and_loss_parallel(tmp_path):
    """pp2 × tp2 with both flags writes one consolidated file (the vocabulary-sharded tied weight gathered) that
    loads strictly on one device with the trained weights; validate and predict of that checkpoint under the
    same layout give one device's loss and predictions on every rank."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from harness import trainer_kwargs
    from lightning_par.models import GPT

    def strategy():
        return hybrid(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1, microbatches=2,
                      **FLAGS["sp+lp"])

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=16), str(tmp_path / "fit"),
                         strategy=strategy(), devices=4, max_steps=-1, max_epochs=1, callbacks=[ckpt],
                         enable_checkpointing=True)
    path = str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    loaded = dict(GPT.load_from_checkpoint(path, strict=True, map_location="cpu").named_parameters())
    for rec in got:
        for name in rec["grads"][-1]:
            torch.testing.assert_close(loaded[name].detach(), rec["params"][name], atol=0, rtol=0)
    assert set(loaded) == {n for rec in got for n in rec["grads"][-1]}

    loader = DataLoader(DATA.val_set, batch_size=8)
    one = pl.Trainer(**trainer_kwargs(limit_val_batches=None))
    expected_val = one.validate(GPT.load_from_checkpoint(path), loader, verbose=False)[0]
    expected_pred = torch.cat(one.predict(GPT.load_from_checkpoint(path), loader))
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy(), devices=4, limit_val_batches=None))
    assert trainer.validate(GPT.load_from_checkpoint(path), loader, verbose=False)[0] == pytest.approx(
        expected_val, abs=1e-5)
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy(), devices=4, callbacks=[SavePredictions(str(tmp_path))]))
    trainer.predict(GPT.load_from_checkpoint(path), loader, return_predictions=False)
    for rank in range(4):
        assert torch.equal(torch.load(tmp_path / f"pred{rank}.pt"), expected_pred), rank


@pytest.mark.timeout(TIMEOUT_S)
def test_dp2_pp2_tp2_sequence_and_loss_parallel_match_one_process(tmp_path):
    """8 ranks, each replica half of the global batch of 16, gradients clipped at the global norm."""
    ref = one_process_fit(deep_gpt, DATA.train_set, 16, max_steps=3, gradient_clip_val=0.05)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "h"),
                         strategy=hybrid(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2,
                                         microbatches=2, sequence_parallel=True, loss_parallel=True),
                         devices=8, max_steps=3, gradient_clip_val=0.05)
    assert len(got) == 8
    assert_matches(ref, got)
    for rec in got:
        assert rec["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=1e-6)
    print(f"gpt dp2×pp2×tp2 1f1b sp+lp (clipped): largest loss gap {_largest_loss_gap(ref, got):.2e}")


class StageSends(pl.Callback):
    """Counts each rank's point-to-point sends over one training step (lightning_par.comm)."""

    def __init__(self, out_dir: str):
        self.out_dir, self.counter, self.mode = out_dir, CommCounter(), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:  # the second step: the receives are posted as whole frames (see p2p.py)
            self.mode = count_comm(self.counter)
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
            torch.save({"calls": self.counter.calls["send"], "bytes": self.counter.payload["send"]},
                       os.path.join(self.out_dir, f"sends{trainer.global_rank}.pt"))


@pytest.mark.timeout(TIMEOUT_S)
def test_sequence_parallel_sends_one_tp_th_of_the_activation_bytes(tmp_path):
    """pp2 × tp2, 4 micro-batches of 2 × 16 tokens × 16 features (fp32): stage 0 sends each micro-batch's
    activation (a header, then the data), stage 1 its gradient back and the step's result (the mailbox, the
    same either way). Under sequence_parallel each tp rank sends its half of the sequence: half the bytes."""
    microbatches, per_mb = 4, 2 * 16 * 16 * 4
    sent = {}
    for sp in (False, True):
        out = tmp_path / f"sp{int(sp)}"
        out.mkdir()
        strategy = hybrid(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                          microbatches=microbatches, sequence_parallel=sp)
        fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=8), str(out / "rec"),
                       strategy=strategy, devices=4, max_steps=2, callbacks=[StageSends(str(out))])
        sent[sp] = [torch.load(out / f"sends{r}.pt") for r in range(4)]
    for r in (0, 1):  # stage 0: activations only, one frame (header + data) per micro-batch
        assert sent[False][r]["bytes"] == microbatches * (_HEADER_BYTES + per_mb)
        assert sent[True][r]["bytes"] == microbatches * (_HEADER_BYTES + per_mb // 2)
    for r in (2, 3):  # stage 1: gradients (no header) and the mailbox's message, equal in both runs
        mailbox = sent[False][r]["bytes"] - microbatches * per_mb
        assert 0 < mailbox < per_mb
        assert sent[True][r]["bytes"] == microbatches * per_mb // 2 + mailbox
    for r in range(4):
        assert sent[True][r]["calls"] == sent[False][r]["calls"]


def _boundary_worker(rank, port, out_dir):
    """Two ranks of one tensor-parallel group: what each would send and what it rebuilds from a received chunk."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # batch, sequence, features
    weight = torch.linspace(-1, 1, full.numel()).reshape(full.shape)  # d(loss)/d(hidden) of the next stage
    chunk = slice(2 * rank, 2 * rank + 2)
    sp, plain = StageBoundary(mesh, sequence_parallel=True), StageBoundary(mesh, sequence_parallel=False)
    out = {}
    # outgoing: a sequence-sharded hidden state (what a block hands on), a plain one and a replicated one
    for kind in ("shard", "plain", "replicate"):
        x = full.clone().requires_grad_(True)
        d = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        hidden = {"shard": d.redistribute(mesh, (Shard(1),)), "plain": x, "replicate": d}[kind]
        sent, carried = sp.outgoing([hidden, DTensor.from_local(x * 2, mesh, (Replicate(),), run_check=False)])
        sent.backward(weight[:, chunk])  # the gradient the next stage sends back: this rank's chunk
        out[kind] = (sent.detach(), type(carried).__name__, carried.detach(), x.grad.clone())
    # incoming: the received chunk (a leaf) rebuilt as the sequence-sharded DTensor the first block takes
    leaf = full[:, chunk].clone().requires_grad_(True)
    (rebuilt,) = sp.incoming([leaf])
    (rebuilt.full_tensor() * weight).sum().backward()
    out["incoming"] = (type(rebuilt).__name__, rebuilt.placements, rebuilt.full_tensor().detach(), leaf.grad.clone())
    out["no sp"] = [type(t).__name__ for t in plain.outgoing([DTensor.from_local(full, mesh, (Replicate(),))])]
    torch.save(out, os.path.join(out_dir, f"boundary{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_stage_boundary_sends_the_sequence_chunk_and_rebuilds_the_shard(tmp_path):
    """[Note: sequence-sharded stage boundaries]: each rank sends its chunk of the sequence, whatever layout the
    hidden state leaves in; the chunks' gradients sent back make the whole output's gradient, as on one device;
    a received chunk becomes the Shard(1) DTensor of the whole, its gradient the chunk's; other entries travel
    plain and whole."""
    from torch.distributed.tensor import Shard

    start_ranks(_boundary_worker, (free_port(), str(tmp_path)), 2)
    full = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    weight = torch.linspace(-1, 1, full.numel()).reshape(full.shape)
    for rank in range(2):
        got = torch.load(tmp_path / f"boundary{rank}.pt", weights_only=False)
        chunk = slice(2 * rank, 2 * rank + 2)
        for kind in ("shard", "plain", "replicate"):
            sent, carried_kind, carried, grad = got[kind]
            assert torch.equal(sent, full[:, chunk]), kind
            assert carried_kind == "Tensor" and torch.equal(carried, full * 2), kind
            # each rank got back its chunk's gradient; the chunks are all-gathered into the whole (replicated)
            # output's gradient, what one device computes
            torch.testing.assert_close(grad, weight, atol=0, rtol=0, msg=lambda m: f"{kind}: {m}")
        kind, placements, rebuilt, leaf_grad = got["incoming"]
        assert kind == "DTensor" and placements == (Shard(1),)
        assert torch.equal(rebuilt, full)
        assert torch.equal(leaf_grad, weight[:, chunk])
        assert got["no sp"] == ["Tensor"]
