"""The steps of the parallelize order (:mod:`lightning_par.parallelize`), each an ``apply_*`` function of the
module, the option group it needs and the process groups, returning what it made. Lightning-free."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_par.compile import Compiled, UserCompile, compile_what, compiler_of
from lightning_par.compile import apply_compile as compile_blocks
from lightning_par.context.apply import apply_context_parallel
from lightning_par.context.loss import LossCheck, check_sharded_loss
from lightning_par.context.probe import check_context_parallel
from lightning_par.context.verify import block_kinds, check_context_blocks
from lightning_par.dp import fsdp
from lightning_par.experts import apply_experts
from lightning_par.experts.apply import leave_experts_out
from lightning_par.experts.layout import check_router_loss
from lightning_par.materialize import has_meta
from lightning_par.options import (BlockOptions, LayoutOptions, MemoryOptions, PipelineOptions, ShardingOptions,
                                   TensorOptions)
from lightning_par.parallelize.values import EngineOptions, Groups, Parallelized, Rank
from lightning_par.pipeline.discovery import check_enough_blocks, find_blocks
from lightning_par.pipeline.ends import first_owner
from lightning_par.pipeline.flow import trace_flow
from lightning_par.pipeline.mailbox import ResultMailbox
from lightning_par.pipeline.partition import partition_blocks, stage_bounds
from lightning_par.pipeline.routing import ResultRouter, confine_metrics
from lightning_par.pipeline.runner import ScheduleRunner, base_seed, rng_fork
from lightning_par.pipeline.shared import SharedParameters
from lightning_par.pipeline.stage import StageRuntime
from lightning_par.pipeline.stand_ins import StandIns
from lightning_par.tensor.boundary import StageBoundary, check_sequence_stack
from lightning_par.tensor.parallelize import parallelize
from lightning_par.tensor.plan import TensorPlan, build_plan
from lightning_par.topology import Topology


# -- 1. block stack and trace ---------------------------------------------------------------------------------
@dataclass
class BlockStack:
    path: str
    container: nn.Module
    flow: Any = None  # pipeline.flow.BlockFlow, or None without a batch to trace
    uses: dict = field(default_factory=dict)  # where the step uses what lies outside the blocks
    step: Any = None  # the traced sample step (its micro-batch), or None
    stand_ins: Optional[StandIns] = None  # a meta-built module's, for the trace


def apply_block_stack(module: nn.Module, stack: BlockOptions, rank: Rank, *, sample: Callable[[nn.Module], Any],
                      stages_per_rank: int = 1) -> BlockStack:
    """The block stack, what flows between its blocks ([Note: block flow] in pipeline/flow.py) and where the step
    uses what lies outside them ([Note: the ends a stage needs] in pipeline/ends.py), traced with stand-ins for a
    meta-built module's parameters ([Note: tracing a meta-built module] in pipeline/stand_ins.py). ``sample``: the
    user's step on one micro-batch, recording the uses of the blocks it is given (None without a batch). A stack
    with fewer blocks than stages is refused first, with the numbers."""
    path, container = find_blocks(module, stack.blocks)
    check_enough_blocks(path, container, rank.topology.pipeline_parallel_size, stages_per_rank)  # before any trace
    stand_ins = StandIns(rank.device) if has_meta(module) else None
    with rng_fork(rank.device, True):  # the batch drawn too: a shuffling sampler seeds from the global RNG
        step = sample(container)
        flow = trace_flow(module, path, container, step, stand_ins) if step is not None else None
    return BlockStack(path=path, container=container, flow=flow, uses=getattr(step, "uses", {}), step=step,
                      stand_ins=stand_ins)


# -- 2. stage split -------------------------------------------------------------------------------------------
@dataclass
class StageSplit:
    counts: list[int]  # blocks per virtual stage
    bounds: list[tuple[int, int]]
    params: list[int]  # per block
    times: Any = None  # balance="time"'s profile (first, blocks, last)
    balance: Any = "params"


def apply_stage_split(stack: BlockStack, pipeline: PipelineOptions, topology: Topology, *,
                      profile: Callable[[nn.Module], Any]) -> StageSplit:
    """Blocks per stage: balanced by parameters, a list, or by profiled time (``balance="time"``: ``profile``)."""
    container = stack.container
    params = [sum(p.numel() for p in b.parameters()) for b in container]
    balance = pipeline.balance if isinstance(pipeline.balance, str) else list(pipeline.balance)
    times = profile(container) if balance == "time" else None
    stages = topology.pipeline_parallel_size * (pipeline.stages_per_rank if topology.pipeline_parallel_size > 1 else 1)
    counts = partition_blocks(len(container), stages, balance=balance,
                              costs=times[1] if times else [float(n) for n in params],
                              first_extra=times[0] if times else 0.0, last_extra=times[2] if times else 0.0)
    bounds = stage_bounds(counts)
    if stack.flow is not None:
        stack.flow.check_stages(stack.path, bounds)
    return StageSplit(counts=counts, bounds=bounds, params=params, times=times, balance=balance)


# -- 3. tensor plan, found ------------------------------------------------------------------------------------
def find_tensor_plan(module: nn.Module, tensor: TensorOptions, topology: Topology,
                     stack: Optional[BlockStack] = None, layout: Optional[LayoutOptions] = None) -> Optional[TensorPlan]:
    """The tensor plan found on the whole module (pure: the same ValueError on every rank); None at tp = 1. Under
    ``sequence_parallel`` a pipeline's stack is checked for sequence-sharded boundaries; with ``layout``'s
    ``expert_parallel_size > 1`` the routed experts are left out of it (a module without experts refused)."""
    tp = topology.tensor_parallel_size
    plan = build_plan(module, tp, tensor.plan, sequence_parallel=tensor.sequence_parallel,
                      loss_parallel=tensor.loss_parallel) if tp > 1 else None
    check_router_loss(module, topology.context_parallel_size)  # a router's aux loss under cp is not one device's
    if layout is not None:  # the routed experts are divided whole over ep instead (step 6)
        plan = leave_experts_out(plan, module, expert_parallel_size=layout.expert_parallel_size,
                                 experts=layout.experts, stack=stack.path if stack is not None else None)
    if plan is not None and stack is not None and tensor.sequence_parallel:  # [Note: sequence-sharded stage boundaries]
        check_sequence_stack(plan, stack.path, len(stack.container), tp,
                             stack.flow.hidden_shape if stack.flow is not None else None)
    return plan


# -- the stage: after every refusal ---------------------------------------------------------------------------
def apply_stage(module: nn.Module, stack: BlockStack, split: StageSplit, rank: Rank, groups: Groups,
                pipeline: PipelineOptions, tensor: TensorOptions, plan: Optional[TensorPlan]) -> StageRuntime:
    """This rank's stage: its chunks' blocks stay, the other stages' become ghosts (every rank has taken rank 0's
    weights before: this is after every check that can refuse)."""
    topo = rank.topology
    pp = topo.pipeline_parallel_size
    ring = topo.group_ranks("pp", rank.rank)
    runtime = StageRuntime(
        container=stack.container, chunks=[(k, *split.bounds[k]) for k in virtual_stages(rank, pipeline)],
        ranks=[ring[k % pp] for k in range(len(split.counts))], device=rank.device, seed=base_seed(), groups=groups.p2p,
        flow=stack.flow,
        boundary=(StageBoundary(groups.mesh["tp"], sequence_parallel=tensor.sequence_parallel)
                  if plan is not None else None),
    )
    runtime.install()
    return runtime


def virtual_stages(rank: Rank, pipeline: PipelineOptions) -> list[int]:
    """This rank's virtual stages: c·p + s is its chunk c (p stages, s its stage)."""
    topo = rank.topology
    pp = topo.pipeline_parallel_size
    v = pipeline.stages_per_rank if pp > 1 else 1
    stage = topo.coordinates(rank.rank)["pp"]
    return [c * pp + stage for c in range(v)]


# -- 4. activation checkpointing: lightning_par.memory.checkpointing.apply_activation_checkpointing -----------------

# -- 5. tensor plan, applied ----------------------------------------------------------------------------------
def apply_tensor_parallel(module: nn.Module, plan: Optional[TensorPlan], tensor: TensorOptions, groups: Groups,
                          *, ghosts: tuple[str, ...] = (), check: bool = False,
                          inputs: Optional[dict] = None) -> Optional[TensorPlan]:
    """``plan`` (without the ``ghosts``, another stage's blocks) applied over the ``tp`` mesh axis; a meta-built
    module is parallelized as meta tensors (each rank makes its shards at placement). Returns the plan applied.
    ``check``: each kind of region is first run sharded and whole on a copy, on ``inputs`` (the regions' recorded
    inputs, :func:`record_setup_inputs`), and one that differs stays replicated ([Note: the setup check] in
    lightning_par/verify.py)."""
    if plan is None:
        return None
    plan = plan.without(list(ghosts)) if ghosts else plan
    parallelize(module, plan, groups.mesh["tp"], sequence_parallel=tensor.sequence_parallel, check=check,
                inputs=inputs)
    return plan


def record_setup_inputs(module: nn.Module, plan: Optional[TensorPlan], sample: Callable[[], Any],
                        device: torch.device) -> Optional[dict]:
    """The inputs of the first region of each kind of ``plan`` in one run of the user's step on one micro-batch
    (``sample()``: that step, drawn here) on the whole module, its buffers and random stream kept ([Note: the setup
    check] in lightning_par/verify.py: a meta-built module's step runs on the meta device, and the check gives
    its inputs seeded values); None where nothing is checked (no plan, no step)."""
    from lightning_par.pipeline.flow import kept_state
    from lightning_par.tensor.probe import probe_targets
    from lightning_par.verify import record_inputs

    if plan is None or not plan.regions():
        return None
    with rng_fork(device, True), kept_state(module):  # the batch drawn too; buffers kept
        step = sample()
        return None if step is None else record_inputs(module, probe_targets(module, plan), step)


# -- 6. expert parallel ---------------------------------------------------------------------------------------
def apply_expert_parallel(module: nn.Module, layout: LayoutOptions, groups: Groups, rank: Rank, *,
                          stage_blocks: Optional[tuple[str, ...]] = None) -> Any:
    """The routed experts of every MoE layer divided whole: over ``expert_parallel_size`` ranks borrowed from dp × cp
    (tokens sent to their experts by all-to-all), or with tensor parallelism alone over the tp group
    (:func:`lightning_par.experts.apply_experts`); None where nothing is divided. After the tensor plan (which
    leaves the experts out: :func:`find_tensor_plan`), before the setup check. ``stage_blocks``: a pipeline stage's
    blocks' names, whose experts it divides (a stage without any: None)."""
    return apply_experts(module, rank.topology, rank.rank, expert_parallel_size=layout.expert_parallel_size,
                         experts=layout.experts, timeout=groups.timeout, tp_group=groups.tp,
                         tp_mesh=groups.mesh["tp"] if groups.tp is not None else None, stage_blocks=stage_blocks)


# -- 7. setup check -------------------------------------------------------------------------------------------
def keep_expert_layers(module: nn.Module, layout: LayoutOptions, sample: Optional[Callable[[], Any]],
                       device: torch.device, tensor_parallel_size: int = 1) -> Optional[tuple[dict, Optional[dict]]]:
    """What step 7 checks expert parallelism on, taken before the experts are divided (and before checkpointing and
    the tensor plan change the module): a whole copy of the first MoE layer of each kind and its inputs in one run
    of ``sample()`` (the user's step on one micro-batch) on the whole module, its buffers and random stream kept
    ([Note: the setup check of an expert-parallel MoE layer] in lightning_par/experts/verify.py). None where
    nothing is checked: nothing divided (``expert_parallel_size=1`` at ``tensor_parallel_size=1``), no step, or a
    meta-built module (no weights to run)."""
    from lightning_par.experts import find_experts
    from lightning_par.experts.verify import keep_moe_layers
    from lightning_par.pipeline.flow import kept_state
    from lightning_par.verify import record_inputs

    divides = layout.expert_parallel_size > 1 or tensor_parallel_size > 1  # step 6 divides the experts
    if not divides or sample is None or has_meta(module):
        return None
    found = find_experts(module, layout.experts)
    if layout.expert_parallel_size == 1:  # over tp alone: the fused containers tp divides (apply_tensor_experts)
        found = [c for c in found if c.kind == "fused" and c.num_experts % tensor_parallel_size == 0]
    kept = keep_moe_layers(module, found)
    if not kept:
        return None
    with rng_fork(device, True), kept_state(module):  # the batch drawn too; buffers kept
        step = sample()
        return kept, (None if step is None else record_inputs(module, list(kept), step))


def apply_setup_check(module: nn.Module, options: EngineOptions, groups: Groups, *, experts: Any = None,
                      kept: Optional[tuple[dict, Optional[dict]]] = None) -> Optional[dict]:
    """The setup check of the rewrites made after the tensor plan, on the eager blocks before compile: expert
    parallelism's MoE layers (``experts``: step 6's :class:`~lightning_par.experts.ExpertParallel`, ``kept``: from
    :func:`keep_expert_layers`), each kind whole against divided over the expert-parallel group, a layer that
    differs refused on every rank alike (collective over that group; [Note: the setup check of an expert-parallel
    MoE layer]). The tensor plan's and context parallel's checks run at their own steps (5 and 1). Returns the
    verdicts by layer, or None where nothing was checked (``verify=False``, nothing kept, no experts divided)."""
    from lightning_par.experts.verify import check_expert_layers

    if not options.verify or kept is None or experts is None:
        return None
    layers, inputs = kept
    return check_expert_layers(layers, inputs, experts)


# -- 8. compile ----------------------------------------------------------------------------------------------
def apply_compile(module: nn.Module, stack: BlockOptions, rank: Rank, *, blocks: Optional[str] = None,
                  user: Optional[UserCompile] = None) -> Compiled:
    """``compile`` (else the compiler of the user's own ``torch.compile``, ``user``, undone at setup) on each block
    of the stacks, in place: after the tensor plan, checkpointing and the setup check, before FSDP / DDP wrap the
    blocks ([Note: the order] in :mod:`lightning_par.compile`); nothing to compile: an empty record."""
    return compile_blocks(module, compiler_of(stack.compile, user.compiler if user is not None else None),
                          blocks=blocks if blocks is not None else stack.blocks, what=compile_what(stack.compile, user),
                          owner=rank.owner)


# -- 9. FSDP --------------------------------------------------------------------------------------------------
def apply_fsdp(module: nn.Module, sharding: ShardingOptions, memory: MemoryOptions, groups: Groups, rank: Rank, *,
               blocks: Optional[list] = None, ignored: Optional[list] = None,
               broadcast: bool = False) -> Optional[list[str]]:
    """FSDP2 over the ``dp`` mesh axis under ``zero_stage`` 2 / 3 (``groups.sharded_replicas``): the units' names, or
    None. ``broadcast``: every rank first takes the first rank's weights (the core has broadcast them already)."""
    if not groups.sharded_replicas:
        return None
    extra = {} if ignored is None else {"ignored": ignored}
    if blocks is not None:
        extra["blocks"] = blocks
    return fsdp.shard_module(module, groups.mesh["dp"], zero_stage=sharding.zero_stage, precision=rank.precision,
                             broadcast=broadcast, offload=memory.offload, **extra)


# -- 10. placement and weights --------------------------------------------------------------------------------
def apply_placement(module: nn.Module, place: Callable, reader: Any, owned: Optional[Callable] = None) -> None:
    """This rank's share: storage for its meta tensors, initialized as the module's own code would, then
    ``weights=`` read into it (``place``: :meth:`lightning_par.materialize.share.ShareLoader.place`)."""
    place(module, reader, owned=owned)


# -- 11. context parallel -------------------------------------------------------------------------------------
def check_context(module: nn.Module, groups: Groups, rank: Rank, *, method: str, blocks: Optional[str],
                  sample: Optional[Callable[[], Any]], verify: bool = False) -> Any:
    """``context_parallel_size > 1``: a module whose blocks make no attention call ``method`` serves, or whose block
    inputs have no sequence dimension to cut, refused by name before any collective ([Note: the setup check of
    context parallelism] in lightning_par/context/probe.py); then, with ``verify``, each kind of block run whole and
    under context parallelism on the step's recorded inputs, and one that differs refused by name on every rank of
    the cp group alike ([Note: the setup check of a context-parallel block] in lightning_par/context/verify.py:
    collective over the cp group; the eager, unsharded blocks). ``sample()``: the user's step on one micro-batch."""
    if groups.cp is None or sample is None or has_meta(module):
        return None
    with rng_fork(rank.device, True):  # the batch drawn too: a shuffling sampler seeds from the global RNG
        seen = check_context_parallel(module, sample(), method=method, blocks=blocks)
    if verify and not is_sharded(module):  # a module an earlier setup sharded was checked then
        check_context_blocks(module, record_block_inputs(module, blocks, sample, rank.device), groups.cp,
                             method=method)
    return seen


def record_block_inputs(module: nn.Module, blocks: Optional[str], sample: Callable[[], Any],
                        device: torch.device) -> Optional[dict]:
    """The inputs of the first block of each class of the stack ``blocks`` in one run of ``sample()`` (the user's
    step on one micro-batch) on the whole module, its buffers and random stream kept; None without a step."""
    from lightning_par.pipeline.flow import kept_state
    from lightning_par.verify import record_inputs

    with rng_fork(device, True), kept_state(module):  # the batch drawn too; buffers kept
        step = sample()
        return None if step is None else record_inputs(module, block_kinds(module, blocks), step)


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def apply_context(module: nn.Module, groups: Groups, *, blocks: Optional[str],
                  runtime: Optional[StageRuntime] = None, method: str = "ring",
                  train_sample: Optional[Callable[[], Any]] = None, device: Optional[torch.device] = None) -> Any:
    """``context_parallel_size > 1``: the stack's blocks run on this rank's piece of every sequence
    (:mod:`lightning_par.context`; a pipeline stage's chunks only, its last send after cp's gather). With one stage
    and ``train_sample()`` (the user's training step on one micro-batch), the step is run gathered and sharded to
    the loss, and the training steps keep the pieces to the loss where both agree ([Note: sharded to the loss]:
    collective over the cp group); without, the stack's output is gathered."""
    if groups.cp is None:
        return None
    ranges = [(lo, hi) for _, lo, hi in runtime.chunks] if runtime is not None else None
    context = apply_context_parallel(module, groups.cp, blocks=blocks, ranges=ranges, method=method)
    if runtime is not None:
        runtime.send_last()  # after cp's gather
    elif train_sample is not None:
        context.loss = check_loss(module, context, train_sample, device)
    return context


def check_loss(module: nn.Module, context: Any, sample: Callable[[], Any], device: torch.device) -> LossCheck:
    """Whether the training step's loss runs on the pieces ([Note: sharded to the loss]): its step drawn once and
    run twice, from the same random state, on the module as it is (sharded, placed)."""
    from lightning_par.pipeline.flow import kept_state

    with rng_fork(device, True):  # the batch drawn too: a shuffling sampler seeds from the global RNG
        step = sample()
    if step is None:
        return LossCheck(sharded=False, why="no training batch at setup to check the loss on")

    def run():
        with rng_fork(device, True), kept_state(module):
            return step(), step.logs
    verdict = check_sharded_loss(run, context, device)
    if fsdp.is_sharded(module):
        fsdp.reshard(module)
    return verdict


# -- 12. schedule ---------------------------------------------------------------------------------------------
@dataclass
class Schedule:
    runner: ScheduleRunner
    shared: SharedParameters


def apply_schedule(module: nn.Module, made: Parallelized, options: EngineOptions, groups: Groups, rank: Rank, *,
                   dp_reduces: bool, replica_average: Optional[Callable] = None) -> Schedule:
    """The schedule runner, the routing of the last stage's results, the gradients that span ranks (the shared
    parameters; ``dp_reduces``: whether their reduction averages over the ``dp`` group too)."""
    topo, rt, stack, split = rank.topology, made.runtime, made.stack, made.split
    pp, stage = topo.pipeline_parallel_size, topo.coordinates(rank.rank)["pp"]
    ring = topo.group_ranks("pp", rank.rank)
    mailbox = (ResultMailbox(ranks=ring, me=rank.rank, group=groups.result, device=rank.device)
               if groups.result is not None else None)
    router = ResultRouter(mailbox=mailbox, is_last=rt.is_last, device=rank.device, dp_group=groups.dp,
                          dp_size=topo.data_parallel_size, pp_group=groups.pp, last_rank=ring[-1])
    runner = ScheduleRunner(rt, router, schedule=options.schedule, stage=stage, num_stages=pp,
                            microbatches=options.microbatches, shards=made.shards)
    shared = SharedParameters(module, [p for p in module.parameters() if p.requires_grad],
                              {id(p) for b in stack.container for p in b.parameters()}, topology=topo,
                              rank=rank.rank, timeout=groups.timeout, dp_group=groups.dp if dp_reduces else None,
                              cp_group=groups.cp, default_owner=first_owner(stack.uses, split.bounds,
                                                                            options.stages_per_rank),
                              experts=made.experts)
    shared.replica_average = replica_average  # a communication hook's (torchft's: use_replica_average)
    confine_metrics(module, is_last=rt.is_last, dp_group=groups.dp)
    return Schedule(runner=runner, shared=shared)


# -- helpers --------------------------------------------------------------------------------------------------
def not_held(module: nn.Module, owned: Callable[[str], bool]) -> set[int]:
    """Ids of the parameters none of whose names ``owned`` accepts (a tied parameter is held under any name)."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {i for i, ns in names.items() if not any(owned(n) for n in ns)}


def sync_rng(device: torch.device) -> None:
    """Every rank continues rank 0's random stream: tensor-parallel peers hold the same replicated activations and
    must draw the same dropout masks on them (different masks would silently train a different model)."""
    cuda = device.type == "cuda"
    state = [torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None]
    torch.distributed.broadcast_object_list(state, src=0, device=device)
    torch.set_rng_state(state[0])
    if cuda:
        torch.cuda.set_rng_state(state[1], device)


