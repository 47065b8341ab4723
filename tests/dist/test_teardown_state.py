"""A layout strategy leaves nothing behind in the objects the user or Lightning own: the precision plugin and its
scaler come back as they were (the layout's subclass copies are taken out at teardown, [Note: precision
subclasses]), and no sharding rule of ours stays in DTensor's propagator."""
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, trainer_kwargs
from lightning_par import HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_par.data import SyntheticCorpus
from lightning_par.models import GPT
from lightning_par.tensor.rules import strategy_of

DATA = SyntheticCorpus(vocab_size=32, seq_len=16, train_sequences=16, val_sequences=8)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("make", [lambda: TensorParallelStrategy(tensor_parallel_size=1, timeout=60),
                                  lambda: PipelineParallelStrategy(pipeline_parallel_size=1, microbatches=2, timeout=60),
                                  lambda: HybridParallelStrategy(timeout=60)], ids=["tensor", "pipeline", "hybrid"])
def test_precision_plugin_and_scaler_come_back_unchanged(make):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plugin = MixedPrecision("16-mixed", "cpu", scaler)
    before = (type(plugin), dict(vars(plugin)), type(scaler), set(vars(scaler)))
    rules_before = strategy_of(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    trainer = pl.Trainer(**trainer_kwargs(devices=1, strategy=make(), plugins=[plugin], max_steps=2,
                                          gradient_clip_val=0.5))
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    trainer.fit(model, DataLoader(DATA.train_set, batch_size=4))
    assert trainer.strategy.precision_plugin is plugin
    assert (type(plugin), dict(vars(plugin)), type(scaler), set(vars(scaler))) == before
    assert plugin.scaler is scaler
    assert strategy_of(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) is rules_before
