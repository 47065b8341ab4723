"""The models and corpora of the tests, each defined once: the tiny reference GPT, tiny Hugging Face models by
family with the wrapper a user writes around a causal LM, and the synthetic corpus at the tests' sizes.

Each GPT variant has its own name here (``deep_gpt``: four layers, two per pipeline stage), called as
``seeded(deep_gpt)`` or ``deep_gpt(dropout=0.2)``; a one-off stays ``gpt_factory(...)`` at its use.
"""
from __future__ import annotations

import functools
from typing import Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.data import SyntheticCorpus
from lightning_par.models import GPT

GPT_SIZES = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, warmup_steps=1, lr_decay_steps=10)


def tiny_gpt(**overrides) -> GPT:
    """The reference GPT at the tests' sizes (vocabulary 32, 16 positions, width 16), any argument overridden."""
    return GPT(**{**GPT_SIZES, **overrides})


class SgdGPT(GPT):
    """The reference GPT with plain SGD (no momentum, no schedule): every-step DP and local SGD at H = 1 agree."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ManualGPT(GPT):
    """The reference GPT stepping its optimizer by hand (manual optimization), clipping by norm at ``clip``."""

    def __init__(self, clip: float = 0.05, **kw):
        super().__init__(**kw)
        self.clip = clip
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()
        return loss


def sgd_gpt() -> SgdGPT:
    return SgdGPT(**GPT_SIZES)


def gpt_factory(**overrides) -> Callable[..., GPT]:
    """:func:`tiny_gpt` with ``overrides`` bound: a factory for ``seeded`` that still takes further overrides."""
    return functools.partial(tiny_gpt, **overrides)


deep_gpt = gpt_factory(n_layer=4)  # four layers: two blocks per pipeline stage
warm_gpt = gpt_factory(warmup_steps=2)  # two warm-up steps: the learning rate changes over a short fit
deep_warm_gpt = gpt_factory(n_layer=4, warmup_steps=2)
four_head_gpt = gpt_factory(n_head=4)  # two heads per rank at tp = 2
deep_dropout_gpt = gpt_factory(n_layer=4, dropout=0.1)  # dropout: the recomputation must draw the same masks


def corpus(train_sequences: int = 64, val_sequences: int = 8, **overrides) -> SyntheticCorpus:
    """The synthetic corpus of :func:`tiny_gpt`'s vocabulary and block size."""
    return SyntheticCorpus(**{"vocab_size": 32, "seq_len": 16, "train_sequences": train_sequences,
                              "val_sequences": val_sequences, **overrides})


_DECODER = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32)
# family: (config class, model class, tiny config); every name is transformers' own
HF_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_DECODER, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=4,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(vocab_size=64, hidden_size=32, num_hidden_layers=4,
                                                   num_attention_heads=4, intermediate_size=64,
                                                   max_position_embeddings=16, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                          num_heads=4, relative_attention_num_buckets=8,
                                                          relative_attention_max_distance=16, dropout_rate=0.0,
                                                          decoder_start_token_id=0, pad_token_id=0)),
}


def hf_model(family: str, **overrides) -> nn.Module:
    """A tiny Hugging Face model of ``family`` (a key of :data:`HF_FAMILIES`) built from its config, random weights
    (nothing is downloaded); ``overrides`` are config fields."""
    import transformers

    if family not in HF_FAMILIES:
        raise ValueError(f"hf_model(family={family!r}): the families are {sorted(HF_FAMILIES)}")
    config_cls, model_cls, sizes = HF_FAMILIES[family]
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**sizes, **overrides}))


class CausalLM(pl.LightningModule):
    """How a user wraps a Hugging Face causal LM: nothing in it knows about parallelism; its parameters live in
    ``self.model`` (``attr``: another attribute, the prefix of every parameter name) and its step never calls
    ``self(...)``. AdamW (torch's defaults unless given). ``call`` holds further keywords of the model's forward
    (``use_cache=False``). ``loss``: ``"logits"``, the cross-entropy of the logits against the batch's targets;
    ``"labels"``, the model's own loss with ``labels=`` the targets; ``"inputs"``, the model's own loss with
    ``labels=`` the input ids (the model shifts them). ``log``: the training step logs ``train_loss``;
    ``sync_dist``: that of the validation step's ``val_loss``."""

    LOSSES = ("logits", "labels", "inputs")

    def __init__(self, model: nn.Module, *, lr: float = 1e-3, weight_decay: float = 0.01, eps: float = 1e-8,
                 call: dict | None = None, loss: str = "logits", log: bool = True, sync_dist: bool = True,
                 attr: str = "model"):
        super().__init__()
        if loss not in self.LOSSES:
            raise ValueError(f"loss={loss!r}: one of {self.LOSSES}")
        self.attr = attr
        setattr(self, attr, model)
        self.lr, self.weight_decay, self.eps = lr, weight_decay, eps
        self.call_kw = dict(call or {})
        self.loss_kind, self.log_train, self.sync_dist = loss, log, sync_dist

    def loss(self, batch):
        idx, targets = batch
        model = getattr(self, getattr(self, "attr", "model"))
        kind = getattr(self, "loss_kind", "logits")
        if kind == "labels":
            return model(input_ids=idx, labels=targets, **self.call_kw).loss
        if kind == "inputs":
            return model(input_ids=idx, labels=idx, **self.call_kw).loss
        logits = model(input_ids=idx, **self.call_kw).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if getattr(self, "log_train", True):
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=getattr(self, "sync_dist", True))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, eps=self.eps)


def causal_lm(family: str, *, lr: float = 1e-3, weight_decay: float = 0.01, eps: float = 1e-8,
              call: dict | None = None, **config) -> Callable[[], CausalLM]:
    """A factory for ``seeded``: :class:`CausalLM` around ``hf_model(family, **config)``."""
    return lambda: CausalLM(hf_model(family, **config), lr=lr, weight_decay=weight_decay, eps=eps, call=call)
