"""What the strategies share (the checks of their arguments are the option groups', in :mod:`lightning_par.options`),
and for the strategies that lay ranks out on a :class:`~lightning_par.topology.Topology` (pipeline, tensor) the
layout, one process group per mesh axis and the checkpoint hooks (:mod:`lightning_par.strategies._checkpoint`).
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lightning_par.strategies._checkpoint import CheckpointMixin
from lightning_par.strategies._checkpoint_io import AtomicSaves
from lightning_par.strategies._materialize import MaterializingStrategy
from lightning_par.strategies._nonfinite import NonFiniteChecks
from lightning_par.strategies._optimizer_step import OptimizerStep
from lightning_par.strategies._registry import RegisteredByName
from lightning_par.strategies._waits import NamedWaits
from lightning_par.topology import Topology


def size_names(cls: type) -> tuple[str, ...]:
    """The parallel sizes the constructor of strategy ``cls`` takes (a preset fixes the others): what a size
    error names."""
    return tuple(n for n in inspect.signature(cls.__init__).parameters if n.endswith("_parallel_size"))


def check_accumulation(trainer) -> None:
    """``Trainer(accumulate_grad_batches=...)`` is a positive integer (Lightning itself would divide by it)."""
    k = trainer.accumulate_grad_batches
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"`Trainer(accumulate_grad_batches={k!r})` must be a positive integer (1: no "
                         f"accumulation, k: one optimizer step every k batches).")


class LayoutStrategy(OptimizerStep, CheckpointMixin, AtomicSaves, NonFiniteChecks, NamedWaits, RegisteredByName,
                     MaterializingStrategy, DDPStrategy):
    """Base of the strategies whose ranks sit on a :class:`Topology`: its :attr:`topology` (resolved by the
    subclass's ``setup_environment``), the data-parallel sampler, process groups per mesh axis, the
    checkpoint hooks of :class:`~lightning_par.strategies._checkpoint.CheckpointMixin` (one file, or with
    ``save_distributed_checkpoint=True`` a DCP directory; ``async_save=True`` writes in the background; both
    atomic), meta builds and ``weights=`` (:class:`MaterializingStrategy`), ``nonfinite`` and named waits."""

    def __init__(self, options, *, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None) -> None:
        """``options``: the strategy's frozen groups, checked ([Note: flat keywords, grouped options] in
        :mod:`lightning_par.options`); this base reads ``checkpointing``, ``weights``, ``steps`` and ``launch``."""
        self._init_checkpointing(save_distributed_checkpoint=options.checkpointing.save_distributed_checkpoint,
                                 async_save=options.checkpointing.async_save)
        self._set_nonfinite(options.steps.nonfinite)
        launch = options.launch
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=launch.process_group_backend,
                         start_method=launch.start_method, timeout=launch.collective_timeout)
        self._set_weights(options.weights.weights, options.weights.weights_prefix)
        self._topology: Optional[Topology] = None

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError(f"The layout of {type(self).__name__} exists once its processes are set up "
                               f"(`setup_environment`, in Trainer.fit / validate / test / predict).")
        return self._topology

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.topology.sampler_kwargs(self.global_rank)  # only data-parallel replicas split the data

    def _consolidates_weights(self) -> bool:
        return True  # stages and shards: the caller's module receives them assembled (ConsolidatingLauncher)

    def _new_groups(self, axis: str):
        """A process group for every group of ranks along ``axis`` (none of one rank); this rank's, or None."""
        mine = None
        for ranks in self.topology.all_groups(axis):  # same order on every rank, as new_group requires
            if len(ranks) == 1:
                continue
            group = dist.new_group(ranks, timeout=self._timeout)
            if self.global_rank in ranks:
                mine = group
        return mine

    def _checkpoint_layout(self) -> dict[str, Any]:
        topo = self.topology
        return {**super()._checkpoint_layout(), "data_parallel_size": topo.data_parallel_size,
                "pipeline_parallel_size": topo.pipeline_parallel_size,
                "tensor_parallel_size": topo.tensor_parallel_size}
