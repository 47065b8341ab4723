"""The strategies' options, each defined once: frozen groups (layout, pipeline, tensor, sharding, block stack,
memory, DDP replicas, replica sync, learning-rate scaling, weights, steps, fault tolerance, checkpointing, launch:
:mod:`lightning_par.option_groups`), each with its fields' types and defaults and the check of its own values,
composed per strategy (:class:`CoreOptions`, :class:`DataParallelOptions`) and spelled as flat keywords by the
constructors (:func:`takes_options`).

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
it; an option two composites need (``blocks``) is a group of its own.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Mapping, Optional, Sequence, get_type_hints

from lightning_par.dp import fsdp, ft, local_sgd, lr_scaling
from lightning_par.option_groups import (  # noqa: F401  (the groups are this module's names too)
    START_METHODS, BlockOptions, CheckpointOptions, CommHookOptions, FaultToleranceOptions, LaunchOptions,
    LayoutOptions, LrScalingOptions, MemoryOptions, PipelineOptions, ReplicaOptions, ShardingOptions, Size,
    StepOptions, SyncOptions, TensorOptions, VerifyOptions, WeightsOptions, as_timeout, check_flags, check_start_method,
    check_weights)


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
    verify: VerifyOptions = VerifyOptions()  # the setup check of rewritten blocks (lightning_par.verify)
    sharding: ShardingOptions = ShardingOptions()
    stack: BlockOptions = BlockOptions()
    memory: MemoryOptions = MemoryOptions()
    sync: SyncOptions = SyncOptions()  # the data axis: every step, or local SGD / DiLoCo
    comm: CommHookOptions = CommHookOptions()  # the data axis' average through a DDP communication hook
    weights: WeightsOptions = WeightsOptions()
    steps: StepOptions = StepOptions()
    fault_tolerance: FaultToleranceOptions = FaultToleranceOptions()
    checkpointing: CheckpointOptions = CheckpointOptions()
    launch: LaunchOptions = LaunchOptions()

    def __post_init__(self) -> None:
        fsdp.check_offload_stage(self.memory.offload, self.sharding.zero_stage)
        check_hook_sharding(self.comm, self.sharding.zero_stage)
        check_core_fault_tolerance(self)
        check_core_sync(self)


@dataclasses.dataclass(frozen=True)
class DataParallelOptions(Options):
    """:class:`~lightning_par.DataParallelStrategy`."""

    comm: CommHookOptions = CommHookOptions()
    replicas: ReplicaOptions = ReplicaOptions()
    sync: SyncOptions = SyncOptions()
    sharding: ShardingOptions = ShardingOptions()
    stack: BlockOptions = BlockOptions()
    memory: MemoryOptions = MemoryOptions()
    lr_scaling: LrScalingOptions = LrScalingOptions()
    weights: WeightsOptions = WeightsOptions()
    steps: StepOptions = StepOptions()
    fault_tolerance: FaultToleranceOptions = FaultToleranceOptions()
    checkpointing: CheckpointOptions = CheckpointOptions()
    launch: LaunchOptions = LaunchOptions()

    def __post_init__(self) -> None:
        zero_stage, changed = self.sharding.zero_stage, {**self.comm.changed(), **self.replicas.changed()}
        if zero_stage >= 2 and changed:  # FSDP has no DDP reducer to apply them to
            given = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            raise ValueError(f"`zero_stage={zero_stage}` shards with FSDP, which has no DDP communication hooks or "
                             f"buckets: {given} cannot apply. Drop {'them' if len(changed) > 1 else 'it'}, or "
                             f"use zero_stage=0 or 1 (DDP).")
        fsdp.check_offload_stage(self.memory.offload, zero_stage)
        local_sgd.check_combination(self.sync.sync, zero_stage=zero_stage, ddp_options=changed)
        f = self.fault_tolerance
        check_sync_fault_tolerance(self.sync, f.fault_tolerance)
        ft.validate_fault_tolerance(f.fault_tolerance, f.min_replicas, f.ft_timeout, zero_stage=zero_stage,
                                    comm_hook=self.comm.comm_hook, static_graph=self.replicas.static_graph,
                                    lr_scaling=self.lr_scaling.lr_scaling)

    def core(self) -> CoreOptions:
        """The hybrid core's composite for these replicas: pp = tp = 1 (the layout's defaults), the groups both
        take, and fault tolerance left out: DataParallelStrategy sets its own, checked above (which allows
        ``nonfinite="skip"``, where the core's check refuses it)."""
        return CoreOptions(sharding=self.sharding, stack=self.stack, memory=self.memory, weights=self.weights,
                           steps=self.steps, checkpointing=self.checkpointing, launch=self.launch)


def check_hook_sharding(comm: CommHookOptions, zero_stage: int) -> None:
    """A communication hook acts on the replicas' gradient all-reduce, which zero stages 2 and 3 replace by FSDP's
    reduce-scatter."""
    if comm.comm_hook is not None and zero_stage >= 2:
        raise ValueError(f"`zero_stage={zero_stage}` shards with FSDP, which reduce-scatters the gradients itself: "
                         f"`comm_hook={comm.comm_hook!r}` cannot apply. Drop it, or use zero_stage=0 or 1.")


def check_core_fault_tolerance(options: CoreOptions) -> None:
    """What ``fault_tolerance='torchft'`` needs of the core's other groups ([Note: the replica axis under torchft]
    in :mod:`lightning_par.strategies._fault_tolerance`)."""
    if options.fault_tolerance.fault_tolerance is None:
        return
    if options.comm.comm_hook is not None:
        raise ValueError(f"`fault_tolerance='torchft'` does not support `comm_hook={options.comm.comm_hook!r}`: the "
                         f"replicas' average is torchft's all-reduce over the live groups; compressing hooks are not "
                         f"composed with it. Use comm_hook=None.")
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


def check_core_sync(options: CoreOptions) -> None:
    """What ``sync="local_sgd" | "diloco"`` on the core's data axis does not compose with ([Note: periodic sync on
    the data axis] in :mod:`lightning_par.strategies._periodic_sync`)."""
    sync = options.sync
    if sync.sync == "every_step":
        return
    local_sgd.check_combination(sync.sync, zero_stage=options.sharding.zero_stage, ddp_options=options.comm.changed())
    check_sync_fault_tolerance(sync, options.fault_tolerance.fault_tolerance)


def check_sync_fault_tolerance(sync: SyncOptions, fault_tolerance: Optional[str]) -> None:
    """Under torchft the replica groups meet on its quorum at syncs ([Note: periodic sync under torchft, one
    wiring] in :mod:`lightning_par.strategies._fault_tolerance`): one quorum a sync, so no streaming DiLoCo."""
    if fault_tolerance is not None and sync.fragments > 1:
        raise ValueError(f"`fragments={sync.fragments}` (streaming DiLoCo) with `fault_tolerance='torchft'` is not "
                         f"supported: each fragment's sync would need a torchft quorum of its own. Use fragments=1 "
                         f"under torchft.")


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
