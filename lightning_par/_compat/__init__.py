"""The private torch APIs the package relies on, imported here (this package: the concepts with several, context
parallel's kernels, compile, activation checkpointing, in modules of their own) and nowhere else.

A torch release that moves or renames one of them then breaks this package only, with the name at hand.
Each function says what it wraps and what its callers do when the API is not there.

Names re-exported from torch's private modules are listed in ``__all__``; the test
``tests/unit/test_compat.py`` checks the rest of the package for private imports and for private attributes
of objects it does not own (``trainer._accelerator_connector``): each of those is a named function here.
"""
from __future__ import annotations

import contextlib

from typing import Optional, Sequence

import torch


def local_shape_and_offset(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                           placements: Sequence) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape of a DTensor shard and its offset in the full tensor, for the device at ``coordinate``
    of a mesh of ``mesh_shape``, without a mesh or a process group.

    Wraps ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``, the plain-data core of
    the public ``compute_local_shape_and_global_offset`` (which needs a live ``DeviceMesh``), so the shard
    arithmetic is torch's own, uneven splits included.
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return _compute_local_shape_and_global_offset(tuple(global_shape), tuple(mesh_shape), list(coordinate),
                                                  list(placements))


def strided_shard_type() -> type:
    """``torch.distributed.tensor.placement_types._StridedShard``: a shard made of several strided blocks."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def checkpoint_offset(storage: torch.UntypedStorage) -> Optional[int]:
    """Where a storage's bytes start in the archive it was loaded from, or ``None`` if torch did not say.

    ``torch.load(..., map_location="meta")`` reads only an archive's pickle and records on each (meta)
    storage the offset of its data record in ``_checkpoint_offset``; callers fall back to slower, whole
    reads when it is missing.
    """
    offset = getattr(storage, "_checkpoint_offset", None)
    return offset if isinstance(offset, int) else None


def fake_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor without memory: a ``torch._subclasses.fake_tensor.FakeTensor``, which
    ``torch.save`` under ``torch.serialization.skip_data(materialize_fake_tensors=True)`` writes as a CPU
    tensor's record without its bytes (the converter's ``.ckpt`` writer fills them in)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(tuple(shape), dtype=dtype)


def broadcast_coalesced(group, tensors: Sequence[torch.Tensor], src: int, bucket_bytes: int = 1 << 24) -> None:
    """Broadcast ``tensors`` in place from global rank ``src`` over ``group``, packed into buckets of
    ``bucket_bytes`` (few collectives for many small tensors). Wraps ``torch.distributed._broadcast_coalesced``,
    what DDP uses to sync module states at construction."""
    torch.distributed._broadcast_coalesced(group, list(tensors), bucket_bytes, src)


_ZERO_CLASS: Optional[type] = None


def shard_aware_zero_optimizer() -> type:
    """torch's ``ZeroRedundancyOptimizer`` subclassed (once): an updated parameter is broadcast as a ``DTensor``'s
    local shard (its dp peers hold the same; c10d takes no DTensor) by the private ``_broadcast_params_from_rank``
    of the per-parameter path; plain ones as torch does. ``step`` carries the LR schedulers' mark."""
    global _ZERO_CLASS
    if _ZERO_CLASS is not None:
        return _ZERO_CLASS
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor

    if not hasattr(ZeroRedundancyOptimizer, "_broadcast_params_from_rank"):
        raise RuntimeError("This torch's ZeroRedundancyOptimizer has no `_broadcast_params_from_rank`: "
                           "zero_stage=1 with tensor-parallel (DTensor) parameters needs lightning_par updated.")

    class ShardAwareZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
        def step(self, closure=None, **kwargs):
            # What torch's LRScheduler wraps an optimizer's ``step`` with at the scheduler's construction, here
            # on the class: a scheduler rebound to this optimizer (dp.zero.rebind_scheduler) was made before it
            # and did not wrap it, and its "lr_scheduler.step() before optimizer.step()" check reads the mark
            # and the flag. Private to torch's lr_scheduler, hence here.
            self._opt_called = True
            return super().step(closure=closure, **kwargs)

        step._wrapped_by_lr_sched = True

        def _broadcast_params_from_rank(self, rank: int):
            if self.parameters_as_bucket_view:
                return super()._broadcast_params_from_rank(rank)
            src = dist.distributed_c10d.get_global_rank(self.process_group, rank)
            return [dist.broadcast(p.to_local() if isinstance(p, DTensor) else p.data, src=src,
                                   group=self.process_group, async_op=True)
                    for group in self._partition_parameters()[rank] for p in group["params"]]

    _ZERO_CLASS = ShardAwareZeroRedundancyOptimizer
    return _ZERO_CLASS


def fsdp_root_init(module) -> None:
    """Make ``module`` (a ``fully_shard``-ed module) the root of its FSDP units now, as its first forward
    would: ``fully_shard.state(module)._lazy_init()``. A pipeline stage's step may enter a block unit before
    (or without) the root's forward, and FSDP makes the first unit to run forward the root."""
    from torch.distributed.fsdp import fully_shard

    fully_shard.state(module)._lazy_init()


def fsdp_finish_backward(module) -> None:
    """Every FSDP unit's post-backward under the root ``module``, by hand after a step's last micro-batch backward,
    as torch's pipelining stage does (each ``_fsdp_param_groups[i].post_backward()``, then the root's
    ``_root_post_backward_final_callback``)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)
    for unit in state._state_ctx.all_states:
        for group in unit._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


# -- torch: pytree, dispatch modes, autograd, process groups ------------------------------------------------
# (plain re-exports: torch.utils._pytree is how torch itself flattens nested containers)
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten  # noqa: E402


def torch_dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: the base class of a mode that sees every op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def current_autograd_node():
    """The autograd node being run (``torch._C._current_autograd_node``): not None inside a backward."""
    return torch._C._current_autograd_node()


def set_pg_timeout(timeout, group) -> None:
    """Set the collective timeout of an existing process ``group`` (``distributed_c10d._set_pg_timeout``):
    ``init_device_mesh`` creates its groups with torch's default timeout."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def resolve_process_group(name: str):
    """The process group a functional collective names by string (``distributed_c10d._resolve_process_group``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def pipelining_backward():
    """``torch.distributed.pipelining._backward``: stage_backward_input / stage_backward_weight (zero bubble's
    split backward). Imported on first use: it pulls in much of torch."""
    from torch.distributed.pipelining import _backward

    return _backward


# -- torch: DTensor's sharding propagation (the internals a sharding rule is written in) ---------------------
def op_dispatcher():
    """DTensor's process-global op dispatcher (``DTensor._op_dispatcher``)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher



@contextlib.contextmanager
def implicit_replication():
    """torch's ``implicit_replication`` (plain tensors meeting DTensors count as replicated), but restoring the
    previous setting on exit, so that it nests (a region inside a region, backward inside a step). Sets the
    dispatcher's ``_allow_implicit_replication``, which torch's context manager sets to ``False`` on exit."""
    from lightning_par import patches

    dispatcher = op_dispatcher()
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    take_out = patches.record("implicit-replication",
                              lambda: setattr(dispatcher, "_allow_implicit_replication", before))
    try:
        yield
    finally:
        take_out()

def sharding_propagator():
    return op_dispatcher().sharding_propagator



def clear_sharding_caches() -> None:
    """Forget the sharding decisions DTensor cached: its Python cache (``propagate_op_sharding.cache_clear``)
    and, where this torch has one, the C++ dispatch fast path's (``torch._C._clear_DTensor_sharding_propagator_cache``)."""
    sharding_propagator().propagate_op_sharding.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()


def propagate_tensor_meta(op_schema):
    """The output tensor meta of ``op_schema``, uncached (``ShardingPropagator._propagate_tensor_meta_non_cached``)."""
    return sharding_propagator()._propagate_tensor_meta_non_cached(op_schema)


def dtensor_spec(t) -> "DTensorSpec":
    """A DTensor's placement spec (``DTensor._spec``), which also carries torch 2.14's shard order."""
    return t._spec


def op_returns(op) -> int:
    """How many values the aten op overload ``op`` returns (``OpOverload._schema.returns``)."""
    return len(op._schema.returns)

# the types and helpers a sharding rule is written in (re-exported)
from torch.distributed.tensor._dtensor_spec import DTensorSpec  # noqa: E402
from torch.distributed.tensor._op_schema import (  # noqa: E402
    OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy)
from torch.distributed.tensor._ops.utils import (  # noqa: E402
    expand_to_full_mesh_op_strategy, generate_redistribute_costs)


def expand_single_dim_strategy():
    """torch 2.14's ``_expand_single_dim_strategy_to_mesh`` (a single-dim strategy as an op strategy), or None
    on a torch without it."""
    try:
        from torch.distributed.tensor._ops.single_dim_strategy import _expand_single_dim_strategy_to_mesh
    except ImportError:
        return None
    return _expand_single_dim_strategy_to_mesh


# -- Lightning ----------------------------------------------------------------------------------------------
def optimizer_to_device(optimizer, device) -> None:
    """``lightning.fabric.utilities.optimizer._optimizer_to_device``: move an optimizer's state tensors."""
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    _optimizer_to_device(optimizer, device)


def optimizers_to_device(optimizers, device) -> None:
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def ddp_ignore(module, names) -> None:
    """Make DDP leave the parameters and buffers ``names`` of ``module`` alone (no broadcast, no reduction), or,
    with ``None``, take the list out again. Sets ``module._ddp_params_and_buffers_to_ignore``, as
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` does."""
    if names is None:
        module.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
    else:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))


def multiprocessing_launcher() -> tuple[type, type]:
    """Lightning's spawn / fork launcher class and the worker output it hands back (``_MultiProcessingLauncher``,
    ``_WorkerOutput``), for a launcher that returns other weights to the caller."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput

    return _MultiProcessingLauncher, _WorkerOutput


def compute_dtype(precision_plugin) -> torch.dtype:
    """The dtype a Lightning precision plugin computes in (``bf16-mixed`` -> bfloat16, ...), whose peak FLOP/s
    ``ThroughputMonitor`` measures MFU against (``throughput_monitor._plugin_to_compute_dtype``)."""
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    return _plugin_to_compute_dtype(precision_plugin)


def rich_available() -> bool:
    from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

    return bool(_RICH_AVAILABLE)


__all__ = ["DTensorSpec", "OpSchema", "OpSpec", "OpStrategy", "RuntimeSchemaInfo", "TupleStrategy",
           "expand_to_full_mesh_op_strategy", "generate_redistribute_costs", "tree_flatten", "tree_map",
           "tree_unflatten"]


# -- Lightning's checkpoint connector (``trainer._checkpoint_connector``), for the fault-tolerant replicas ----------
# A recovering replica takes a live peer's state as a checkpoint resume takes a file: Lightning's own
# ``dump_checkpoint`` on the peer, and its own restore functions here (see lightning_par.strategies._fault_tolerance).

def pending_checkpoint(trainer) -> dict:
    """The checkpoint a run is resuming from, between Lightning's ``resume_start`` and ``resume_end`` ({} else)."""
    return trainer._checkpoint_connector._loaded_checkpoint


def dump_checkpoint(trainer) -> dict:
    """Everything a ``.ckpt`` file holds, in memory (``_CheckpointConnector.dump_checkpoint``)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def restore_module_and_callbacks(trainer, checkpoint: dict) -> None:
    """Make ``checkpoint`` the one being resumed and restore the module, datamodule and callbacks from it now;
    Lightning restores the rest (precision, loops, optimizers, LR schedulers) from it after the strategy's
    ``setup``, in ``restore_training_state``, as for a file given as ``ckpt_path``."""
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    connector.restore_model()
    connector.restore_datamodule()
    connector.restore_callbacks()
def lightning_optimizers(module) -> list:
    """The optimizers the module's ``configure_optimizers`` returns, parsed as Lightning parses them (any of
    its return forms), without installing them anywhere.

    Wraps ``lightning.pytorch.core.optimizer._init_optimizers_and_lr_schedulers`` (private: the parser that
    ``Strategy.setup_optimizers`` calls); callers record from them which parameters each group holds.
    """
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    return _init_optimizers_and_lr_schedulers(module)[0]


def profiler_allocations(prof, marker: str = "") -> tuple[list[tuple[int, int]], list[tuple[int, str]]]:
    """``(time ns, bytes)`` of every allocation (positive) and free (negative) that the torch profiler ``prof``
    (run with ``profile_memory=True``) recorded, in time order, and ``(time ns, name)`` of the
    ``record_function`` ranges whose names start with ``marker`` (on the same clock). Walks
    ``kineto_results.experimental_event_tree()`` (``torch._C._profiler._EventType.Allocation`` events: every
    allocation of c10's allocators, inside an op or not), which is what torch's own ``_memory_profiler`` reads;
    the public ``events()`` folds the allocations made inside an op into that op's totals, where their order is
    lost."""
    kind = torch._C._profiler._EventType.Allocation
    allocations, marks, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == kind:
            allocations.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
        elif marker and e.name.startswith(marker):
            marks.append((e.start_time_ns, e.name[len(marker):]))
        stack.extend(e.children)
    return sorted(allocations), sorted(marks)


# -- nn.Module / Tensor / autograd / torchmetrics internals ------------------------------------------------------
def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage (``Tensor._is_view``)."""
    return t._is_view()


def metric_forward_value(metric):
    """What a torchmetrics ``Metric`` computed on the batch of its last call (``Metric._forward_cache``)."""
    return metric._forward_cache


def scaler_optimizer_state(scaler, optimizer) -> dict:
    """A GradScaler's per-optimizer state (``GradScaler._per_optimizer_states``) of ``optimizer`` (a
    ``LightningOptimizer`` or the optimizer it wraps)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    return scaler._per_optimizer_states[id(inner)]


def apply_to_tensors(module, fn):
    """``Module._apply(fn)``: what ``.to()`` runs on every tensor, without its checks (meta tensors may stay)."""
    return module._apply(fn)


def init_weights_method(module):  # a Hugging Face model's (or the reference GPT's) ``_init_weights``, or None
    method = getattr(module, "_init_weights", None)
    return method if callable(method) else None


def local_tensor(t):  # a DTensor's shard without an autograd op (safe in a pack hook), or ``t``
    return getattr(t, "_local_tensor", t)


def wrapped_optimizer(optimizer):  # the optimizer a wrapper (ZeroRedundancyOptimizer) holds, or ``optimizer``
    return getattr(optimizer, "_optimizer", optimizer)


def child_schedulers(scheduler) -> list:  # what a SequentialLR / ChainedScheduler drives; [] for another
    return list(getattr(scheduler, "_schedulers", None) or [])


def attn_implementation(config):  # a transformers config's ``_attn_implementation``, or None
    return getattr(config, "_attn_implementation", None)


# -- Lightning's trainer internals ---------------------------------------------------------------------------------
def accelerator_connector(trainer):
    """The trainer's ``_AcceleratorConnector`` (``trainer._accelerator_connector``): its flags, e.g.
    ``use_distributed_sampler``, that a strategy reads or sets for one run."""
    return trainer._accelerator_connector


def loop_data_source(loop):
    """A fit / evaluation / predict loop's data source (``loop._data_source``: ``dataloader()``, ``is_defined()``)."""
    return loop._data_source


# -- by concept, in modules of their own ------------------------------------------------------------------------
from lightning_par._compat.attention import (  # noqa: E402, F401  (context parallel)
    hf_attention_function, hf_register_attention, hf_set_attention_implementation, lse_attention,
    lse_attention_backward, lse_attention_supported)
from lightning_par._compat.checkpointing import composable_checkpoint, is_checkpointed  # noqa: E402, F401
from lightning_par._compat.compile import (  # noqa: E402, F401  (compile)
    compile_backends, compile_counters, compile_modes, is_optimized_module, optimized_original,
    register_shared_forward_hooks, reset_compile_counters, user_compiler)
