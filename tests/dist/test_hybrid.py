"""HybridParallelStrategy (data × pipeline × tensor) on real gloo ranks (fork) against one process on the same
global batches: losses on every rank, every gradient a rank holds (tensor shards gathered), every parameter
of its stage (fp32, 1e-5)."""
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_close_records, fit_and_record, reference_loader, seeded, union_of_grad_names
from lightning_par import HybridParallelStrategy
from lightning_par.data import SyntheticCorpus
from lightning_par.models import GPT

DATA = SyntheticCorpus(vocab_size=32, seq_len=16, train_sequences=64, val_sequences=16)


def tiny_gpt(**kw):
    cfg = dict(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16, warmup_steps=1, lr_decay_steps=10)
    cfg.update(kw)
    return GPT(**cfg)


def hybrid(**kw):
    return HybridParallelStrategy(start_method="fork", timeout=120, **kw)


def assert_matches(ref: dict, got: list[dict], *, atol=1e-5, rtol=1e-5):
    """Every rank returns the true losses; each rank's gradients and its stage's parameters equal the
    reference; together the ranks hold a gradient for every parameter."""
    for rec in got:
        assert_close_records(ref, {**rec, "params": {n: rec["params"][n] for n in rec["grads"][-1]}},
                             atol=atol, rtol=rtol, require_all_grads=False)
    assert union_of_grad_names(got) == union_of_grad_names([ref])


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("schedule,stages_per_rank", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_pp2_tp2_matches_one_process(tmp_path, schedule, stages_per_rank):
    """Ranks (pp, dp, tp): 0=(0,0,0) 1=(0,0,1) 2=(1,0,0) 3=(1,0,1)."""
    ref = fit_and_record(seeded(tiny_gpt), reference_loader(DATA.train_set, 8), str(tmp_path / "ref"))[0]
    got = fit_and_record(seeded(tiny_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "h"),
                         strategy=hybrid(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                                         microbatches=4, schedule=schedule, stages_per_rank=stages_per_rank),
                         devices=4)
    assert len(got) == 4
    assert_matches(ref, got)
    # tensor-parallel peers hold the same stage: the same parameter names
    assert set(got[0]["grads"][0]) == set(got[1]["grads"][0])
    assert set(got[2]["grads"][0]) == set(got[3]["grads"][0])
    for rec in got:
        assert rec["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=1e-6)
