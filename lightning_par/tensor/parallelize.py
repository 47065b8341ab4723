"""Apply a :class:`~lightning_par.tensor.plan.TensorPlan` to a module with DTensor ``parallelize_module``.

Style by style (plan name → torch style):

- ``colwise``  → ``ColwiseParallel(use_local_output=False)``: the output stays a DTensor sharded on its
  last dim, so user code that views it with a *stored* head count (``.view(B, T, n_head, hd)``) or with
  ``-1`` is computed on the global shape and stays correct (see :mod:`.attention` for the kernel rule).
- ``fused_colwise`` → :class:`~.fused.FusedColwiseParallel`: a fused q/k/v (or gate/up) split part by part.
- ``rowwise``  → ``RowwiseParallel``: reduces (all-reduce, or reduce-scatter along the sequence under
  sequence parallelism) and hands back a plain tensor.
- ``prepare``  → :class:`PrepareBlockInput` on the parent of a pair ([Note: prepare the block input once]).
- ``sequence`` → ``SequenceParallel`` (norms, under ``sequence_parallel=True``).
- ``sequence_block`` / ``sequence_block_last`` → :class:`SequenceBlock` (under ``sequence_parallel=True``).
- ``vocab_head`` / ``vocab_embedding`` → vocabulary-sharded logits / embedding (``loss_parallel=True``);
  a weight the two share is tied again after sharding.
- ``replicate`` → nothing: parameters stay plain tensors (see :mod:`.mixed` for what that implies).
- an island (``TensorPlan.islands``) → :class:`ReplicatedIsland`: a module left replicated inside a region
  runs on plain tensors (see [Note: one layout per region]).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from lightning_par._compat import implicit_replication, register_shared_forward_hooks
from lightning_par.tensor.attention import SplitAttentionMasks
from lightning_par.tensor.fused import FusedColwiseParallel, register_fused_rules
from lightning_par.tensor.plan import BLOCK, FUSED, LAST_BLOCK, PREPARE, VOCAB_EMBEDDING, VOCAB_HEAD, TensorPlan, under
# torch's styles, which also split transposed linear layers (GPT-2's Conv1D)
from lightning_par.tensor.transposed import ColwiseParallel, RowwiseParallel


class PrepareBlockInput(ParallelStyle):
    """The module's first input becomes a DTensor (``input_layout`` → replicated) once; plain tensors it
    mixes with DTensors inside (masks, rotary tables) count as replicated; DTensor outputs come back as
    plain full tensors, so the code around the module never sees a DTensor.

    ``input_layout=Shard(1)`` (sequence parallel) all-gathers the sequence on entry; its backward is the
    matching reduce-scatter.
    """

    def __init__(self, *, input_layout=None):
        self.input_layout = input_layout or Replicate()
        self.sequence_parallel = self.input_layout != Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout, keep_dtensor = self.input_layout, self.sequence_parallel
        calls: list[tuple[bool, contextlib.ExitStack]] = []  # (nested, context) of each call under way, newest last

        def pre(mod, args, kwargs):
            # a region inside a region hands its outputs on as DTensors (see [Note: one layout per region])
            nested = _has_dtensor(args[:1] or kwargs.get("hidden_states"))
            if args:
                args = (_enter(args[0], device_mesh, layout), *_replicate(args[1:], device_mesh))
                kwargs = _replicate(kwargs, device_mesh)
            else:  # Hugging Face layers are called with keywords: hidden_states=...
                key = "hidden_states" if isinstance(kwargs.get("hidden_states"), torch.Tensor) else next(
                    (k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
                kwargs = {k: (_enter(v, device_mesh, layout) if k == key else _replicate(v, device_mesh))
                          for k, v in kwargs.items()}
            # tensors the module creates itself count as replicated; attention masks follow the heads' split.
            # Traced inside a compiled block, the block's eager call holds them ([Note: a region in a compiled block])
            context = None if torch.compiler.is_compiling() else region_context()
            if context is not None:
                context.__enter__()
            calls.append((nested, context))
            return args, kwargs

        def post(mod, args, kwargs, out):  # always called, also when the forward raises: the context is left
            nested, context = calls.pop()
            if context is not None:
                context.__exit__(None, None, None)
            # under sequence parallelism the output stays a sequence-sharded DTensor for the residual stream
            return out if keep_dtensor or nested else to_plain(out)

        # as a wrapper of forward would: after the module's other pre-hooks, before its other forward hooks; under
        # hook ids every region shares, so that one compiled graph serves every block ([Note: a region in a
        # compiled block] in lightning_par.compile)
        register_shared_forward_hooks(module, "tensor-region", pre, post)
        setattr(module, REGION, True)
        return module


REGION = "_lightning_par_tensor_region"  # the mark of a module PrepareBlockInput made a region


@contextlib.contextmanager
def region_context():
    """What a region's code runs under: implicit replication (tensors the module creates itself count as
    replicated) and :class:`~.attention.SplitAttentionMasks`."""
    with implicit_replication(), SplitAttentionMasks():
        yield


def holds_region(module: nn.Module) -> bool:
    """Whether a region of a tensor plan lies in ``module`` (it, or a module below it)."""
    return any(vars(m).get(REGION, False) for m in module.modules())


class ReplicatedIsland(ParallelStyle):
    """A module left replicated inside a region: called with DTensors, it runs on their full plain tensors
    and hands its tensor outputs back as replicated DTensors; called with plain tensors (from outside any
    region), it is untouched. Its parameters stay plain."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        calls: list[bool] = []  # whether each call under way came with DTensors, newest last

        def pre(mod, args, kwargs):
            inside = _has_dtensor((args, kwargs))
            calls.append(inside)
            return (to_plain(args), to_plain(kwargs)) if inside else None

        def post(mod, args, kwargs, out):
            return _replicate(out, device_mesh) if calls.pop() else None

        # as a wrapper of forward would: after the module's other pre-hooks, before its other forward hooks
        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True, always_call=True, prepend=True)
        return module


@contextlib.contextmanager
def backward_context(*, loss_parallel: bool = False):
    """What a tensor-parallel backward runs under: implicit replication (constants a region's code made are
    replicated, see [Note: one layout per region]) and, with ``loss_parallel``, torch's ``loss_parallel()``."""
    with contextlib.ExitStack() as stack:
        if loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel as _loss_parallel

            stack.enter_context(_loss_parallel())
        stack.enter_context(implicit_replication())
        yield


def _has_dtensor(obj) -> bool:
    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_has_dtensor(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_dtensor(o) for o in obj.values())
    return False


def _enter(x, mesh, layout):
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    # sequence parallel: all-gather the sequence here (its backward is a reduce-scatter)
    return x if x.placements == (Replicate(),) else x.redistribute(mesh, (Replicate(),))


class SequenceBlock(ParallelStyle):
    """A block of the stack under sequence parallelism: a plain full input is split along the sequence (each
    rank keeps its chunk, no communication); the last block of the stack gathers its output back to a plain
    full tensor, so the code after the stack never sees a DTensor."""

    def __init__(self, *, last: bool, sequence_dim: int = 1):
        self.last, self.dim = last, sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim, what = self.dim, type(module).__name__

        def split(x):
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                return x
            return split_sequence(x, device_mesh, dim, what)

        def pre(mod, args, kwargs):
            if args:
                return (split(args[0]), *args[1:]), kwargs
            if isinstance(kwargs.get("hidden_states"), torch.Tensor):
                return args, {**kwargs, "hidden_states": split(kwargs["hidden_states"])}
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)
        if self.last:
            module.register_forward_hook(lambda mod, args, out: to_plain(out))
        return module


def check_sequence_length(length: int, t: int, what: str) -> None:
    if length % t:
        raise ValueError(f"sequence_parallel=True: {what} got a sequence of length {length}, not divisible by "
                         f"tensor_parallel_size={t}. Use a sequence length divisible by {t}, or sequence_parallel=False.")


def split_sequence(x: torch.Tensor, mesh: DeviceMesh, dim: int, what: str) -> DTensor:
    """A plain full ``x`` (the same on every rank of ``mesh``) as a DTensor sharded on ``dim``: each rank keeps
    its chunk, no communication (its backward all-gathers the gradient). ``what`` names the module for the
    error on a length that ``mesh`` does not divide."""
    check_sequence_length(x.shape[dim], mesh.size(), what)
    full = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
    return full.redistribute(mesh, (Shard(dim),))


def _replicate(obj, mesh):
    """Other floating / boolean tensor inputs (masks, rotary tables) become replicated DTensors, so that the
    backward pass, which runs outside this module's call, never mixes them with DTensors either."""
    if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor):
        if obj.is_floating_point() or obj.dtype == torch.bool:
            return DTensor.from_local(obj, mesh, (Replicate(),), run_check=False)
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_replicate(o, mesh) for o in obj)
    if isinstance(obj, list):
        return [_replicate(o, mesh) for o in obj]
    if isinstance(obj, dict):
        return {k: _replicate(v, mesh) for k, v in obj.items()}
    return obj


def to_plain(out):
    """``out`` (nested tuples / lists / dicts) with every DTensor replaced by its full plain tensor; autograd is kept."""
    if isinstance(out, DTensor):
        return out.full_tensor()
    if isinstance(out, tuple):
        return type(out)(to_plain(o) for o in out) if not hasattr(out, "_fields") else type(out)(*map(to_plain, out))
    if isinstance(out, list):
        return [to_plain(o) for o in out]
    if isinstance(out, dict):
        return type(out)((k, to_plain(v)) for k, v in out.items())
    return out


def torch_styles(plan: TensorPlan, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The torch ``ParallelStyle`` of every plan entry (``replicate`` entries have none)."""
    seq = Shard(1)
    out: dict[str, ParallelStyle] = {}
    for name, style in plan.styles.items():
        if style == "colwise":
            out[name] = ColwiseParallel(use_local_output=False)
        elif style == FUSED:
            out[name] = FusedColwiseParallel(plan.parts[name])
        elif style == "rowwise":  # inside a region the output stays a DTensor ([Note: one layout per region])
            out[name] = RowwiseParallel(input_layouts=Shard(-1), output_layouts=seq if sequence_parallel else Replicate(),
                                        use_local_output=not sequence_parallel and plan.region_of(name) is None)
        elif style == PREPARE:
            out[name] = PrepareBlockInput(input_layout=seq if sequence_parallel else Replicate())
        elif style == "sequence":
            if sequence_parallel:
                out[name] = SequenceParallel()
        elif style in (BLOCK, LAST_BLOCK):
            out[name] = SequenceBlock(last=style == LAST_BLOCK)
        elif style == VOCAB_HEAD:  # logits sharded on the vocabulary, for loss_parallel()
            out[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        elif style == VOCAB_EMBEDDING:  # each rank looks up its vocabulary rows, then all-reduce
            out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for name in plan.islands:
        out[name] = ReplicatedIsland()
    return out


def broadcast_state(module: nn.Module, src: int = 0) -> None:
    """Every rank takes global rank ``src``'s parameters and buffers (in place; every rank calls it)."""
    import torch.distributed as dist

    from lightning_par._compat import broadcast_coalesced

    tensors = [t for t in list(module.parameters()) + list(module.buffers())
               if not isinstance(t, DTensor) and not t.is_meta]  # meta: another rank's share, or not yet made
    if tensors:
        with torch.no_grad():
            broadcast_coalesced(dist.group.WORLD, tensors, src)


def register_rules() -> None:
    """The sharding rules our plans need in DTensor's propagator (idempotent; :func:`.rules.restore_rules`
    takes them out again): every setup calls it, also of a module parallelized by an earlier run."""
    from lightning_par.tensor.attention import register_attention_rules

    register_attention_rules()
    register_fused_rules()


def parallelized_size(module: nn.Module) -> int | None:
    """The tensor-parallel size of the mesh an earlier :func:`parallelize` put ``module``'s parameters on (read
    from the module itself: its DTensor parameters on a mesh with a ``"tp"`` axis), or ``None``."""
    for p in module.parameters():
        names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None
        if names and "tp" in names:
            return p.device_mesh.size(names.index("tp"))
    return None


def parallelize(module: nn.Module, plan: TensorPlan, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
                check: bool = True, inputs: dict | None = None) -> nn.Module:
    """Apply ``plan`` in place (parents before children) and return ``module``. With ``check``, every kind of
    region is first tried on a copy (:func:`~lightning_par.tensor.probe.check_regions`); one that fails is
    left replicated with a warning (``plan`` is updated); ``inputs``: the regions' recorded inputs it runs them on
    ([Note: the setup check] in lightning_par/verify.py)."""
    from lightning_par import patches
    from lightning_par.tensor.rules import restore_rules

    ours = "dtensor-rules" not in patches.pending()  # registered by this call, not by a run still going on
    register_rules()
    try:
        return _apply(module, plan, tp_mesh, sequence_parallel, check, inputs)
    except BaseException:
        if ours:  # a refused plan leaves DTensor's process-global tables as they were
            restore_rules()
        raise


def _apply(module: nn.Module, plan: TensorPlan, tp_mesh: DeviceMesh, sequence_parallel: bool,
           check: bool, inputs: dict | None = None) -> nn.Module:
    from lightning_par.tensor.probe import check_regions

    if check:
        check_regions(module, plan, tp_mesh, sequence_parallel=sequence_parallel,
                      inputs=inputs)
    styles = torch_styles(plan, sequence_parallel=sequence_parallel)
    ties = _ties(module, [n for n, s in plan.styles.items() if s in ("colwise", "rowwise", FUSED, VOCAB_HEAD, VOCAB_EMBEDDING)])
    for name, style in styles.items():
        target = module.get_submodule(name) if name else module
        parallelize_module(target, tp_mesh, style)
    for (owner, attr), (src_owner, src_attr) in ties.items():
        # parallelize_module gives every module its own new parameter: re-tie (same layout, see plan)
        a, b = module.get_submodule(owner), module.get_submodule(src_owner)
        pa, pb = getattr(a, attr), getattr(b, src_attr)
        if not (isinstance(pa, DTensor) and isinstance(pb, DTensor) and pa.placements == pb.placements):
            raise ValueError(f"{owner}.{attr} shares its weight with {src_owner}.{src_attr}, but the plan shards "
                             f"them differently; give both the same style or leave both replicated.")
        setattr(a, attr, getattr(b, src_attr))
    _replicate_region_params(module, plan, tp_mesh)
    return module


def _replicate_region_params(module: nn.Module, plan: TensorPlan, mesh: DeviceMesh) -> None:
    """Parameters that a region's own code uses directly (held by the region or by a module in it that is
    neither sharded nor an island) become replicated DTensors ([Note: one layout per region]); a parameter
    shared with a module elsewhere stays as it is (re-tying it would change the other module)."""
    counts: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    sharded = set(plan.sharded()) | {n for n, s in plan.styles.items() if s in (VOCAB_HEAD, VOCAB_EMBEDDING)}
    for name, m in module.named_modules():
        in_region = plan.styles.get(name) == PREPARE or plan.region_of(name) is not None
        if not in_region or name in sharded or name in plan.islands or under(name, plan.islands):
            continue
        for attr, p in list(m.named_parameters(recurse=False)):
            if not isinstance(p, DTensor) and counts[id(p)] == 1:
                m.register_parameter(attr, nn.Parameter(DTensor.from_local(p.data, mesh, (Replicate(),), run_check=False),
                                                        requires_grad=p.requires_grad))


def _ties(module: nn.Module, sharded: list[str]) -> dict[tuple[str, str], tuple[str, str]]:
    """Parameters of sharded modules that are shared with another module: ``{(module, attr): (first owner, attr)}``."""
    first: dict[int, tuple[str, str]] = {}
    ties = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            key = (mod_name, attr)
            if id(p) in first and first[id(p)][0] != mod_name:
                if mod_name in sharded or first[id(p)][0] in sharded:
                    ties[key] = first[id(p)]
            else:
                first.setdefault(id(p), key)
    return ties
