"""A Hugging Face causal LM as a LightningModule, for ``lightning-par-train model=hf``.

    HFCausalLM(config={"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "intermediate_size": 128}, vocab_size=64)
    HFCausalLM(config="path/to/model_dir", weights="path/to/model_dir")

The model is built by ``AutoModelForCausalLM.from_config`` from a dict of config keys (with ``model_type``:
nothing is downloaded), a local folder or a model name (``AutoConfig.from_pretrained``). Batches are
``(tokens, next tokens)``, as the app's corpora serve them. ``weights=`` is read here only when the
strategy does not stream it into each rank's share (the app hands it to the strategy where it can).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import lightning.pytorch as pl
import torch
import torch.nn.functional as F


def hf_config(config: Union[str, Mapping[str, Any]], vocab_size: Optional[int] = None):
    """The ``transformers`` config of ``config`` (a dict with ``model_type``, a folder or a name); ``vocab_size``
    is the data's vocabulary: the config's when a dict sets none, and it must fit in the config's."""
    import transformers

    if isinstance(config, Mapping):
        keys = dict(config)
        if "model_type" not in keys:
            raise ValueError(f"model.config={keys} has no `model_type`: name the family, e.g. "
                             f"`model.config={{model_type: llama, hidden_size: 64, ...}}`.")
        if vocab_size is not None:
            keys.setdefault("vocab_size", vocab_size)
        built = transformers.AutoConfig.for_model(keys.pop("model_type"), **keys)
    else:
        try:
            built = transformers.AutoConfig.from_pretrained(config)
        except OSError as err:  # neither a folder with a config.json nor a name in the cache / on the Hub
            raise ValueError(f"model.config={config!r} cannot be read ({str(err).splitlines()[0]}): give a local "
                             f"folder with a config.json, a model name, or a dict with `model_type`.") from None
    if vocab_size is not None and built.vocab_size < vocab_size:
        raise ValueError(f"The model's vocabulary ({built.vocab_size}, from model.config) is smaller than the "
                         f"data's ({vocab_size}): set the config's vocab_size to at least {vocab_size}.")
    return built


class HFCausalLM(pl.LightningModule):
    """Next-token cross-entropy of any ``AutoModelForCausalLM``; logs ``train_loss`` / ``val_loss``, AdamW."""

    def __init__(self, config: Union[str, Mapping[str, Any]], weights: Optional[str] = None,
                 vocab_size: Optional[int] = None, lr: float = 3e-4, weight_decay: float = 0.0):
        super().__init__()
        import transformers

        self.save_hyperparameters()
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config(config, vocab_size))
        if weights is not None:
            from lightning_par.materialize.load import open_module_weights, read_weights

            with open_module_weights(weights, self.model) as reader:
                read_weights(self.model, reader)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def _loss(self, batch) -> torch.Tensor:
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
