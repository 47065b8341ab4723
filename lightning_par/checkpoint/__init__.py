"""Checkpoints of every layout in one format (no Lightning here; the strategies' hooks are in
:mod:`lightning_par.strategies._checkpoint`).

- :mod:`~lightning_par.checkpoint.sharded`: the DCP directory keyed by the module's names ([Note: one
  sharded format]).
- :mod:`~lightning_par.checkpoint.optim`: optimizer state by name, and torch's positional format as one
  device numbers it ([Note: optimizer state by name]).
- :mod:`~lightning_par.checkpoint.gather`: every rank's share gathered into one consolidated file.
- :mod:`~lightning_par.checkpoint.tensors`: DTensors gathered, full tensors laid out like a shard again.
- :mod:`~lightning_par.checkpoint.convert`: streaming conversion and inspection (``lightning-par-checkpoint``).
- :mod:`~lightning_par.checkpoint.writers`: its writers (a ``torch.save`` archive, safetensors, a DCP directory).
"""
from lightning_par.checkpoint.sharded import is_sharded as is_distributed_checkpoint
from lightning_par.checkpoint.sharded import read_meta
from lightning_par.checkpoint.tensors import full_state, load_model_state, local_shard_like

__all__ = ["full_state", "is_distributed_checkpoint", "load_model_state", "local_shard_like", "read_meta"]
