"""The reference workloads: the Markov corpus and its loss floor, the text and classification data, GPT, MLP."""
from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from lightning_par.data import MarkovSource, SyntheticClassification, SyntheticCorpus, TextFile
from lightning_par.models import GPT, MLPClassifier


# ------------------------------------------------------------------------------------------ Markov source


def test_stationary_distribution_is_invariant():
    src = MarkovSource(vocab_size=16, sharpness=2.0, seed=3)
    pi = src.stationary
    assert torch.allclose(pi.sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(pi @ src.transition, pi, atol=1e-12)


def test_entropy_rate_matches_an_empirical_estimate():
    """-log P(x_{t+1} | x_t) averaged over sampled transitions estimates H; it must agree within 5 standard errors."""
    src = MarkovSource(vocab_size=16, sharpness=2.0, seed=1)
    seqs = src.sample(400, 101, seed=7)
    logp = torch.log(src.transition)[seqs[:, :-1], seqs[:, 1:]]
    nll = -logp.flatten()
    mean, se = float(nll.mean()), float(nll.std() / math.sqrt(nll.numel()))
    assert abs(mean - src.entropy_rate) < 5 * se, (mean, src.entropy_rate, se)
    assert 0 < src.entropy_rate < math.log(16)


def test_entropy_rate_limits():
    assert MarkovSource(vocab_size=8, sharpness=0.0).entropy_rate == pytest.approx(math.log(8), abs=1e-12)
    assert MarkovSource(vocab_size=8, sharpness=6.0).entropy_rate < MarkovSource(vocab_size=8, sharpness=1.0).entropy_rate


def test_first_token_follows_the_stationary_distribution():
    src = MarkovSource(vocab_size=4, sharpness=1.0, seed=0)
    first = src.sample(20000, 1, seed=2)[:, 0]
    freq = torch.bincount(first, minlength=4).double() / first.numel()
    assert torch.allclose(freq, src.stationary, atol=0.02)


@pytest.mark.parametrize("kwargs, match", [({"vocab_size": 1}, "vocab_size=1"), ({"sharpness": -1.0}, "sharpness=-1.0")])
def test_markov_source_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MarkovSource(**kwargs)


# ------------------------------------------------------------------------------------------ data modules


def _rows(windows: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(r.tolist()) for r in windows}


def test_synthetic_corpus_is_deterministic_given_its_seed():
    a, b = SyntheticCorpus(vocab_size=16, seq_len=8, train_sequences=32, val_sequences=8, seed=5), \
        SyntheticCorpus(vocab_size=16, seq_len=8, train_sequences=32, val_sequences=8, seed=5)
    c = SyntheticCorpus(vocab_size=16, seq_len=8, train_sequences=32, val_sequences=8, seed=6)
    assert torch.equal(a.train_set.windows, b.train_set.windows) and torch.equal(a.val_set.windows, b.val_set.windows)
    assert not torch.equal(a.train_set.windows, c.train_set.windows)
    assert a.loss_floor == b.loss_floor != c.loss_floor


def test_synthetic_corpus_splits_and_batches():
    dm = SyntheticCorpus(vocab_size=32, seq_len=16, batch_size=4, train_sequences=64, val_sequences=16, seed=0)
    assert not _rows(dm.train_set.windows) & _rows(dm.val_set.windows)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert len(dm.val_dataloader()) == 4 and int(x.max()) < 32


def test_synthetic_corpus_rejects_bad_sizes():
    with pytest.raises(ValueError, match="batch_size=0"):
        SyntheticCorpus(batch_size=0)


def test_text_file_windows_and_split(tmp_path):
    path = tmp_path / "book.txt"
    data = torch.randint(0, 256, (2048 + 5,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    path.write_bytes(bytes(data.tolist()))
    dm = TextFile(str(path), seq_len=15, batch_size=4, val_fraction=0.25)
    assert dm.vocab_size == 256 and dm.loss_floor is None
    # 2053 bytes -> 128 windows of 16 (5 bytes left over); the last quarter of the windows is validation
    assert len(dm.train_set) == 96 and len(dm.val_set) == 32
    flat = data[: 128 * 16].long()
    assert torch.equal(dm.train_set.windows.flatten(), flat[: 96 * 16])
    assert torch.equal(dm.val_set.windows.flatten(), flat[96 * 16:])
    x, y = dm.train_set[0]
    assert torch.equal(x, flat[:15]) and torch.equal(y, flat[1:16])
    assert not _rows(dm.train_set.windows) & _rows(dm.val_set.windows)


def test_text_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path="):
        TextFile(str(tmp_path / "missing.txt"))
    small = tmp_path / "small.txt"
    small.write_text("hello world")
    with pytest.raises(ValueError, match="too few for batch_size=16"):
        TextFile(str(small))


def test_synthetic_classification_is_deterministic():
    a, b = SyntheticClassification(seed=1, train_samples=64, val_samples=16), SyntheticClassification(seed=1, train_samples=64, val_samples=16)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    x, y = next(iter(a.train_dataloader()))
    assert x.shape == (32, 32) and y.shape == (32,) and int(y.max()) < 10


# ------------------------------------------------------------------------------------------------ models


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 32, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, **kw})


def test_gpt_forward_backward_shapes():
    model = _gpt()
    idx = torch.randint(0, 32, (3, 10))
    logits = model(idx)
    assert logits.shape == (3, 10, 32)
    loss = model._loss((idx, torch.randint(0, 32, (3, 10))))
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert loss.item() == pytest.approx(math.log(32), abs=0.1)  # near-uniform at init


def test_gpt_is_causal():
    model = _gpt().eval()
    idx = torch.randint(0, 32, (1, 12))
    changed = idx.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 32
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_gpt_tied_and_untied_weights():
    tied, untied = _gpt(), _gpt(tie_weights=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    n_tied, n_untied = sum(p.numel() for p in tied.parameters()), sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 32 * 16


def test_gpt_rejects_bad_shapes():
    with pytest.raises(ValueError, match="n_embd=10 must be divisible by n_head=4"):
        GPT(n_embd=10, n_head=4)
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        _gpt()(torch.zeros(1, 17, dtype=torch.long))


def test_mlp_classifier_forward_and_one_training_step():
    torch.manual_seed(0)
    model = MLPClassifier(in_features=8, num_classes=3, width=16, depth=2)
    assert model(torch.randn(5, 8)).shape == (5, 3) and len(model.layers) == 2
    data = SyntheticClassification(in_features=8, num_classes=3, batch_size=16, train_samples=64, val_samples=32)
    trainer = pl.Trainer(accelerator="cpu", devices=1, fast_dev_run=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, datamodule=data)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert {"train_loss", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
