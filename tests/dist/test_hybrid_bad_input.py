"""HybridParallelStrategy refuses bad layouts before any collective, with a message naming the values and the fix."""
import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, trainer_kwargs
from models import corpus
from lightning_par import HybridParallelStrategy
from lightning_par.data import SyntheticCorpus
from lightning_par.models import GPT

DATA = corpus(train_sequences=32)


def test_sizes_whose_product_is_not_the_world_fail_at_trainer_construction():
    with pytest.raises(ValueError, match=r"`data_parallel_size=1`, `pipeline_parallel_size=2` and "
                                         r"`tensor_parallel_size=3` multiplied \(6\) should equal the world size \(4\)"):
        pl.Trainer(**trainer_kwargs(devices=4, strategy=HybridParallelStrategy(
            data_parallel_size=1, pipeline_parallel_size=2, tensor_parallel_size=3, start_method="fork")))


@pytest.mark.parametrize("kwargs,message", [
    (dict(zero_stage=4), r"`zero_stage=4` is not a ZeRO stage. Choose 0 \(replicas"),
    (dict(mesh_order="tp_dp_pp"), r"`mesh_order='tp_dp_pp'` must be one of"),
    (dict(tensor_parallel_size=0), r"`tensor_parallel_size=0` must be a positive integer or 'auto'"),
    (dict(schedule="interleaved_1f1b"), r"needs `stages_per_rank` >= 2"),
    (dict(plan={"blocks.*.mlp.fc": "diagonal"}), r"diagonal"),
])
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(**kwargs)


def _fit(strategy, devices, model):
    trainer = pl.Trainer(**trainer_kwargs(devices=devices, strategy=strategy, max_steps=1))
    trainer.fit(model, DataLoader(DATA.train_set, batch_size=4))


@pytest.mark.timeout(TIMEOUT_S)
def test_tp_that_does_not_divide_the_heads_is_refused_at_setup():
    """3 heads over 2 tensor-parallel ranks: every rank raises the same error before any collective of the run."""
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=3, n_embd=24)
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                                      start_method="fork", timeout=60)
    with pytest.raises(Exception, match=r"tensor_parallel_size=2.*divides 3|divide"):
        _fit(strategy, 4, model)


@pytest.mark.timeout(TIMEOUT_S)
def test_more_stages_than_blocks_is_refused_at_setup():
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=1, data_parallel_size=1,
                                      schedule="interleaved_1f1b", stages_per_rank=2, microbatches=2,
                                      start_method="fork", timeout=60)
    with pytest.raises(Exception, match=r"4 pipeline stages need at least 4 blocks, but the block stack has 2"):
        _fit(strategy, 2, model)


class NormsFirst(GPT):
    """A GPT whose embeddings first pass a stack of norms (blocks without an attention / MLP pair)."""

    def __init__(self):
        super().__init__(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(16) for _ in range(2))

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for norm in self.norms:
            x = norm(x)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@pytest.mark.timeout(TIMEOUT_S)
def test_sequence_parallel_over_stages_of_blocks_without_pairs_is_refused_at_setup():
    """pp2 × tp2 pipelining `norms` under sequence_parallel: a stage would start at a norm that receives a
    sequence shard; every rank refuses before any collective of the run."""
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                                      blocks="norms", sequence_parallel=True, microbatches=2,
                                      start_method="fork", timeout=60)
    with pytest.raises(Exception, match=r"the pipelined blocks 'norms.0', 'norms.1' hold no attention / MLP pair"):
        _fit(strategy, 4, NormsFirst())


@pytest.mark.timeout(TIMEOUT_S)
def test_sequence_parallel_over_stages_with_an_odd_sequence_is_refused_at_setup():
    """A sequence of 15 tokens cannot be split over 2 tensor-parallel ranks: refused at setup on every rank (at a
    step only the first stage would raise, the second waiting for its activation)."""
    odd = SyntheticCorpus(vocab_size=32, seq_len=15, train_sequences=16, val_sequences=4)
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                                      sequence_parallel=True, microbatches=2, start_method="fork", timeout=60)
    trainer = pl.Trainer(**trainer_kwargs(devices=4, strategy=strategy, max_steps=1))
    with pytest.raises(Exception, match=r"`blocks.0` \(in the step traced at setup\) got a sequence of length 15, "
                                        r"not divisible by tensor_parallel_size=2"):
        trainer.fit(GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16),
                    DataLoader(odd.train_set, batch_size=4))
