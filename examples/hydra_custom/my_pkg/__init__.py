"""A user's own LightningModule and LightningDataModule: plain Lightning, nothing of lightning_par.

    cd examples/hydra_custom
    lightning-par-train model=custom model._target_=my_pkg.MyModule +model.hidden=64 \
        data=custom data._target_=my_pkg.MyData +data.batch_size=8 trainer.max_steps=20
"""
from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyModule(pl.LightningModule):
    """A residual MLP regressor: ``depth`` blocks of width ``hidden``."""

    def __init__(self, features: int = 8, hidden: int = 32, depth: int = 2, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU())
                                    for _ in range(depth))
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class MyData(pl.LightningDataModule):
    """Noisy targets of a fixed random linear map, split into train and validation sets."""

    def __init__(self, features: int = 8, samples: int = 512, batch_size: int = 16, seed: int = 0):
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(samples, features, generator=g)
        y = x @ torch.randn(features, generator=g) + 0.1 * torch.randn(samples, generator=g)
        cut = samples * 7 // 8
        self.train_set, self.val_set = TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)
