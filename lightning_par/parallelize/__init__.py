"""The parallelize order: the steps that turn this rank's copy of an unchanged module into its share of the parallel
model, in the order they are applied (torchtitan's ``parallelize_llama`` shape). Lightning-free: the engines call
:func:`parallelize_pipeline`, :func:`parallelize_spmd` or :func:`parallelize_replicas` with values (the module,
:class:`Rank`, the option groups, :class:`Groups`) and keep what they return; each step is an ``apply_*``
function of its own, unit-testable alone.

The order, one list for the three engines (a step an engine does not take is skipped where it would stand):

 1. block stack and trace  (:func:`apply_block_stack`)         pipeline; one stage: cp's probe and check
                                                                 (:func:`check_context`)
 2. stage split            (:func:`apply_stage_split`)         pipeline
 3. tensor plan, found     (:func:`find_tensor_plan`)          pipeline, SPMD
    -- every refusal above is raised on every rank before any collective; then rank 0's weights go to every rank
    and a pipeline installs this rank's stage (:func:`apply_stage`)
 4. activation checkpointing (:func:`apply_activation_checkpointing`)
 5. tensor plan, applied   (:func:`apply_tensor_parallel`)
 6. expert parallel        (:func:`apply_expert_parallel`)
 7. setup check            (:func:`apply_setup_check`: expert parallel's MoE layers, one of each kind whole against
                            divided, on the eager blocks before compile; the tensor plan's and cp's at 5 and 1)
 8. compile                (:func:`apply_compile`)
 9. FSDP                   (:func:`apply_fsdp`; DataParallelStrategy's DDP at zero_stage 0 / 1 is Lightning's own)
10. placement and weights  (:func:`apply_placement`)
11. context parallel       (:func:`apply_context`)
12. schedule               (:func:`apply_schedule`)                pipeline

[Note: the order of the steps]
Activation checkpointing comes before the tensor plan is applied and before FSDP (its wrapped forward runs
inside FSDP's per-block hooks, and after a pipeline stage's: a block's RNG state is saved after the stage reseeds
it). Context parallelism comes after placement, last of the module's steps: its hooks on the stack's blocks must run
after the stage's, the checkpointing's and FSDP's (hooks run in the order they are registered). torchtitan applies
context parallelism as a context around each step instead, which needs no place in its order.

Adding a step: write ``apply_<thing>(module, options_group, groups, ...) -> what it made`` (Lightning-free), call it
at its number in each ``parallelize_*`` below that takes it (a slot's no-op call marks the place), keep what it
returns on :class:`Parallelized` (a field) and, if it must be undone at teardown, undo it in the engine's
``teardown``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from lightning_par.dp import fsdp
from lightning_par.context.verify import check_context_blocks
from lightning_par.experts.verify import describe_check
from lightning_par.materialize import free_parameters, has_meta
from lightning_par.memory.checkpointing import apply_activation_checkpointing
from lightning_par.parallelize.steps import (BlockStack, Schedule, StageSplit, apply_block_stack, apply_compile,
                                             apply_context, apply_expert_parallel, apply_fsdp, apply_placement,
                                             apply_schedule, apply_setup_check, apply_stage, apply_stage_split,
                                             apply_tensor_parallel, check_context, find_tensor_plan,
                                             keep_expert_layers, not_held,
                                             record_block_inputs, record_setup_inputs, sync_rng,
                                             virtual_stages)
from lightning_par.parallelize.values import EngineOptions, Groups, Parallelized, Rank
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.pipeline.ends import stage_needs
from lightning_par.pipeline.partition import stage_table
from lightning_par.pipeline.stage import Ghost
from lightning_par.tensor.parallelize import broadcast_state


# -- the orders -----------------------------------------------------------------------------------------------
def parallelize_pipeline(module: nn.Module, options: EngineOptions, groups: Groups, rank: Rank, *,
                         sample: Callable, check_step: Callable, profile: Callable, place: Callable, reader: Any,
                         before_split: Optional[Callable] = None, syncs_periodically: bool = False,
                         replica_average: Optional[Callable] = None, check: bool = False,
                         user_compile: Any = None) -> Parallelized:
    """The pipeline engine's order. ``sample`` / ``check_step`` / ``profile``: the user's step run on a micro-batch
    (the trace's, the check of a loss that couples samples, ``balance="time"``); ``before_split``: called once the
    module is known good, before any other stage's blocks go (recording one device's optimizer order); ``check``:
    the setup check (``verify``) runs on the inputs the trace's micro-batch gives this stage's regions;
    ``user_compile``: the user's own ``torch.compile``, undone (:func:`lightning_par.compile.take_user_compile`)."""
    made = Parallelized(full_keys=list(module.state_dict().keys()))
    # 1. block stack and trace
    made.stack = stack = apply_block_stack(module, options.stack, rank, sample=sample,
                                           stages_per_rank=options.stages_per_rank)
    check_step(stack)  # the trace's warnings; [Note: losses that couple samples] in pipeline/coupling.py
    # 2. stage split
    made.split = split = apply_stage_split(stack, options.pipeline, rank.topology, profile=profile)
    # 3. tensor plan, found on the whole module
    plan = find_tensor_plan(module, options.tensor, rank.topology, stack=stack, layout=options.layout)
    if before_split is not None:
        before_split()
    topo = rank.topology
    made.summary = stage_table(split.counts, split.params, split.times, path=stack.path,
                               total_params=sum(p.numel() for p in module.parameters()),
                               replicas=topo.data_parallel_size, schedule=options.schedule, balance=split.balance)
    # -- rank 0's weights everywhere; the setup check's inputs recorded on the whole module (this stage's regions);
    #    this rank's stage installed (other stages' blocks become ghosts)
    if rank.world_size > 1:
        broadcast_state(module, src=0)
    inputs = None
    if check and plan is not None:
        mine = {i for k in virtual_stages(rank, options.pipeline) for i in range(*split.bounds[k])}
        stage_plan = plan.without([f"{stack.path}.{i}" for i in range(len(stack.container)) if i not in mine])
        inputs = record_setup_inputs(module, stage_plan, lambda: stack.step, rank.device)
    if check and groups.cp is not None and stack.step is not None and not has_meta(module):
        # context parallel's blocks checked whole against cp, on the whole stack before the stages are cut
        check_context_blocks(module, record_block_inputs(module, stack.path, lambda: stack.step, rank.device),
                             groups.cp, method=options.context_parallel_method)
    made.runtime = rt = apply_stage(module, stack, split, rank, groups, options.pipeline, options.tensor, plan)
    # 4. activation checkpointing
    made.checkpointed = apply_activation_checkpointing(module, options.activation_checkpointing, blocks=stack.path,
                                                       owner=rank.owner)
    # 5. tensor plan, applied (without the ghosts)
    ghosts = tuple(f"{stack.path}.{i}" for i, block in enumerate(stack.container) if isinstance(block, Ghost))
    made.plan = apply_tensor_parallel(module, plan, options.tensor, groups, ghosts=ghosts, check=check, inputs=inputs)
    if made.plan is not None:
        made.summary += f"\n{topo}\n{made.plan.describe(module)}"
    # 6. expert parallel: this stage's blocks' experts ([Note: expert parallelism inside pipeline stages])
    if options.layout.expert_parallel_size > 1:
        made.experts = apply_expert_parallel(module, options.layout, groups, rank, stage_blocks=tuple(
            f"{stack.path}.{i}" for _, lo, hi in rt.chunks for i in range(lo, hi)))
        if made.experts is not None:
            made.summary += f"\n{made.experts.describe()}"
    # 7. setup check
    apply_setup_check(module, options, groups)
    # 8. compile: this stage's blocks
    made.compiled = apply_compile(module, options.stack, rank, blocks=stack.path, user=user_compile)
    # 9. FSDP over the replicas: this stage's blocks and the ends it needs ([Note: FSDP under pipeline parallelism])
    needs = stage_needs(stack.uses, rt.chunks, len(split.counts))
    prefix = f"{stack.path}."
    owned = lambda n: n.startswith(prefix) or needs(n)  # noqa: E731
    if groups.sharded_replicas:
        free_parameters(module, [n for n, p in module.named_parameters() if id(p) in not_held(module, owned)])
        made.units = apply_fsdp(module, options.sharding, options.memory, groups, rank,
                                ignored=[p for p in module.parameters() if id(p) in not_held(module, owned)],
                                blocks=[(f"{stack.path}.{i}", b) for i, b in enumerate(stack.container)
                                        if not isinstance(b, Ghost)])
    # 10. placement and weights
    apply_placement(module, place, reader, owned=owned)
    if groups.sharded_replicas:
        made.shards = fsdp.StageShards(module)
    rt.weights = [p for p in module.parameters() if p.requires_grad and not p.is_meta]
    # 11. context parallel
    made.context = apply_context(module, groups, blocks=stack.path, runtime=rt, method=options.context_parallel_method)
    # 12. schedule
    made.schedule = apply_schedule(module, made, options, groups, rank, replica_average=replica_average,
                                   dp_reduces=made.shards is None and not syncs_periodically)
    return made


def parallelize_spmd(module: nn.Module, options: EngineOptions, groups: Groups, rank: Rank, *, place: Callable,
                     open_weights: Callable, fresh: bool, sample: Optional[Callable] = None,
                     user_compile: Any = None, before_experts: Optional[Callable] = None,
                     train_sample: Optional[Callable] = None) -> Parallelized:
    """The SPMD engine's order (one stage). ``fresh``: False for a module an earlier setup parallelized (it keeps
    its shards and its weights: only the steps taken out at teardown, and this setup's compile, are applied again).
    ``sample()``: the user's step on one micro-batch (None: nothing to run), which context parallel's probe and the
    setup check (``verify``) run; ``user_compile``: the user's own ``torch.compile``, undone; ``before_experts``:
    called before the experts are divided (recording one device's optimizer order); ``train_sample()``: the user's
    training step on one micro-batch (fit only), which decides whether cp keeps its pieces to the loss."""
    made = Parallelized()
    reader = None
    kept = None
    # 1. the block stack: what context parallelism cannot serve, refused before any collective
    #    and, with verify, each kind of block checked whole against cp (the eager blocks, before anything is sharded)
    check_context(module, groups, rank, method=options.context_parallel_method, blocks=options.blocks, sample=sample,
                  verify=options.verify)
    if fresh:
        # 3. tensor plan, found (pure: the same ValueError on every rank before any collective)
        made.plan = find_tensor_plan(module, options.tensor, rank.topology, layout=options.layout)
        reader = open_weights(module)  # checked against the whole module before anything is sharded
        if rank.world_size > 1:  # every rank starts from rank 0's weights and random stream
            broadcast_state(module, src=0)
            sync_rng(rank.device)
        # with verify, what step 7 checks expert parallelism on: a whole copy of one MoE layer per kind, its inputs
        if options.verify:
            kept = keep_expert_layers(module, options.layout, sample, rank.device,
                                      tensor_parallel_size=rank.topology.tensor_parallel_size)
    # 4. activation checkpointing
    made.checkpointed = apply_activation_checkpointing(module, options.activation_checkpointing,
                                                       blocks=options.blocks, owner=rank.owner)
    if fresh:
        # 5. tensor plan, applied (each kind of region checked first on the step's recorded inputs)
        inputs = (record_setup_inputs(module, made.plan, sample, rank.device)
                  if options.verify and sample is not None else None)
        apply_tensor_parallel(module, made.plan, options.tensor, groups, check=options.verify, inputs=inputs)
        # 6. expert parallel (before it, one device's optimizer order: a rank keeps only its experts)
        if before_experts is not None and options.layout.expert_parallel_size > 1:
            before_experts()
        made.experts = apply_expert_parallel(module, options.layout, groups, rank)
        # 7. setup check: expert parallel's MoE layers whole against divided (collective over the ep / tp group)
        checked = apply_setup_check(module, options, groups, experts=made.experts, kept=kept)
        kept = None  # the copies freed
        if made.experts is not None:
            made.experts.checked = describe_check(checked, options.verify, has_meta(module))
    # 8. compile (on a module an earlier setup parallelized too: this setup's setting)
    if made.experts is not None and (options.stack.compile is not False or user_compile is not None):
        raise ValueError(f"{type(module).__name__}'s routed experts are divided over the tensor-parallel ranks, which "
                         f"compile does not compose with yet (their all-to-alls have data-dependent sizes). Use "
                         f"compile=False (and pass the module uncompiled), or blocks=... naming a stack without "
                         f"experts.")
    made.compiled = apply_compile(module, options.stack, rank, user=user_compile)
    if fresh:
        # 9. FSDP over the replicas ([Note: ZeRO on the core's data axis], meta shards too)
        made.units = apply_fsdp(module, options.sharding, options.memory, groups, rank)
        # 10. placement and weights: a meta-built module's shards get storage, init, weights=
        apply_placement(module, place, reader)
        made.summary = f"{rank.topology}\n{made.plan.describe(module)}" if made.plan is not None else ""
        if made.experts is not None:
            made.summary += f"\n{made.experts.describe()}"
            if made.experts.checked:
                made.summary += f"\n  {made.experts.checked}"
    # 11. context parallel (sharded to the loss where the training step allows it)
    made.context = apply_context(module, groups, blocks=options.blocks, method=options.context_parallel_method,
                                 train_sample=train_sample, device=rank.device)
    if made.context is not None and made.context.loss is not None and fresh:
        made.summary += f"\n{made.context.loss.describe()}"
    return made


def parallelize_replicas(module: nn.Module, options: EngineOptions, groups: Groups, rank: Rank, *,
                         place: Optional[Callable] = None, reader: Any = None, fresh: bool = True,
                         user_compile: Any = None) -> Parallelized:
    """The replica engine's order (DataParallelStrategy: pp = tp = 1). At zero_stage 0 / 1 only step 4 is taken
    here: placement and DDP are Lightning's ``DDPStrategy.setup`` as it is (bit for bit Lightning's DDP); at 2 / 3
    FSDP2 over the ``dp`` axis, then placement into the shards (``fresh``: not sharded by an earlier setup)."""
    made = Parallelized()
    # 4. activation checkpointing, before DDP / FSDP wrap the blocks
    made.checkpointed = apply_activation_checkpointing(module, options.activation_checkpointing,
                                                       blocks=options.blocks, owner=rank.owner)
    # 6. expert parallel: not a DataParallelStrategy option
    # 7. setup check
    apply_setup_check(module, options, groups)
    # 8. compile, before DDP / FSDP wrap the blocks
    made.compiled = apply_compile(module, options.stack, rank, user=user_compile)
    if options.zero_stage < 2:
        return made
    # 9. FSDP over every rank (DataParallelStrategy's groups: sharded_replicas at zero_stage 2 / 3, one device too),
    #    its units the ``blocks=`` stack's
    blocks = None
    if options.blocks is not None:
        path, stack = find_blocks(module, options.blocks)
        blocks = [(f"{path}.{name}", block) for name, block in stack.named_children()]
    made.units = apply_fsdp(module, options.sharding, options.memory, groups, rank, blocks=blocks, broadcast=True)
    # 10. placement and weights: each rank's FSDP shards
    if fresh:
        apply_placement(module, place, reader)
    return made


__all__ = ["BlockStack", "EngineOptions", "Groups", "Parallelized", "Rank", "Schedule", "StageSplit",
           "apply_block_stack", "apply_compile", "apply_context", "apply_expert_parallel", "apply_fsdp",
           "apply_placement", "apply_schedule", "apply_setup_check", "apply_stage", "apply_stage_split",
           "apply_tensor_parallel", "find_tensor_plan", "parallelize_pipeline", "parallelize_replicas",
           "parallelize_spmd"]
