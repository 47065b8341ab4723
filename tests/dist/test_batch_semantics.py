"""A loss that couples the samples of a batch ([Note: losses that couple samples] in
lightning_par/pipeline/coupling.py): CLIP's contrastive loss warns at setup under PipelineParallelStrategy (PP2,
4 micro-batches) and ``strict_batch_semantics=True`` refuses it on every rank; Hugging Face Llama and the
reference GPT with dropout do not warn. The measurement itself (one process) on CLIP, the GPT with dropout,
batch norm and a loss that draws noise."""
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import TIMEOUT_S, seeded, trainer_kwargs
from models import CausalLM
from lightning_par import HybridParallelStrategy, PipelineParallelStrategy
from lightning_par.models import GPT
from lightning_par.pipeline.coupling import measure_coupling, no_dropout
from lightning_par.pipeline.runner import loss_of

transformers = pytest.importorskip("transformers")
VOCAB, SEQ, BATCH = 32, 8, 8


class LitCLIP(pl.LightningModule):
    """A user's wrapper of ``CLIPModel(return_loss=True)``: the contrastive loss over the batch's image-text pairs."""

    def __init__(self):
        super().__init__()
        text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=VOCAB - 1,
                    pad_token_id=0)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      image_size=8, patch_size=4)
        self.model = transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision,
                                                                    projection_dim=16))

    def training_step(self, batch, batch_idx):
        ids, pixels = batch
        return self.model(input_ids=ids, pixel_values=pixels, return_loss=True).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LitLlama(CausalLM):
    def __init__(self):
        super().__init__(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=0.1)), loss="inputs", log=False)


class GPTOnPairs(GPT):
    """The reference GPT with dropout, on the (tokens, pixels) batches of this file (next-token loss)."""

    def __init__(self):
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, dropout=0.2)

    def training_step(self, batch, batch_idx):
        ids, _ = batch
        return super().training_step((ids[:, :-1], ids[:, 1:]), batch_idx)


def data(n=16):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randn(n, 3, 8, 8, generator=g))


class CaughtWarnings(pl.Callback):
    """The warnings a rank emits from its setup to the start of training, saved to ``warnings<rank>.txt``."""

    def __init__(self, out_dir):
        self.out_dir, self.context, self.caught = out_dir, None, []

    def setup(self, trainer, pl_module, stage):
        self.context = warnings.catch_warnings(record=True)
        self.caught = self.context.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module):
        self.context.__exit__(None, None, None)
        with open(os.path.join(self.out_dir, f"warnings{trainer.global_rank}.txt"), "w") as f:
            f.write("\n---\n".join(str(w.message) for w in self.caught if issubclass(w.category, UserWarning)))


def fit(tmp_path, factory, **kw):
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=4, start_method="fork", timeout=120,
                                        **kw)
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=2, max_steps=1,
                                          callbacks=[CaughtWarnings(str(tmp_path))]))
    trainer.fit(seeded(factory), DataLoader(data(), batch_size=BATCH))
    return [open(tmp_path / f"warnings{r}.txt").read().split("\n---\n") for r in range(2)]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("factory", [LitCLIP, LitLlama, GPTOnPairs])
def test_a_loss_that_couples_samples_warns_once_at_setup(tmp_path, factory):
    rank0, rank1 = fit(tmp_path, factory)
    coupled = [w for w in rank0 + rank1 if w.startswith("micro-batching changes this loss")]
    if factory is LitCLIP:
        assert len(coupled) == 1 and coupled[0] in rank0, coupled  # one warning, from rank 0
        assert "`microbatches=1`" in coupled[0] and "a larger batch" in coupled[0]
        assert "on a micro-batch of 2 samples" in coupled[0]
    else:
        assert not coupled, coupled


@pytest.mark.timeout(TIMEOUT_S)
def test_strict_batch_semantics_refuses_a_coupled_loss_on_every_rank(tmp_path):
    with pytest.raises(Exception) as info:
        fit(tmp_path, LitCLIP, strict_batch_semantics=True)
    text = str(info.value)
    assert "ValueError: micro-batching changes this loss" in text and "`strict_batch_semantics=True` refuses" in text
    assert not list(tmp_path.glob("warnings*.txt"))  # refused at setup: training never started


@pytest.mark.parametrize("cls", [PipelineParallelStrategy, HybridParallelStrategy])
def test_strict_batch_semantics_must_be_a_bool(cls):
    with pytest.raises(ValueError, match=r"`strict_batch_semantics='yes'` must be True"):
        cls(strict_batch_semantics="yes")


# -- the measurement, in one process ----------------------------------------------------------------------

def measure(module, batch):
    return measure_coupling(lambda mb: module.training_step(mb, 0), batch, loss_of=loss_of, dtype=torch.float32,
                            reseed=torch.manual_seed)[0]


class Normed(pl.LightningModule):
    """Batch norm in training mode: batch statistics couple the samples."""

    def __init__(self, noise=False):
        super().__init__()
        self.net, self.noise = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)), noise

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.noise:  # a per-sample loss that draws noise: cannot be told from coupling, the check is skipped
            return F.mse_loss(self.net[2](self.net[0](x)) + torch.randn_like(y), y)
        return F.mse_loss(self.net(x), y)


def test_the_measurement_tells_coupled_losses_from_per_sample_ones():
    ids, pixels = data(4).tensors
    clip = seeded(LitCLIP)
    found = measure(clip, (ids, pixels))
    assert found.coupled and abs(found.whole - found.halves) > 0.1 * found.whole, found
    gpt = seeded(GPTOnPairs).train()
    found = measure(gpt, (ids, pixels))
    assert not found.coupled and abs(found.whole - found.halves) < 1e-5 * found.whole, found  # dropout off
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    assert measure(seeded(Normed).train(), (x, y)).coupled
    noisy = measure_coupling(lambda mb: Normed(noise=True).training_step(mb, 0), (x, y), loss_of=loss_of,
                             dtype=torch.float32, reseed=torch.manual_seed)
    assert noisy == (None, "the loss changes with the RNG state beyond dropout (noise, sampled timesteps)")
    assert measure(clip, (ids[:1], pixels[:1])) is None  # one sample: nothing to split
    q = torch.randn(1, 2, 4, 8)
    plain = F.scaled_dot_product_attention(q, q, q)
    with no_dropout():  # dropout is the identity, in the attention functions too
        assert torch.equal(F.dropout(q, 0.5), q) and torch.equal(nn.Dropout(0.5)(q), q)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, None, 0.9), plain)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, dropout_p=0.9), plain)
