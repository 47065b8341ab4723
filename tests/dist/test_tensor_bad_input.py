"""Bad input under TensorParallelStrategy fails with a clear error instead of hanging or training wrongly,
and a module the plan cannot split (nn.MultiheadAttention) trains correctly, replicated."""
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.spawn import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

from harness import (TIMEOUT_S, assert_close_records, fit_and_record, one_process_fit, seeded,
                     trainer_kwargs)
from models import corpus
from lightning_par.models import GPT
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy


def tp(n=2, **kw):
    return TensorParallelStrategy(tensor_parallel_size=n, start_method="fork", timeout=60, **kw)


def test_sizes_that_do_not_fit_the_devices_fail_at_trainer_construction():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4.*world size \(2\)"):
        pl.Trainer(**trainer_kwargs(strategy=tp(4), devices=2))


@pytest.mark.timeout(TIMEOUT_S)
def test_head_count_not_divisible_fails_on_every_rank_without_hanging(tmp_path):
    data = corpus(train_sequences=16, val_sequences=4)
    module = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=3, n_embd=18)
    trainer = pl.Trainer(**trainer_kwargs(strategy=tp(), devices=2, max_steps=1))
    # under start_method="fork" the rank's ValueError reaches the caller inside torch's ProcessRaisedException,
    # whose message is the rank's traceback: the match names the original type too
    with pytest.raises(ProcessRaisedException, match=r"ValueError: module 'blocks\.0\.attn'.*n_head=3.*"
                                                     r"tensor_parallel_size=2"):
        trainer.fit(module, DataLoader(data.train_set, batch_size=4))


class MHAClassifier(pl.LightningModule):
    """A user's model with nn.MultiheadAttention (replicated, with a warning) and an MLP (sharded)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h, _ = self.attn(x, x, x)
        h = h + self.mlp(h)
        return F.cross_entropy(self.head(h.mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(TIMEOUT_S)
def test_multihead_attention_stays_replicated_and_trains_like_one_process(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, 16, generator=g), torch.randint(0, 3, (32,), generator=g))
    ref = one_process_fit(MHAClassifier, data, 4, max_steps=2)
    with pytest.warns(UserWarning, match="MultiheadAttention 'attn' is left replicated"):
        from lightning_par.tensor.plan import build_plan

        assert build_plan(MHAClassifier(), 2).sharded() == {"mlp.0": "colwise", "mlp.2": "rowwise"}
    got = fit_and_record(seeded(MHAClassifier), DataLoader(data, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp(), devices=2, max_steps=2)
    for rec in got:
        assert_close_records(ref, rec)
