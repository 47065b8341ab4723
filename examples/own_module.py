"""Your own LightningModule, which knows nothing of lightning_par, trained under each strategy on 2 CPU processes.

    python examples/own_module.py --strategy dp         # DataParallelStrategy: a replica per process
    python examples/own_module.py --strategy pp         # PipelineParallelStrategy: blocks 0-1 | blocks 2-3
    python examples/own_module.py --strategy tp         # TensorParallelStrategy: every Linear pair split in two
    python examples/own_module.py --strategy hybrid     # HybridParallelStrategy: 2 stages, 1 tp rank each
    python examples/own_module.py --strategy zero3      # DataParallelStrategy(zero_stage=3): FSDP2 shards

The module below is what you would write for one device: no `configure_model`, no `nn.Sequential` rewrite.
The strategy finds the repeated block list (`self.blocks`) for the pipeline and the Linear pairs
(`fc1` colwise, `fc2` rowwise) for tensor parallelism. `pp`, `tp` and `hybrid` see the same global batch of 16
and print the same losses (what one device computes for that batch); `dp` and `zero3` print rank 0's own
loss on its half of the batch, as Lightning's DDP does.

    python examples/own_module.py --strategy dp pp tp hybrid zero3 --start-method fork   # all, one after another
"""
import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                           TensorParallelStrategy)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Regressor(pl.LightningModule):
    def __init__(self, features: int = 8, width: int = 32, depth: int = 4, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


STRATEGIES = {
    "dp": lambda **kw: DataParallelStrategy(**kw),
    "zero3": lambda **kw: DataParallelStrategy(zero_stage=3, **kw),
    "pp": lambda **kw: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=4, **kw),
    "tp": lambda **kw: TensorParallelStrategy(tensor_parallel_size=2, **kw),
    "hybrid": lambda **kw: HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=1, **kw),
}


class Report(pl.Callback):
    """Prints on global rank 0 (under fork / spawn that is a child process, not this script's)."""

    def __init__(self, name: str):
        self.name = name

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1 and trainer.global_rank == 0:
            print(f"{self.name}: first loss {float(outputs['loss']):.6f}", flush=True)

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            print(f"{self.name}: trained {trainer.global_step} steps, "
                  f"last loss {float(trainer.callback_metrics['train_loss']):.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), nargs="+", default=["dp"])
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--start-method", default="popen", choices=["popen", "fork", "spawn"],
                        help="popen (default) re-runs this script per rank, as Lightning's DDPStrategy")
    args = parser.parse_args()

    if len(args.strategy) > 1 and args.start_method == "popen":
        parser.error("several strategies in one run need --start-method fork or spawn: popen re-runs this "
                     "script once per rank, so each rank would start the next run's processes again")
    for name in args.strategy:
        fit(name, args.max_steps, args.start_method)


def fit(name: str, max_steps: int, start_method: str) -> None:
    pl.seed_everything(0)
    x = torch.randn(256, 8)
    y = x.sin().sum(-1)
    batch_size = 8 if name in ("dp", "zero3") else 16  # two replicas of 8; one pipeline / tp group of 16
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[Report(name)],
                         strategy=STRATEGIES[name](start_method=start_method))
    trainer.fit(Regressor(), DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True))


if __name__ == "__main__":
    main()
