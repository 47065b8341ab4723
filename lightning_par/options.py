"""The strategies' options, each defined once: frozen groups (layout, pipeline, tensor, sharding, block stack,
memory, DDP replicas, learning-rate scaling, weights, steps, fault tolerance, checkpointing, launch), each with its
fields' types and defaults and the check of its own values, composed per strategy (:class:`CoreOptions`,
:class:`DataParallelOptions`) and spelled as flat keywords by the constructors (:func:`takes_options`).

    >>> o = CoreOptions.from_flat({"microbatches": 8, "zero_stage": 1})
    >>> o.pipeline.microbatches, o.sharding.zero_stage, o.fault_tolerance.ft_timeout
    (8, 1, 60.0)
    >>> CoreOptions.from_flat({"schedule": "zigzag"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `schedule='zigzag'` is not a pipeline schedule; choose one of ...

[Note: flat keywords, grouped options]
A constructor takes flat keywords (``HybridParallelStrategy(microbatches=8, zero_stage=1)``; on the command line
``strategy.microbatches=8``), as Lightning's strategies and every config, recipe and test written so far do. Behind
them each option is defined once: a field of one frozen group, with its type, its default and, in the group's
``__post_init__``, its check (the ``ValueError`` naming the value and the fix). A flat keyword *is* the field of
the same name (field names are unique across a composite's groups; :meth:`Options.fields` refuses a clash), so
the mapping is the name itself and there is no table to keep in step. :func:`takes_options` writes a
constructor from a composite: its ``inspect.signature`` and annotations list every field as a keyword-only
argument with the field's default, so :func:`lightning_par.config.strategy_schema` reads the Hydra schema off the
constructor as before (keys, defaults and types the groups' by construction), and a keyword the strategy does
not take is the ``TypeError`` of a written-out signature. A composite's ``__post_init__`` holds the checks that
span groups (fault tolerance against sharding, DDP's options against FSDP); the order of the checks is the order
of the groups, then the composite's. A preset is the core's constructor with the sizes its name excludes fixed
(its own axis ``"auto"`` by default) and the group of the excluded model axis left at its defaults (its options
cannot act with that size fixed at 1); nothing else. The strategy keeps the composite (``self._options``), and
the engines' :class:`~lightning_par.strategies._engine.EngineOptions` is built from its groups.
Why flat keywords over group arguments (``pipeline=PipelineOptions(...)``): every config, recipe and test would
change, and the command line would read ``strategy.pipeline.microbatches``; with the mapping by name the flat
spelling costs nothing. The cost: an editor that reads source rather than ``inspect.signature`` shows
``**options`` (``help()`` and the docs tables show the keywords). A new option is one field in its group (and a
row in docs/strategies.md); a new group is one frozen dataclass here and one field of each composite that takes
it. A group one composite extends is a subclass (DataParallelStrategy's memory group adds ``offload`` to the
core's ``activation_checkpointing``); an option two composites need (``blocks``) is a group of its own.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from datetime import timedelta
from typing import Any, Literal, Mapping, Optional, Sequence, Union, get_type_hints

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

    def __post_init__(self) -> None:
        check_sizes(pipeline_parallel_size=self.pipeline_parallel_size, data_parallel_size=self.data_parallel_size,
                    tensor_parallel_size=self.tensor_parallel_size, context_parallel_size=self.context_parallel_size)
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
    """Activation memory: which blocks recompute their forward in backward (:mod:`lightning_par.memory`)."""

    activation_checkpointing: Union[None, int, str] = None  # None | "full" | k (every k-th block) | "selective"
    def __post_init__(self) -> None:
        check_activation_checkpointing(self.activation_checkpointing)


@dataclasses.dataclass(frozen=True)
class DataParallelMemoryOptions(MemoryOptions):
    """:class:`MemoryOptions` and FSDP's CPU offload (``zero_stage=3`` only: :class:`DataParallelOptions`)."""
    offload: Optional[Literal["cpu"]] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        fsdp.check_offload(self.offload)


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    """DDP's replicas: the communication hook (:mod:`lightning_par.dp.comm_hooks`) and ``DistributedDataParallel``'s
    own settings (defaults as there)."""

    comm_hook: Optional[Literal["fp16", "bf16", "powersgd"]] = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 1000
    find_unused_parameters: bool = False
    bucket_cap_mb: Optional[float] = None  # None: DDP's 25 MiB buckets after a 1 MiB first one
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def __post_init__(self) -> None:
        comm_hooks.validate_comm_hook(self.comm_hook, self.powersgd_rank, self.powersgd_start_iter)
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"`bucket_cap_mb={cap!r}` must be a positive number of MiB or None (DDP's "
                             f"default: 25 MiB buckets after a 1 MiB first bucket).")
        check_flags(find_unused_parameters=self.find_unused_parameters,
                    gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=self.static_graph)

    def changed(self) -> dict[str, Any]:
        """The DDP options (the hook and ``DistributedDataParallel``'s) given a value other than their default."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("powersgd")
                and getattr(self, f.name) != getattr(default, f.name)}

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


# -- the composites ----------------------------------------------------------------------------------------------
class Options:
    """Base of the composites: frozen dataclasses whose fields are groups ([Note: flat keywords, grouped options])."""

    @classmethod
    def fields(cls) -> dict[str, tuple[str, inspect.Parameter]]:
        """Every flat keyword: its group's field name and a keyword-only parameter with its default and type."""
        return _flat_fields(cls)

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]):
        """The composite from flat keywords (a missing one takes its group's default); each group is checked as
        it is built, in the composite's order, then the composite."""
        flat = cls.fields()
        unknown = sorted(set(values) - set(flat))
        if unknown:
            raise TypeError(f"{cls.__name__} has no option {unknown[0]!r}.")
        groups: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(cls)}
        for name, value in values.items():
            groups[flat[name][0]][name] = value
        hints = get_type_hints(cls)
        return cls(**{g: hints[g](**kw) for g, kw in groups.items()})


@functools.cache
def _flat_fields(cls: type) -> dict[str, tuple[str, inspect.Parameter]]:
    flat: dict[str, tuple[str, inspect.Parameter]] = {}
    for group, kind in get_type_hints(cls).items():
        for f, hint in get_type_hints(kind).items():
            if f in flat:
                raise TypeError(f"{cls.__name__}: option {f!r} is in both {flat[f][0]!r} and {group!r}.")
            default = next(x.default for x in dataclasses.fields(kind) if x.name == f)
            flat[f] = (group, inspect.Parameter(f, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint))
    return flat


@dataclasses.dataclass(frozen=True)
class CoreOptions(Options):
    """:class:`~lightning_par.HybridParallelStrategy` and its presets."""

    layout: LayoutOptions = LayoutOptions()
    pipeline: PipelineOptions = PipelineOptions()
    tensor: TensorOptions = TensorOptions()
    sharding: ShardingOptions = ShardingOptions()
    stack: BlockOptions = BlockOptions()
    memory: MemoryOptions = MemoryOptions()
    weights: WeightsOptions = WeightsOptions()
    steps: StepOptions = StepOptions()
    fault_tolerance: FaultToleranceOptions = FaultToleranceOptions()
    checkpointing: CheckpointOptions = CheckpointOptions()
    launch: LaunchOptions = LaunchOptions()

    def __post_init__(self) -> None:
        check_core_fault_tolerance(self)


@dataclasses.dataclass(frozen=True)
class DataParallelOptions(Options):
    """:class:`~lightning_par.DataParallelStrategy`."""

    replicas: ReplicaOptions = ReplicaOptions()
    sync: SyncOptions = SyncOptions()
    sharding: ShardingOptions = ShardingOptions()
    stack: BlockOptions = BlockOptions()
    memory: DataParallelMemoryOptions = DataParallelMemoryOptions()
    lr_scaling: LrScalingOptions = LrScalingOptions()
    weights: WeightsOptions = WeightsOptions()
    steps: StepOptions = StepOptions()
    fault_tolerance: FaultToleranceOptions = FaultToleranceOptions()
    checkpointing: CheckpointOptions = CheckpointOptions()
    launch: LaunchOptions = LaunchOptions()

    def __post_init__(self) -> None:
        zero_stage, changed = self.sharding.zero_stage, self.replicas.changed()
        if zero_stage >= 2 and changed:  # FSDP has no DDP reducer to apply them to
            given = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            raise ValueError(f"`zero_stage={zero_stage}` shards with FSDP, which has no DDP communication hooks or "
                             f"buckets: {given} cannot apply. Drop {'them' if len(changed) > 1 else 'it'}, or "
                             f"use zero_stage=0 or 1 (DDP).")
        fsdp.check_offload_stage(self.memory.offload, zero_stage)
        local_sgd.check_combination(self.sync.sync, zero_stage=zero_stage, ddp_options=changed)
        f = self.fault_tolerance
        ft.validate_fault_tolerance(f.fault_tolerance, f.min_replicas, f.ft_timeout, zero_stage=zero_stage,
                                    comm_hook=self.replicas.comm_hook, static_graph=self.replicas.static_graph,
                                    lr_scaling=self.lr_scaling.lr_scaling)

    def core(self) -> CoreOptions:
        """The hybrid core's composite for these replicas: pp = tp = 1 (the layout's defaults), the groups both
        take, and fault tolerance left out: DataParallelStrategy sets its own, checked above (which allows
        ``nonfinite="skip"``, where the core's check refuses it)."""
        return CoreOptions(sharding=self.sharding, stack=self.stack, memory=self.memory, weights=self.weights,
                           steps=self.steps, checkpointing=self.checkpointing, launch=self.launch)


def check_core_fault_tolerance(options: CoreOptions) -> None:
    """What ``fault_tolerance='torchft'`` needs of the core's other groups ([Note: the replica axis under torchft]
    in :mod:`lightning_par.strategies._fault_tolerance`)."""
    if options.fault_tolerance.fault_tolerance is None:
        return
    zero_stage = options.sharding.zero_stage
    if zero_stage != 0:
        raise ValueError(f"`fault_tolerance='torchft'` does not support `zero_stage={zero_stage}` on the hybrid core: "
                         f"ZeRO shards over the data-parallel axis, which under torchft is the set of live replica "
                         f"groups (a lost group would take its shards along), and a recovering rank receives its "
                         f"whole state from one peer. Use zero_stage=0.")
    if options.layout.data_parallel_size not in ("auto", 1):
        raise ValueError(one_replica_per_job(options.layout.data_parallel_size))
    if options.steps.nonfinite == "skip":
        raise ValueError("`fault_tolerance='torchft'` does not support `nonfinite='skip'` on the hybrid core: a group "
                         "decides a skip on its own batch's loss, and the other groups would step without it (their "
                         "weights would part silently). Use nonfinite='error' (a group that stops rejoins from a "
                         "peer).")


def one_replica_per_job(size) -> str:
    return (f"`fault_tolerance='torchft'` makes each torchrun job one replica group holding the whole pipeline x "
            f"tensor-parallel model, so `data_parallel_size` inside a job must be 1 (got {size}): the replicas are "
            f"the jobs (NUM_REPLICA_GROUPS). Launch one torchrun per replica group with --nproc-per-node = "
            f"pipeline_parallel_size x tensor_parallel_size.")


# -- constructors -------------------------------------------------------------------------------------------------
PLUMBING = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


def takes_options(options_type: type, *, fixed: Optional[Mapping[str, Any]] = None,
                  defaults: Optional[Mapping[str, Any]] = None, without: Sequence[str] = (),
                  plumbing: bool = True) -> Any:
    """A strategy's ``__init__`` taking the flat keywords of ``options_type`` ([Note: flat keywords, grouped
    options]): it builds the frozen composite and calls ``self._init_options(options, **plumbing)``.

    ``fixed``: keywords the constructor does not take (a preset's excluded sizes); ``defaults``: other defaults
    for some keywords (a preset's own size, ``"auto"``); ``without``: groups left at their defaults;
    ``plumbing``: also take Lightning's ``accelerator``, ``parallel_devices``, ... (None by default, which the
    Trainer sets).
    """
    fixed, defaults = dict(fixed or {}), dict(defaults or {})
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name, (group, param) in options_type.fields().items():
        if name in fixed or group in without:
            continue
        params.append(param.replace(default=defaults[name]) if name in defaults else param)
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in PLUMBING if plumbing]
    signature = inspect.Signature(params)

    def __init__(self, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, **kwargs)
        except TypeError as e:  # a keyword this constructor does not take: as a written-out signature says it
            raise TypeError(f"{type(self).__name__}.__init__() {e}") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        del values["self"]
        given = {n: values.pop(n) for n in PLUMBING if n in values}
        self._init_options(options_type.from_flat({**values, **fixed}), **given)

    __init__.__signature__ = signature
    __init__.__annotations__ = {p.name: p.annotation for p in params[1:] if p.annotation is not p.empty}
    __init__.__annotations__["return"] = None
    return __init__
