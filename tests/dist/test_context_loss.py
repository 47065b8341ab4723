"""Context parallelism sharded to the loss ([Note: sharded to the loss] in lightning_par/context/loss.py), on real gloo
ranks: the cross-entropy of each rank's piece of the logits against the whole labels equals one process's over the
whole sequence, value and gradient (flattened and class-first layouts, mean and sum, ignored labels unevenly
spread, class weights with label smoothing, Hugging Face's shifted-label loss); a Hugging Face Llama trained on its
own shifted loss and a GPT whose labels are partly ignored equal one device with the head on pieces of the sequence
(the logits each rank makes: [B, S/cp, V]); steps whose use of the logits the pieces do not serve (a shift of the
logits themselves, an accuracy against the whole labels) keep the gather, equal to one device, and say why."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.context import shard
from lightning_par.context.loss import ShardedCrossEntropy
from harness import TIMEOUT_S, LossPieces, fit_and_record, free_port, hybrid, one_process_fit, seeded, start_ranks
from models import CausalLM, corpus, hf_model, tiny_gpt

B, S, V = 2, 16, 11


def _labels(g):
    y = torch.randint(0, V, (B, S), generator=g)
    y[0, :5] = -100           # the first chunk of rank 0 (cp 2) wholly ignored, others partly
    y[1, S - 3:] = -100
    return y


def _check(rank, cp, group, name, loss_fn, layout="flat"):
    """``loss_fn(logits, labels)`` on each rank's piece inside the mode against one process's on the whole."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, S, V, generator=g, requires_grad=True)
    labels = _labels(g)
    ref = loss_fn(logits, labels, layout)
    ref.backward()
    piece = shard(logits.detach(), 1, cp, rank).requires_grad_()
    with ShardedCrossEntropy(group, (B, S), 1) as mode:
        got = loss_fn(piece, labels, layout)
    assert mode.calls == 1, name
    # the same float32 terms summed in pieces then over the group: a reassociation of one sum over B·S = 64 tokens,
    # a few ulps (2^-23 ~ 1.2e-7 relative each) of a loss of order 1, well inside 1e-6
    torch.testing.assert_close(got.detach(), ref.detach(), atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")
    got.backward()
    # each rank's gradient is its positions' part of one process's, times cp ([Note: gradients under context
    # parallelism]): the group's mean of the parameters' gradients is one device's
    torch.testing.assert_close(piece.grad, cp * shard(logits.grad, 1, cp, rank), atol=1e-6, rtol=1e-6,
                               msg=lambda m: f"{name} gradient: {m}")


def _ce(**kw):
    def fn(logits, labels, layout):
        if layout == "classes_first":  # [B, V, S] against [B, S]
            return F.cross_entropy(logits.transpose(1, 2), labels, **kw)
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), **kw)
    return fn


def _hf_shifted(logits, labels, layout):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, V)  # pads and shifts the whole labels, then flattens


def _worker(rank, cp, port):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", rank=rank, world_size=cp, init_method=f"tcp://127.0.0.1:{port}")
    try:
        group = dist.new_group(list(range(cp)))
        weight = torch.linspace(0.5, 2.0, V)
        _check(rank, cp, group, "mean", _ce())
        _check(rank, cp, group, "mean, classes first", _ce(), layout="classes_first")
        _check(rank, cp, group, "sum", _ce(reduction="sum"))
        _check(rank, cp, group, "weight and label smoothing", _ce(weight=weight, label_smoothing=0.1))
        _check(rank, cp, group, "Hugging Face's shifted labels", _hf_shifted)
        # shapes that are not a piece against its whole labels are left to torch (which raises)
        logits = torch.randn(B, S // cp, V)
        with ShardedCrossEntropy(group, (B, S), 1) as mode:
            with pytest.raises(ValueError):
                F.cross_entropy(logits[:, :-1].reshape(-1, V), torch.zeros(B * (S - 1), dtype=torch.long))
            F.cross_entropy(logits.reshape(-1, V), torch.zeros(B * S // cp, dtype=torch.long))  # a whole local loss
        assert mode.calls == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("cp", [2, 4])
def test_the_pieces_cross_entropy_equals_the_whole_sequences(cp):
    start_ranks(_worker, (cp, free_port()), nprocs=cp)


def _fit(tmp_path, factory, data, *, cp=2, steps=8, head="model.lm_head"):
    ref = one_process_fit(factory, data, 4, max_steps=steps)
    got = fit_and_record(seeded(factory), DataLoader(data, batch_size=4), str(tmp_path), devices=cp,
                         strategy=hybrid(context_parallel_size=cp), max_steps=steps,
                         callbacks=[LossPieces(str(tmp_path), head)])
    seen = [torch.load(tmp_path / f"loss{r}.pt") for r in range(cp)]
    # the losses every rank returns, its gradients and parameters: one device's, within the fp32 bound over
    # 8 AdamW steps (2e-4: reassociated sums, amplified by AdamW's normalisation of tiny gradients) and the first
    # step's gradients at fp32's ~1e-5 (the sums of a block's backward over half the tokens each, then averaged)
    for rec in got:
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), atol=2e-4, rtol=0)
        for name, grad in rec["grads"][0].items():
            torch.testing.assert_close(grad, ref["grads"][0][name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        for name, p in rec["params"].items():
            torch.testing.assert_close(p, ref["params"][name], atol=2e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    return seen


DATA = corpus()
LLAMA = dict(attn_implementation="sdpa", max_position_embeddings=16)


@pytest.mark.timeout(TIMEOUT_S)
def test_hugging_face_llama_on_its_own_shifted_loss_trains_on_pieces_as_one_device(tmp_path):
    seen = _fit(tmp_path, lambda: CausalLM(hf_model("llama", **LLAMA), call={"use_cache": False}, loss="inputs"),
                DATA.train_set)
    idx, _ = DATA.train_set[0]
    for s in seen:
        assert s["sharded"], s["why"]
        vocab = s["shapes"][0][-1]
        assert set(s["shapes"]) == {(4, idx.shape[0] // 2, vocab)}  # each rank's head: half of every sequence


def _with_ignored(dataset):
    idx = torch.stack([dataset[i][0] for i in range(len(dataset))])
    y = torch.stack([dataset[i][1] for i in range(len(dataset))]).clone()
    y[::3, : y.shape[1] // 2] = -100  # a third of the sequences ignore their first half: ranks count unevenly
    y[1::3, -3:] = -100
    return TensorDataset(idx, y)


@pytest.mark.timeout(TIMEOUT_S)
def test_a_gpt_with_ignored_labels_trains_on_pieces_as_one_device(tmp_path):
    seen = _fit(tmp_path, tiny_gpt, _with_ignored(DATA.train_set), head="lm_head")
    assert all(s["sharded"] for s in seen), seen


class ShiftsItsLogits(CausalLM):
    """A step that shifts the logits themselves (the older Hugging Face way)."""

    def loss(self, batch):
        idx, _ = batch
        logits = self.model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


class LogsAccuracy(CausalLM):
    """A step that also logs the accuracy of the logits against the whole targets."""

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(input_ids=idx, use_cache=False).logits
        self.log("accuracy", (logits.argmax(-1) == targets).float().mean())
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("cls,why", [(ShiftsItsLogits, "fails on the pieces"), (LogsAccuracy, "fails on the pieces")])
def test_steps_the_pieces_do_not_serve_keep_the_gather_and_train_as_one_device(tmp_path, cls, why):
    seen = _fit(tmp_path, lambda: cls(hf_model("llama", **LLAMA)), DATA.train_set, steps=2)
    idx, _ = DATA.train_set[0]
    for s in seen:
        assert not s["sharded"] and why in s["why"], s
        assert {shape[1] for shape in s["shapes"]} == {idx.shape[0]}  # the head ran on the whole sequence
