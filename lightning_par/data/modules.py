"""Lightning data modules: the synthetic Markov corpus, a byte-level text file, synthetic classification.

Batches are ``(inputs, targets)``. All are deterministic given their seed; the train and validation
splits never share a sequence.
"""
from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_par.data.markov import MarkovSource


class NextTokenDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens served as ``(tokens[:-1], tokens[1:])``."""

    def __init__(self, windows: torch.Tensor):
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.size(0)

    def __getitem__(self, i: int):
        w = self.windows[i]
        return w[:-1], w[1:]


class _Loaders(pl.LightningDataModule):
    batch_size: int
    num_workers: int
    train_set: Dataset
    val_set: Dataset

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class SyntheticCorpus(_Loaders):
    """Sequences from a :class:`MarkovSource`; ``loss_floor`` is its entropy rate (nats/token)."""

    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 64,
        batch_size: int = 16,
        train_sequences: int = 2048,
        val_sequences: int = 256,
        sharpness: float = 2.0,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size),
                            ("train_sequences", train_sequences), ("val_sequences", val_sequences)):
            if value < 1:
                raise ValueError(f"`{name}={value}` must be a positive integer.")
        self.source = MarkovSource(vocab_size, sharpness, seed)
        self.vocab_size, self.seq_len, self.batch_size, self.num_workers = vocab_size, seq_len, batch_size, num_workers
        self.train_set = NextTokenDataset(self.source.sample(train_sequences, seq_len + 1, seed=seed * 2 + 1))
        self.val_set = NextTokenDataset(self.source.sample(val_sequences, seq_len + 1, seed=seed * 2 + 2))

    @property
    def loss_floor(self) -> float:
        return self.source.entropy_rate


class TextFile(_Loaders):
    """A byte-level corpus from the user's own text file (vocabulary of 256 byte values).

    The file is cut into non-overlapping windows of ``seq_len + 1`` bytes; the last ``val_fraction``
    of the windows is the validation split. ``loss_floor`` is unknown (``None``).
    """

    vocab_size = 256
    loss_floor = None

    def __init__(self, path: str, seq_len: int = 64, batch_size: int = 16, val_fraction: float = 0.1,
                 num_workers: int = 0):
        super().__init__()
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"data.path={path!r} is not a file; give the path of a text file.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"`val_fraction={val_fraction}` must be between 0 and 1.")
        data = torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8).long()
        n = data.numel() // (seq_len + 1)
        n_val = max(1, int(n * val_fraction))
        if n - n_val < batch_size or n_val < batch_size:
            raise ValueError(
                f"{path!r} holds {data.numel()} bytes: {n} windows of seq_len+1={seq_len + 1}, too few for "
                f"batch_size={batch_size} in both splits. Use a larger file or smaller seq_len/batch_size."
            )
        windows = data[: n * (seq_len + 1)].view(n, seq_len + 1)
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers
        self.train_set = NextTokenDataset(windows[: n - n_val])
        self.val_set = NextTokenDataset(windows[n - n_val:])


class SyntheticClassification(_Loaders):
    """Gaussian clusters around seeded class centres: ``(features, label)`` batches."""

    loss_floor = None

    def __init__(self, in_features: int = 32, num_classes: int = 10, batch_size: int = 32,
                 train_samples: int = 2048, val_samples: int = 256, noise: float = 1.0, seed: int = 0,
                 num_workers: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        centres = 2.0 * torch.randn(num_classes, in_features, generator=g)

        def draw(n: int) -> TensorDataset:
            y = torch.randint(0, num_classes, (n,), generator=g)
            return TensorDataset(centres[y] + noise * torch.randn(n, in_features, generator=g), y)

        self.in_features, self.num_classes = in_features, num_classes
        self.batch_size, self.num_workers = batch_size, num_workers
        self.train_set, self.val_set = draw(train_samples), draw(val_samples)
