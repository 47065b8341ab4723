"""Context parallelism: every sequence split over the ranks of a group inside a module's block stack.

- :mod:`~lightning_par.context.sharding`: the load-balanced layout (rank ``i`` holds chunks ``i`` and ``2cp-1-i``),
  cutting and gathering with autograd.
- :mod:`~lightning_par.context.kernel`: attention on one block of keys with its log-sum-exp, and its backward (the
  fallback of the backend's fused kernel).
- :mod:`~lightning_par.context.attention`: attention across the group (all-gather of K/V, or a ring), one
  custom op each, each block pair one call of the backend's fused kernel.
- :mod:`~lightning_par.context.ulysses`: all-to-all over heads around the module's own attention.
- :mod:`~lightning_par.context.probe`: the setup check (what the first block receives and calls).
- :mod:`~lightning_par.context.verify`: the setup check of each kind of block, whole against cp on recorded inputs.
- :mod:`~lightning_par.context.intercept`: the mode that routes ``F.scaled_dot_product_attention`` to it.
- :mod:`~lightning_par.context.apply`: hooks on an unchanged module's blocks that cut what enters them, route
  their attention and gather what leaves the stack.

Lightning-free: a strategy calls :func:`apply_context_parallel` in setup and ``remove()`` in teardown, and
averages the gradients over the group ([Note: gradients under context parallelism]).
"""
from lightning_par.context.apply import (CP_METHODS, ContextParallel, apply_context_parallel,
                                        apply_context_parallel_to_block, check_sdpa)
from lightning_par.context.attention import METHODS, OPS, context_attention
from lightning_par.context.intercept import RouteAttention
from lightning_par.context.sharding import check_divisible, gather, group_positions, local_positions, shard

from lightning_par.context.probe import check_context_parallel
from lightning_par.context.verify import block_kinds, check_context_blocks

__all__ = ["CP_METHODS", "METHODS", "OPS", "ContextParallel", "RouteAttention", "apply_context_parallel",
           "apply_context_parallel_to_block", "block_kinds", "check_context_blocks", "check_context_parallel",
           "check_divisible", "check_sdpa", "context_attention", "gather", "group_positions", "local_positions", "shard"]
