"""Activation checkpointing and CPU offload on :class:`~lightning_par.DataParallelStrategy` (the layout strategies
checkpoint inside their engines): the options checked at construction, the blocks checkpointed at setup before DDP
or FSDP wraps the module, and taken out again at teardown.

[Note: CPU offload refused on a CPU device]
``offload="cpu"`` keeps FSDP2's parameter shards, gradients and optimizer state in (pinned) host memory and steps
the optimizer there (``CPUOffloadPolicy``); it saves device memory only. On a CPU accelerator the module lives in
host memory already, and torch's policy then pins and copies host tensors to the host for nothing: refused when the
Trainer is built, with the reason.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning_par.memory.checkpointing import Checkpointed, apply_activation_checkpointing, \
    check_activation_checkpointing
from lightning_par.pipeline.discovery import find_blocks

OFFLOADS = (None, "cpu")


def check_offload(offload: Any, zero_stage: int) -> None:
    if offload not in OFFLOADS:
        raise ValueError(f"`offload={offload!r}` must be None or 'cpu' (FSDP2's CPUOffloadPolicy: parameter shards, "
                         f"gradients and optimizer state in host memory, the optimizer step on the host).")
    if offload is not None and zero_stage != 3:
        raise ValueError(f"`offload={offload!r}` needs `zero_stage=3` (got zero_stage={zero_stage}): only FSDP's "
                         f"fully sharded parameters can live in host memory. Set zero_stage=3, or offload=None.")


class ActivationMemory:
    """The ``activation_checkpointing`` / ``blocks`` / ``offload`` options of a strategy without engines."""

    _checkpointed: Optional[Checkpointed] = None

    def _init_activation_memory(self, activation_checkpointing: Any, blocks: Optional[str], offload: Any,
                                zero_stage: int) -> None:
        self._ac = check_activation_checkpointing(activation_checkpointing)
        if blocks is not None and not isinstance(blocks, str):
            raise ValueError(f"`blocks={blocks!r}` must be the dotted name of the module's block list "
                             f"('model.layers') or None (found).")
        check_offload(offload, zero_stage)
        self._blocks, self._offload = blocks, offload

    def _configure_launcher(self) -> None:  # at Trainer construction: [Note: CPU offload refused on a CPU device]
        super()._configure_launcher()
        devices = getattr(self, "parallel_devices", None) or []
        if self._offload == "cpu" and all(d.type == "cpu" for d in devices):
            raise ValueError(f"`offload='cpu'` saves device memory by keeping the shards in host memory; this "
                             f"Trainer trains on the CPU, whose memory they occupy already. Use a CUDA accelerator, "
                             f"or offload=None.")

    def _checkpoint_blocks(self) -> None:
        """``activation_checkpointing`` on the module's blocks, before DDP or FSDP wraps them."""
        self._uncheckpoint_blocks()
        self._checkpointed = apply_activation_checkpointing(self.lightning_module, self._ac, blocks=self._blocks,
                                                            owner=type(self).__name__)

    def _uncheckpoint_blocks(self) -> None:
        if self._checkpointed is not None:
            self._checkpointed.undo()
            self._checkpointed = None

    def _shard_options(self, module) -> dict[str, Any]:
        """FSDP's options from these: the units of the ``blocks=`` stack, the offload policy."""
        options: dict[str, Any] = {"offload": self._offload}
        if self._blocks is not None:
            path, stack = find_blocks(module, self._blocks)
            options["blocks"] = [(f"{path}.{name}", block) for name, block in stack.named_children()]
        return options
