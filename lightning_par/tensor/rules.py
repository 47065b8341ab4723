"""Adding a case to one of DTensor's sharding strategies without replacing it: the rule answers its own
case and hands every other call to torch's strategy. Used by :mod:`.fused` and :mod:`.attention`."""
from __future__ import annotations

from typing import Callable

from torch.distributed.tensor import DTensor


def wrap_strategy(op, rule: Callable) -> bool:
    """Put ``rule(op_schema)`` (an ``OpStrategy``, or ``None`` for "not mine") in front of ``op``'s strategy;
    ``False`` when this torch keeps ``op``'s strategy elsewhere (then nothing changes: torch's is correct,
    with more communication)."""
    prop = DTensor._op_dispatcher.sharding_propagator
    original = prop.op_strategy_funcs.get(op)
    if original is None or op in getattr(prop, "op_single_dim_strategy_funcs", {}):
        return False

    def strategy(op_schema):
        mine = rule(op_schema)
        return mine if mine is not None else original(op_schema)

    prop.register_op_strategy(op, strategy, prop.op_to_schema_info.get(op))
    prop.propagate_op_sharding.cache_clear()
    return True


def only_spec(strategy):
    """The one placement spec of an argument's strategy on a 1-D mesh, else ``None``."""
    from torch.distributed.tensor._op_schema import OpStrategy

    if isinstance(strategy, OpStrategy) and len(strategy.strategies) == 1:
        spec = strategy.strategies[0].output_spec
        if spec.mesh.ndim == 1:
            return spec
    return None
