"""Activation memory: checkpointing of block stacks (:mod:`lightning_par.memory.checkpointing`)."""
from lightning_par.memory.checkpointing import apply_activation_checkpointing, check_activation_checkpointing

__all__ = ["apply_activation_checkpointing", "check_activation_checkpointing"]
