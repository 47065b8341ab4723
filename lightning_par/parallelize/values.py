"""The values the parallelize order reads (:class:`EngineOptions`, :class:`Groups`, :class:`Rank`) and what it makes
(:class:`Parallelized`): frozen, Lightning-free, built by the strategy once the layout is known."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch

from lightning_par.memory.checkpointing import Checkpointed
from lightning_par.options import (BlockOptions, CommHookOptions, LayoutOptions, MemoryOptions, PipelineOptions,
                                   ShardingOptions, SyncOptions, TensorOptions, VerifyOptions)
from lightning_par.pipeline.stage import StageRuntime
from lightning_par.tensor.plan import TensorPlan
from lightning_par.topology import Topology


@dataclass(frozen=True)
class EngineOptions:
    """The strategy's frozen option groups an engine reads (:mod:`lightning_par.options`), with what the layout
    resolves in them: ``microbatches`` a number (2 x stages when not given), ``stages_per_rank`` 1 with one stage
    (nothing to interleave)."""

    pipeline: PipelineOptions = PipelineOptions()
    tensor: TensorOptions = TensorOptions()
    sharding: ShardingOptions = ShardingOptions()
    stack: BlockOptions = BlockOptions()
    memory: MemoryOptions = MemoryOptions()  # lightning_par.memory.checkpointing
    stages: int = 1  # the layout's pipeline_parallel_size
    sync: SyncOptions = SyncOptions()  # the replica engine's sync="local_sgd" | "diloco" (lightning_par.dp.local_sgd)
    comm: CommHookOptions = CommHookOptions()  # the pipeline / SPMD engines' (the replica engine's DDP has its own)
    check: VerifyOptions = VerifyOptions()  # the setup check (lightning_par.verify)
    layout: LayoutOptions = LayoutOptions()  # the sizes as given; the context-parallel method, expert parallelism

    @property
    def microbatches(self) -> int:
        return self.pipeline.microbatches or 2 * self.stages

    @property
    def given_microbatches(self) -> Optional[int]:  # as the user gave it (None: 2 x stages), checked against the batch
        return self.pipeline.microbatches

    @property
    def stages_per_rank(self) -> int:
        return self.pipeline.stages_per_rank if self.stages > 1 else 1

    schedule = property(lambda self: self.pipeline.schedule)
    blocks = property(lambda self: self.stack.blocks)
    balance = property(lambda self: self.pipeline.balance)
    strict_batch_semantics = property(lambda self: self.pipeline.strict_batch_semantics)
    plan = property(lambda self: self.tensor.plan)
    sequence_parallel = property(lambda self: self.tensor.sequence_parallel)
    loss_parallel = property(lambda self: self.tensor.loss_parallel)
    zero_stage = property(lambda self: self.sharding.zero_stage)
    activation_checkpointing = property(lambda self: self.memory.activation_checkpointing)
    offload = property(lambda self: self.memory.offload)
    verify = property(lambda self: self.check.verify)
    context_parallel_method = property(lambda self: self.layout.context_parallel_method)


@dataclass(frozen=True)
class Groups:
    """This rank's process groups (None: a group of one rank) and the ``DeviceMesh`` (None without one)."""

    dp: Any = None
    pp: Any = None
    tp: Any = None
    cp: Any = None  # the ranks sharing every sequence (lightning_par.context)
    mesh: Any = None
    p2p: tuple = (None, None, None, None)
    result: Any = None
    timeout: Optional[timedelta] = None
    sharded_replicas: bool = False  # zero_stage 2 / 3 with several replicas: FSDP2 over the ``dp`` axis


@dataclass(frozen=True)
class Rank:
    """Where this rank stands, as values: its device, global rank, the layout, the precision and who refuses."""

    device: torch.device
    rank: int
    world_size: int
    topology: Topology
    precision: str = "32-true"
    owner: str = "the strategy"  # the strategy's class name, what a refusal names


@dataclass
class Parallelized:
    """What the order made (each field: the step that made it)."""

    checkpointed: Optional[Checkpointed] = None  # 4.
    plan: Optional[TensorPlan] = None  # 3. / 5.
    experts: Any = None  # 6. lightning_par.experts.ExpertParallel
    compiled: Any = None  # 8. lightning_par.compile.Compiled
    units: Optional[list[str]] = None  # 9. FSDP's units
    context: Any = None  # 11.
    # the pipeline's
    stack: Optional["BlockStack"] = None  # 1.
    split: Optional["StageSplit"] = None  # 2.
    runtime: Optional[StageRuntime] = None
    shards: Any = None  # dp.fsdp.StageShards (a pipeline under zero_stage 2 / 3)
    schedule: Optional["Schedule"] = None  # 12.
    full_keys: list[str] = field(default_factory=list)  # the whole module's state-dict keys, before the split
    summary: str = ""  # what rank 0 prints: the stage table, the plan


__all__ = ["EngineOptions", "Groups", "Parallelized", "Rank"]
