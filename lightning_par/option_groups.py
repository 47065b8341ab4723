"""The strategies' option groups: one frozen dataclass per concern, each field with its type and default, each group
checking its own values in ``__post_init__`` (the ``ValueError`` naming the value and the fix). The composites that
put them together per strategy, and the constructors spelled from them, are :mod:`lightning_par.options` ([Note: flat
keywords, grouped options] there).
"""
from __future__ import annotations

import dataclasses
import math
import os
from datetime import timedelta
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from lightning_par.dp import comm_hooks, fsdp, ft, local_sgd, lr_scaling, zero
from lightning_par.memory.checkpointing import check_activation_checkpointing
from lightning_par.nonfinite import check_nonfinite
from lightning_par.pipeline.options import check_blocks, check_options
from lightning_par.tensor.plan import check_user_plan
from lightning_par.topology import ORDERS, check_sizes

Size = Union[int, Literal["auto"]]
START_METHODS = ("popen", "spawn", "fork", "forkserver")


# -- checks shared by several groups (the messages tests and users see) -------------------------------------
def check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"`{name}={value!r}` must be True or False.")


def check_start_method(start_method: str) -> str:
    if start_method not in START_METHODS:
        raise ValueError(f"`start_method={start_method!r}` must be one of "
                         f"{', '.join(repr(m) for m in START_METHODS)} ('popen' is Lightning's default; "
                         f"'fork' starts CPU ranks fastest).")
    return start_method


def as_timeout(timeout: Union[float, timedelta]) -> timedelta:
    """The collective timeout as a ``timedelta``: seconds or a ``timedelta``, finite and positive."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"`timeout={timeout!r}` must be a finite positive number of seconds (or a timedelta): "
                         f"every collective must give up eventually. The default is 1800.0 (30 minutes).")
    return timedelta(seconds=seconds)


def check_weights(weights: Any, weights_prefix: Any) -> None:
    if weights is not None and not isinstance(weights, (str, os.PathLike)):
        raise ValueError(f"`weights={weights!r}` must be a path (a safetensors file or sharded directory, a torch "
                         f"state-dict file, a Lightning .ckpt or a torch.distributed.checkpoint directory) or None.")
    if not isinstance(weights_prefix, str):
        raise ValueError(f"`weights_prefix={weights_prefix!r}` must be a string: what the module's names have before "
                         f"the file's (e.g. 'net.' for a LightningModule holding the model as `self.net`).")


# -- the groups ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayoutOptions:
    """The parallel sizes (``"auto"``: what the world size leaves) and the mesh's axis order."""

    data_parallel_size: Size = "auto"
    pipeline_parallel_size: Size = 1
    tensor_parallel_size: Size = 1
    mesh_order: str = "pp_dp_tp"
    context_parallel_size: int = 1  # ranks sharing every sequence (lightning_par.context), just outside tp
    context_parallel_method: str = "ring"  # "ring" | "allgather" | "ulysses" (docs/context-parallel.md)

    def __post_init__(self) -> None:
        check_sizes(pipeline_parallel_size=self.pipeline_parallel_size, data_parallel_size=self.data_parallel_size,
                    tensor_parallel_size=self.tensor_parallel_size, context_parallel_size=self.context_parallel_size)
        if self.context_parallel_method not in ("ring", "allgather", "ulysses"):
            raise ValueError(f"`context_parallel_method={self.context_parallel_method!r}` must be 'ring' (K/V passed "
                             f"around the group, the default), 'allgather' (K/V gathered once) or 'ulysses' "
                             f"(all-to-all over heads around the module's own attention); see "
                             f"docs/context-parallel.md.")
        if self.mesh_order not in ORDERS:
            raise ValueError(f"`mesh_order={self.mesh_order!r}` must be one of {sorted(ORDERS)}: 'pp_dp_tp' "
                             f"(pipelines span nodes, as Megatron and torchtitan) or 'dp_pp_tp' (replicas span "
                             f"nodes).")

    @property
    def sizes(self) -> dict[str, Size]:
        return {"data_parallel_size": self.data_parallel_size, "pipeline_parallel_size": self.pipeline_parallel_size,
                "tensor_parallel_size": self.tensor_parallel_size, "context_parallel_size": self.context_parallel_size}


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How the block stack is split into stages and micro-batches flow through them (:mod:`lightning_par.pipeline`)."""

    microbatches: Optional[int] = None  # None: 2 x pipeline_parallel_size
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    balance: Union[str, Sequence[int]] = "params"  # a list is kept as a tuple
    strict_batch_semantics: bool = False  # [Note: losses that couple samples] in lightning_par.pipeline.coupling

    def __post_init__(self) -> None:
        check_options(microbatches=self.microbatches, schedule=self.schedule, stages_per_rank=self.stages_per_rank,
                      balance=self.balance, strict_batch_semantics=self.strict_batch_semantics)
        if not isinstance(self.balance, str):
            object.__setattr__(self, "balance", tuple(self.balance))


@dataclasses.dataclass(frozen=True)
class TensorOptions:
    """How each layer is split over the tensor-parallel ranks (:mod:`lightning_par.tensor`)."""

    plan: Union[str, Mapping[str, str]] = "auto"
    sequence_parallel: bool = False
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        check_flags(sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel)
        if self.plan != "auto":
            object.__setattr__(self, "plan", check_user_plan(self.plan))


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """The setup check of every rewritten block ([Note: the setup check] in :mod:`lightning_par.verify`): the
    tensor plan leaves a region that differs replicated, context / expert parallelism refuse it. ``False`` for
    users who know their model (saves one forward and backward per kind of block at setup)."""

    verify: bool = True

    def __post_init__(self) -> None:
        check_flags(verify=self.verify)


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
    """ZeRO over the data-parallel axis (:mod:`lightning_par.dp.zero`, :mod:`lightning_par.dp.fsdp`)."""

    zero_stage: int = 0

    def __post_init__(self) -> None:
        zero.validate_zero_stage(self.zero_stage)


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """The block stack (None: found, :func:`~lightning_par.pipeline.discovery.find_blocks`; or its dotted name):
    the pipeline's cut points, the units activation checkpointing recomputes and FSDP shards."""

    blocks: Optional[str] = None
    def __post_init__(self) -> None:
        check_blocks(self.blocks)


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """Activation memory: which blocks recompute their forward in backward (:mod:`lightning_par.memory`); and
    FSDP's CPU offload of the zero-stage-3 shards (:func:`~lightning_par.dp.fsdp.check_offload_stage`)."""

    activation_checkpointing: Union[None, int, str] = None  # None | "full" | k (every k-th block) | "selective"
    offload: Optional[Literal["cpu"]] = None

    def __post_init__(self) -> None:
        check_activation_checkpointing(self.activation_checkpointing)
        fsdp.check_offload(self.offload)


@dataclasses.dataclass(frozen=True)
class CommHookOptions:
    """How the replicas' gradients travel: a DDP communication hook (:mod:`lightning_par.dp.comm_hooks`), DDP's own on
    DataParallelStrategy, run on the core's flat buckets elsewhere ([Note: DDP's hooks on the core's flat buckets])."""

    comm_hook: Optional[Literal["fp16", "bf16", "powersgd"]] = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 1000

    def __post_init__(self) -> None:
        comm_hooks.validate_comm_hook(self.comm_hook, self.powersgd_rank, self.powersgd_start_iter)

    def changed(self) -> dict[str, Any]:
        """``comm_hook`` where one is given (the PowerSGD settings act only with it)."""
        return {} if self.comm_hook is None else {"comm_hook": self.comm_hook}


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    """``DistributedDataParallel``'s own settings (defaults as there), DataParallelStrategy's alone."""

    find_unused_parameters: bool = False
    bucket_cap_mb: Optional[float] = None  # None: DDP's 25 MiB buckets after a 1 MiB first one
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def __post_init__(self) -> None:
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"`bucket_cap_mb={cap!r}` must be a positive number of MiB or None (DDP's "
                             f"default: 25 MiB buckets after a 1 MiB first bucket).")
        check_flags(find_unused_parameters=self.find_unused_parameters,
                    gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=self.static_graph)

    def changed(self) -> dict[str, Any]:
        """``DistributedDataParallel``'s options given a value other than their default."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def ddp_kwargs(self, *, fault_tolerant: bool) -> dict[str, Any]:
        """``DistributedDataParallel``'s keywords (``bucket_cap_mb`` only when given, as Lightning's DDPStrategy)."""
        # [Note: forcing DDP's unused-parameter search] in lightning_par.dp.ft
        kwargs: dict[str, Any] = dict(find_unused_parameters=self.find_unused_parameters or fault_tolerant,
                                      gradient_as_bucket_view=self.gradient_as_bucket_view,
                                      static_graph=self.static_graph)
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = float(self.bucket_cap_mb)
        return kwargs


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    """How often the replicas meet: every step (DDP), or local SGD / DiLoCo every ``sync_every`` optimizer steps
    (:mod:`lightning_par.dp.local_sgd`)."""

    sync: Literal["every_step", "local_sgd", "diloco"] = "every_step"
    sync_every: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1

    def __post_init__(self) -> None:
        local_sgd.check_sync(self.sync, self.sync_every, self.outer_lr, self.outer_momentum, self.fragments)


@dataclasses.dataclass(frozen=True)
class LrScalingOptions:
    """Learning rates scaled with the global batch (:mod:`lightning_par.dp.lr_scaling`)."""

    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    reference_batch_size: Optional[int] = None  # None: one device's batch per optimizer step

    def __post_init__(self) -> None:
        lr_scaling.validate_lr_scaling(self.lr_scaling, self.reference_batch_size)


@dataclasses.dataclass(frozen=True)
class WeightsOptions:
    """A weights file or directory read into each rank's share at setup (:mod:`lightning_par.weights`)."""

    weights: Optional[str] = None
    weights_prefix: str = ""

    def __post_init__(self) -> None:
        check_weights(self.weights, self.weights_prefix)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What an optimizer step does with a NaN / inf ([Note: non-finite values] in :mod:`lightning_par.nonfinite`)."""

    nonfinite: Literal["error", "skip"] = "error"

    def __post_init__(self) -> None:
        check_nonfinite(self.nonfinite)


@dataclasses.dataclass(frozen=True)
class FaultToleranceOptions:
    """torchft's replica groups (:mod:`lightning_par.dp.ft`); ``ft_timeout``: seconds to wait for a quorum, a peer
    or its state."""

    fault_tolerance: Optional[Literal["torchft"]] = None
    min_replicas: int = 1
    ft_timeout: float = 60.0

    def __post_init__(self) -> None:  # the values alone; what they need of the other groups: the composites
        ft.validate_fault_tolerance(self.fault_tolerance, self.min_replicas, self.ft_timeout, zero_stage=0,
                                    comm_hook=None, static_graph=False, lr_scaling="none")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """The checkpoint format (one file, or a DCP directory) and background saves
    (:mod:`lightning_par.strategies._checkpoint`)."""

    save_distributed_checkpoint: bool = False
    async_save: bool = False

    def __post_init__(self) -> None:
        check_flags(save_distributed_checkpoint=self.save_distributed_checkpoint, async_save=self.async_save)


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How the processes start and how long a collective may wait (``timeout``: seconds or a ``timedelta``)."""

    start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen"
    timeout: Union[float, timedelta] = 1800.0
    process_group_backend: Optional[str] = None  # None: gloo for CPU, NCCL for CUDA

    def __post_init__(self) -> None:
        check_start_method(self.start_method)
        as_timeout(self.timeout)

    @property
    def collective_timeout(self) -> timedelta:
        return as_timeout(self.timeout)
