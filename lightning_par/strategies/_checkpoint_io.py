"""Checkpoint files written atomically ([Note: atomic checkpoints] in :mod:`lightning_par.atomic`): the
strategies' default ``CheckpointIO`` (given by HybridParallelStrategy's constructor). Lightning's
``TorchCheckpointIO`` writes through an fsspec transaction whose temporary lives in the system's temp folder, so
the final move may be a copy into place, with no fsync."""
from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_par.atomic import write_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves go through :func:`lightning_par.atomic.write_file` (remote
    URLs are left to Lightning's fsspec path)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        path = str(path)
        if storage_options is not None or "://" in path and not path.startswith("file://"):
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_file(path.removeprefix("file://"), lambda tmp: torch.save(checkpoint, tmp))
