"""Adding a case to one of DTensor's sharding strategies without replacing it: the rule answers its own
case and hands every other call to torch's strategy. Used by :mod:`.fused` and :mod:`.attention`.

Everything installed in DTensor's (process-global) sharding propagator is recorded with what it replaced,
and :func:`restore_rules` undoes it all, newest first: the tensor-parallel strategy calls it at teardown so
no rule of ours outlives a run."""
from __future__ import annotations

from typing import Callable

from torch.distributed.tensor import DTensor


_undo: list[Callable[[], None]] = []  # newest last


def remember(undo: Callable[[], None]) -> None:
    """Record how to undo one change to DTensor's propagator (or a module flag that goes with it)."""
    _undo.append(undo)


def install_strategy(op, strategy: Callable, schema_info) -> None:
    """Make ``strategy`` DTensor's strategy for ``op`` (with ``schema_info``), remembering the one it replaces."""
    prop = DTensor._op_dispatcher.sharding_propagator
    before = prop.op_strategy_funcs.get(op), prop.op_to_schema_info.get(op)

    def undo():
        for table, value in zip((prop.op_strategy_funcs, prop.op_to_schema_info), before):
            if value is None:
                table.pop(op, None)
            else:
                table[op] = value

    remember(undo)
    prop.register_op_strategy(op, strategy, schema_info)
    prop.propagate_op_sharding.cache_clear()


def restore_rules() -> None:
    """Undo every change recorded by :func:`remember`, newest first."""
    while _undo:
        _undo.pop()()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


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

    install_strategy(op, strategy, prop.op_to_schema_info.get(op))
    return True


def only_spec(strategy):
    """The one placement spec of an argument's strategy on a 1-D mesh, else ``None``."""
    from torch.distributed.tensor._op_schema import OpStrategy

    if isinstance(strategy, OpStrategy) and len(strategy.strategies) == 1:
        spec = strategy.strategies[0].output_spec
        if spec.mesh.ndim == 1:
            return spec
    return None
