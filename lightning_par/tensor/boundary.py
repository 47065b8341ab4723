"""What crosses a pipeline stage boundary when every stage is tensor-parallel (the hybrid core).

[Note: sequence-sharded stage boundaries]
Without sequence parallelism a block hands the next one a plain tensor that every rank of its
tensor-parallel group holds whole ([Note: activations between tensor-parallel stages] in
strategies/_pipeline_engine.py), and that plain tensor is what travels. Under ``sequence_parallel=True`` the
residual stream between two blocks of the stack is a DTensor sharded on the sequence (``Shard(1)`` over the
``tp`` mesh: :class:`~.parallelize.SequenceBlock`), from the first block's input to the last block's output
([Note: sequence parallel span] in plan.py). A stage boundary lies between two blocks, so:

- the sending stage hands each tensor-parallel rank's own sequence chunk (``to_local()``, 1/tp of the bytes)
  to the rank of the next stage with the same tp (and dp) coordinate; nothing is gathered;
- the receiving rank gets its chunk as a leaf that requires grad and gives the user's code (and so the
  stage's first block) ``DTensor.from_local(chunk, tp_mesh, (Shard(1),))``: exactly what its first block
  received from the block before it on one stage, so the code between blocks sees what it sees there;
- backward runs the same way back: ``from_local``'s backward leaves the chunk's gradient (``Shard(1)``,
  reduce-scattered inside the block where needed) on the leaf, which is sent (1/tp of the bytes again), and
  the sender backpropagates it through ``to_local``, whose backward wraps it as the same shard.

A hidden state that leaves a stage plain under sequence parallelism is split to this rank's chunk first
(no communication), so the receiver's rule holds for every boundary. Other entries of a bundle (outputs
later blocks take, [Note: block flow] in pipeline/flow.py) travel plain: a DTensor there is made full, and
the next region takes it as replicated. :func:`check_sequence_stack` refuses, at setup, a pipelined stack
whose blocks are not all sequence blocks, where a receiving block would get a shard it was not written for.

Under ``loss_parallel=True`` nothing crosses a boundary differently: the head and its vocabulary-sharded
logits live on the last stage, where the user's loss is computed (and backpropagated) inside
``loss_parallel()`` ([Note: loss parallel] in strategies/_spmd_engine.py).
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_par.tensor.parallelize import check_sequence_length, split_sequence, to_plain
from lightning_par.tensor.plan import BLOCK, LAST_BLOCK, TensorPlan

SEQUENCE_DIM = 1  # the residual stream's sequence dimension under sequence parallelism (torch_styles' Shard(1))


class StageBoundary:
    """Encodes the bundle a stage sends (:meth:`outgoing`) and decodes the one it receives (:meth:`incoming`);
    entry 0 is the hidden state (see [Note: sequence-sharded stage boundaries])."""

    def __init__(self, mesh: DeviceMesh, *, sequence_parallel: bool):
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.placements = (Shard(SEQUENCE_DIM),)

    def outgoing(self, bundle: list) -> list:
        """Plain tensors to send, autograd kept: under sequence parallelism the hidden state as this rank's
        sequence chunk; every other DTensor entry made full."""
        out = [to_plain(t) if isinstance(t, DTensor) else t for t in bundle[1:]]
        hidden = bundle[0]
        if self.sequence_parallel and isinstance(hidden, torch.Tensor):
            if not isinstance(hidden, DTensor):
                hidden = split_sequence(hidden, self.mesh, SEQUENCE_DIM, "a pipeline stage boundary")
            elif hidden.placements != self.placements:
                hidden = hidden.redistribute(self.mesh, self.placements)
            hidden = hidden.to_local()
        elif isinstance(hidden, DTensor):
            hidden = to_plain(hidden)
        return [hidden, *out]

    def incoming(self, bundle: list) -> list:
        """What the user's code takes from the received ``bundle`` (its floating entries already leaves):
        under sequence parallelism the hidden chunk as the sequence-sharded DTensor of this rank's tp group."""
        hidden = bundle[0]
        if not self.sequence_parallel or not isinstance(hidden, torch.Tensor):
            return bundle
        return [DTensor.from_local(hidden, self.mesh, self.placements, run_check=False), *bundle[1:]]


def check_sequence_stack(plan: TensorPlan, path: str, count: int, tp_size: int,
                         hidden_shape: tuple[int, ...] | None = None) -> None:
    """``ValueError`` unless every block ``path.i`` (``i < count``) of the pipelined stack is a sequence block of
    ``plan`` (see [Note: sequence-sharded stage boundaries]) and the traced step's hidden state (``hidden_shape``)
    splits over ``tp_size`` ranks; pure, so every rank raises it before any collective (at a step, only the
    first stage would raise, while the others wait for its activation)."""
    if hidden_shape is not None and len(hidden_shape) > SEQUENCE_DIM:
        check_sequence_length(hidden_shape[SEQUENCE_DIM], tp_size, f"`{path}.0` (in the step traced at setup)")
    missing = [f"{path}.{i}" for i in range(count) if plan.styles.get(f"{path}.{i}") not in (BLOCK, LAST_BLOCK)]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:4]) + (f" (and {len(missing) - 4} more)" if len(missing) > 4 else "")
        raise ValueError(
            f"sequence_parallel=True with several pipeline stages: the pipelined blocks {shown} hold no attention / "
            f"MLP pair that sequence parallelism splits, so a stage starting there would receive a sequence-sharded "
            f"hidden state it was not written for. Pass `blocks=` naming the stack whose blocks hold the pairs, or "
            f"use sequence_parallel=False."
        )

