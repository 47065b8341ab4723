"""The strategies' layout (sizes resolved and checked, the process groups) and their checks beside the option
groups' (:mod:`lightning_par.options`)."""
from __future__ import annotations

import inspect
from typing import Optional

import torch.distributed as dist

from lightning_par.context.layout import check_context_layout
from lightning_par.experts.layout import check_expert_sizes
from lightning_par.parallelize import Groups
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


def resolve_topology(options, world: int, *, model_axis: Optional[str], order, named) -> Topology:
    """The layout of ``world`` ranks from the core's option groups, checked (the same error on every rank)."""
    topo = Topology.resolve(world, model_axis=model_axis, order=order, named=named, **options.layout.sizes)
    o = options
    check_context_layout(topo.context_parallel_size, pipeline_parallel_size=topo.pipeline_parallel_size,
                         zero_stage=o.sharding.zero_stage, fault_tolerance=o.fault_tolerance.fault_tolerance,
                         sequence_parallel=o.tensor.sequence_parallel, loss_parallel=o.tensor.loss_parallel,
                         schedule=o.pipeline.schedule, stages_per_rank=o.pipeline.stages_per_rank)
    check_expert_sizes(o.layout.expert_parallel_size, data_parallel_size=topo.data_parallel_size,
                       context_parallel_size=topo.context_parallel_size,
                       pipeline_parallel_size=topo.pipeline_parallel_size, pipelined=model_axis == "pp",
                       tensor_parallel_size=topo.tensor_parallel_size)
    return topo


def new_groups(topology: Topology, axis: str, rank: int, timeout):
    """A process group for every group of ranks along ``axis`` (none of one rank); ``rank``'s, or None."""
    mine = None
    for ranks in topology.all_groups(axis):  # same order on every rank, as new_group requires
        if len(ranks) == 1:
            continue
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def build_groups(topo: Topology, rank: int, device_type: str, *, timeout, pipelined: bool, stages_per_rank: int,
                 sharded_replicas: bool) -> Groups:
    """One group per replica set, and with a pipeline per pipeline, point-to-point direction and result
    mailbox; the ``DeviceMesh`` with one stage, several tensor-parallel ranks or FSDP replicas."""
    dp = new_groups(topo, "dp", rank, timeout)
    cp = new_groups(topo, "cp", rank, timeout)  # the ranks sharing every sequence (lightning_par.context)
    pp = result = None
    p2p: tuple = (None, None, None, None)
    if pipelined:
        pp = new_groups(topo, "pp", rank, timeout)
        # activations up, gradients down, and with several chunks per rank the same to a lower / higher
        # rank (the ring wraps around): [Note: one direction per group] in pipeline/p2p.py
        chunks = stages_per_rank if topo.pipeline_parallel_size > 1 else 1
        p2p = tuple(new_groups(topo, "pp", rank, timeout) for _ in range(2 if chunks == 1 else 4))
        result = new_groups(topo, "pp", rank, timeout)  # the last stage's step results: [Note: result mailbox]
    mesh = tp = None
    if topo.tensor_parallel_size > 1 or not pipelined or sharded_replicas:
        mesh = topo.build_mesh(device_type, timeout=timeout)
        tp = mesh["tp"].get_group() if topo.tensor_parallel_size > 1 else None
    return Groups(dp=dp, pp=pp, tp=tp, cp=cp, mesh=mesh, p2p=p2p, result=result, timeout=timeout,
                  sharded_replicas=sharded_replicas)
