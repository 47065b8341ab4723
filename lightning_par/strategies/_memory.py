"""Activation checkpointing and CPU offload on :class:`~lightning_par.DataParallelStrategy` (the layout strategies
checkpoint inside their engines): the options are the strategy's ``stack`` and ``memory`` groups (checked at
construction, :mod:`lightning_par.options`), the blocks are checkpointed at setup before DDP or FSDP wraps the
module, and taken out again at teardown.

[Note: CPU offload refused on a CPU device]
``offload="cpu"`` keeps FSDP2's parameter shards, gradients and optimizer state in (pinned) host memory and steps
the optimizer there (``CPUOffloadPolicy``); it saves device memory only. On a CPU accelerator the module lives in
host memory already, and torch's policy then pins and copies host tensors to the host for nothing: refused when the
Trainer is built, with the reason.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning_par.memory.checkpointing import Checkpointed, apply_activation_checkpointing
from lightning_par.pipeline.discovery import find_blocks


class ActivationMemory:
    """The ``activation_checkpointing`` / ``blocks`` / ``offload`` options of a strategy without engines (read from
    its ``self._options``)."""

    _checkpointed: Optional[Checkpointed] = None
    _ac = property(lambda self: self._options.memory.activation_checkpointing)  # the setting, from the group

    def _configure_launcher(self) -> None:  # at Trainer construction: [Note: CPU offload refused on a CPU device]
        super()._configure_launcher()
        devices = getattr(self, "parallel_devices", None) or []
        if self._options.memory.offload == "cpu" and all(d.type == "cpu" for d in devices):
            raise ValueError(f"`offload='cpu'` saves device memory by keeping the shards in host memory; this "
                             f"Trainer trains on the CPU, whose memory they occupy already. Use a CUDA accelerator, "
                             f"or offload=None.")

    def _checkpoint_blocks(self) -> None:
        """``activation_checkpointing`` on the module's blocks, before DDP or FSDP wraps them."""
        self._uncheckpoint_blocks()
        self._checkpointed = apply_activation_checkpointing(
            self.lightning_module, self._options.memory.activation_checkpointing, blocks=self._options.stack.blocks,
            owner=type(self).__name__)

    def _uncheckpoint_blocks(self) -> None:
        if self._checkpointed is not None:
            self._checkpointed.undo()
            self._checkpointed = None

    def _shard_options(self, module) -> dict[str, Any]:
        """FSDP's options from these: the units of the ``blocks=`` stack, the offload policy."""
        options: dict[str, Any] = {"offload": self._options.memory.offload}
        if self._options.stack.blocks is not None:
            path, stack = find_blocks(module, self._options.stack.blocks)
            options["blocks"] = [(f"{path}.{name}", block) for name, block in stack.named_children()]
        return options
