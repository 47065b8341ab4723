"""A small MLP classifier LightningModule: hidden layers in an ``nn.ModuleList``, torchmetrics accuracy."""
from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


class HiddenLayer(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(self.norm(x))))


class MLPClassifier(pl.LightningModule):
    def __init__(
        self,
        in_features: int = 32,
        num_classes: int = 10,
        width: int = 64,
        depth: int = 4,
        dropout: float = 0.0,
        lr: float = 1e-2,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Linear(in_features, width)
        self.layers = nn.ModuleList(HiddenLayer(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
