"""Lightning semantics under TensorParallelStrategy: validation / test / predict, logged metrics equal to one
process on every rank, consolidated checkpoints loadable by the unchanged module on one device, sharded
(DCP) checkpoints, and resuming from either form continues exactly."""
import glob
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from harness import (SavePredictions, TIMEOUT_S, assert_close_records, fit_and_record, reference_loader, seeded,
                     trainer_kwargs)
from models import corpus
from lightning_par.models import GPT
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy

HP = dict(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16, warmup_steps=1, lr_decay_steps=10)
# 8 sequences, batch 4: an epoch is 2 steps, and checkpoints are taken at the epoch's end, so a resumed run
# starts the next epoch (Lightning does not fast-forward a plain DataLoader resumed mid-epoch).
DATA = corpus(train_sequences=8, val_sequences=16)
VAL = dict(limit_val_batches=2, val_check_interval=2)


def tp2(**kw):
    return TensorParallelStrategy(tensor_parallel_size=2, start_method="fork", timeout=120, **kw)


def gpt():
    return GPT(**HP)


def reference(tmp_path, steps, ckpt_path=None, factory=gpt):
    # every run writes its own directory: a resumed run re-saves the step it resumed from
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / f"ref_ckpt{steps}"), every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    return fit_and_record(seeded(factory), reference_loader(DATA.train_set, 4), str(tmp_path / f"ref{steps}"),
                          max_steps=steps, val_loader=DataLoader(DATA.val_set, batch_size=4), callbacks=[ckpt],
                          enable_checkpointing=True, ckpt_path=ckpt_path, **VAL)[0]


def reference_pair(tmp_path, factory=gpt):
    """One process: 2 steps with a checkpoint at the end of epoch 0, then resumed from it to step 4."""
    ref2 = reference(tmp_path, 2, factory=factory)
    resumed = reference(tmp_path, 4, ckpt_path=str(tmp_path / "ref_ckpt2" / "epoch=0-step=2.ckpt"), factory=factory)
    return ref2, resumed


def fit_tp(tmp_path, name, steps, *, ckpt_path=None, strategy_kw=None, factory=gpt):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / f"ckpt_{name}"), every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    module = seeded(factory)
    recs = fit_and_record(module, DataLoader(DATA.train_set, batch_size=4), str(tmp_path / name),
                          strategy=tp2(**(strategy_kw or {})), devices=2, max_steps=steps, callbacks=[ckpt],
                          enable_checkpointing=True, val_loader=DataLoader(DATA.val_set, batch_size=4),
                          ckpt_path=ckpt_path, **VAL)
    return recs, module


def _resume_check(ref_resumed, resumed):
    assert len(ref_resumed["losses"]) == 2 and ref_resumed["global_step"] == 4
    for rec in resumed:
        assert_close_records(ref_resumed, rec)
        assert rec["global_step"] == 4


@pytest.mark.timeout(TIMEOUT_S)
def test_consolidated_checkpoint_metrics_and_resume(tmp_path):
    ref2, ref_resumed = reference_pair(tmp_path)
    got, module = fit_tp(tmp_path, "tp", 2)
    for rec in got:  # training matches, and val_loss / train_loss agree with one process on every rank
        assert_close_records(ref2, rec)
        assert set(rec["metrics"]) == {"train_loss", "val_loss"}
        assert rec["metrics"] == pytest.approx(ref2["metrics"], abs=1e-5)
    # the caller's (never parallelized) module received the trained weights
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), ref2["params"][n], atol=1e-5, rtol=1e-5)

    path = str(tmp_path / "ckpt_tp" / "epoch=0-step=2.ckpt")
    raw = torch.load(path, weights_only=True)
    assert not any(type(v).__name__ == "DTensor" for v in raw["state_dict"].values())
    assert raw["state_dict"]["blocks.0.attn.q_proj.weight"].shape == (16, 16)  # full, original name
    single = GPT.load_from_checkpoint(path)
    for n, p in single.named_parameters():
        torch.testing.assert_close(p.detach(), ref2["params"][n], atol=1e-5, rtol=1e-5)

    resumed, _ = fit_tp(tmp_path, "resumed", 4, ckpt_path=path)
    _resume_check(ref_resumed, resumed)
    # the consolidated file holds what one device's checkpoint holds: weights, optimizer state (same
    # numbering), schedulers and loops
    one = torch.load(str(tmp_path / "ref_ckpt2" / "epoch=0-step=2.ckpt"), weights_only=True)
    assert set(one) == set(raw) - {"lightning_par"}  # plus the layout that wrote it
    for key in ("lr_schedulers", "loops", "epoch", "global_step", "hyper_parameters"):
        assert raw[key] == one[key], key
    torch.testing.assert_close(raw["state_dict"], one["state_dict"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(raw["optimizer_states"], one["optimizer_states"], atol=1e-5, rtol=1e-5)
    # and it resumes the unchanged module on one device exactly as the one-device checkpoint does
    _resume_check(ref_resumed, [reference(tmp_path / "single", 4, ckpt_path=path)])


@pytest.mark.timeout(TIMEOUT_S)
def test_distributed_checkpoint_resume(tmp_path):
    _, ref_resumed = reference_pair(tmp_path)
    fit_tp(tmp_path, "tp", 2, strategy_kw=dict(save_distributed_checkpoint=True))
    path = str(tmp_path / "ckpt_tp" / "epoch=0-step=2.ckpt")
    assert os.path.isdir(path) and glob.glob(os.path.join(path, "*.distcp"))
    resumed, _ = fit_tp(tmp_path, "resumed", 4, ckpt_path=path, strategy_kw=dict(save_distributed_checkpoint=True))
    _resume_check(ref_resumed, resumed)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("loss_parallel", [False, True])
def test_validate_test_predict(tmp_path, loss_parallel):
    module = seeded(lambda: GPT(**HP))
    loader = DataLoader(DATA.val_set, batch_size=4)
    one = pl.Trainer(**trainer_kwargs(limit_val_batches=None))
    expected_val = one.validate(module, loader, verbose=False)[0]
    expected_test = one.test(module, loader, verbose=False)[0]
    expected_pred = torch.cat(one.predict(module, loader))

    kw = dict(loss_parallel=loss_parallel)
    trainer = pl.Trainer(**trainer_kwargs(strategy=tp2(**kw), devices=2, limit_val_batches=None))
    assert trainer.validate(module, loader, verbose=False)[0] == pytest.approx(expected_val, abs=1e-5)
    trainer = pl.Trainer(**trainer_kwargs(strategy=tp2(**kw), devices=2))
    assert trainer.test(module, loader, verbose=False)[0] == pytest.approx(expected_test, abs=1e-5)
    # Lightning returns no predictions from spawned / forked ranks: every rank writes its own
    trainer = pl.Trainer(**trainer_kwargs(strategy=tp2(**kw), devices=2, callbacks=[SavePredictions(str(tmp_path))]))
    trainer.predict(module, loader, return_predictions=False)
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"pred{rank}.pt"), expected_pred)


