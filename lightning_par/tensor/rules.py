"""Adding a case to one of DTensor's sharding strategies without replacing it: the rule answers its own
case and hands every other call to torch's strategy. Used by :mod:`.fused` and :mod:`.attention`.

Everything installed in DTensor's (process-global) sharding propagator is recorded with what it replaced, as
the patch ``"dtensor-rules"`` of :mod:`lightning_par.patches` (where its reason is given), and
:func:`restore_rules` undoes it all, newest first: the strategy calls it at teardown so no rule of ours
outlives a run."""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from lightning_par import patches
from lightning_par._compat import clear_sharding_caches, expand_single_dim_strategy, sharding_propagator


def remember(undo: Callable[[], None]) -> None:
    """Record how to undo one change to DTensor's propagator (or a module flag that goes with it)."""
    patches.record("dtensor-rules", undo)


_TABLES = ("op_strategy_funcs", "op_to_schema_info", "op_single_dim_strategy_funcs",
           "op_to_schema_info_for_single_dim_strategy")


def _tables(prop) -> tuple[dict, ...]:
    """DTensor's tables that say which strategy serves an op (the single-dim ones exist from torch 2.14 on)."""
    return tuple(getattr(prop, name) for name in _TABLES if hasattr(prop, name))


def _remember_entries(prop, op) -> None:
    """Record ``op``'s entries in every table of :func:`_tables` as they are now."""
    before = [(table, table.get(op)) for table in _tables(prop)]

    def undo():
        for table, value in before:
            if value is None:
                table.pop(op, None)
            else:
                table[op] = value

    remember(undo)


def install_strategy(op, strategy: Callable, schema_info) -> None:
    """Make ``strategy`` DTensor's strategy for ``op`` (with ``schema_info``), remembering the one it replaces."""
    prop = sharding_propagator()
    _remember_entries(prop, op)
    # DTensor consults a single-dim strategy before the op strategy: ours must be the only one
    getattr(prop, "op_single_dim_strategy_funcs", {}).pop(op, None)
    prop.register_op_strategy(op, strategy, schema_info)
    _clear_caches()


def restore_rules() -> None:
    """Undo every change recorded by :func:`remember`, newest first."""
    patches.undo("dtensor-rules")
    _clear_caches()


def _clear_caches() -> None:
    """Forget the sharding decisions DTensor cached: its Python cache, and the C++ dispatch fast path's (which
    would otherwise keep a decision made before a rule was installed, or by one already taken out)."""
    clear_sharding_caches()


def strategy_of(op):
    """What serves ``op`` in DTensor's propagator now, in its lookup order (a single-dim strategy first), or
    ``None`` (then DTensor decomposes the op or fails)."""
    prop = sharding_propagator()
    single = getattr(prop, "op_single_dim_strategy_funcs", {}).get(op)
    return single if single is not None else prop.op_strategy_funcs.get(op)


_warned: set = set()


def wrap_strategy(op, rule: Callable, without: str) -> bool:
    """Put ``rule(op_schema)`` (an ``OpStrategy``, or ``None`` for "not mine") in front of ``op``'s strategy.
    ``False``, with a warning (once per op) naming ``op`` and ``without`` (what not having the rule costs),
    when this torch serves ``op`` in a way it cannot wrap: then nothing changes (torch's strategy is correct,
    with more communication).

    [Note: single-dim strategies]
    From torch 2.14 on, DTensor serves many ops (``cat``, ``split``, the SDPA kernels) with a *single-dim*
    strategy (``op_single_dim_strategy_funcs``: the placements valid on one mesh dim, which DTensor expands to
    the mesh) and consults it before any op strategy. For such an op the wrapper is installed as its op
    strategy, the single-dim entry is taken out (both recorded, so :func:`restore_rules` puts them back),
    and every call the rule leaves goes to torch's single-dim strategy expanded exactly as DTensor's
    propagator expands it (:func:`_expanded_single_dim`)."""
    prop = sharding_propagator()
    single = getattr(prop, "op_single_dim_strategy_funcs", {}).get(op)
    original, schema_info = prop.op_strategy_funcs.get(op), prop.op_to_schema_info.get(op)
    if single is not None:
        original = _expanded_single_dim(prop, op, single)
        schema_info = schema_info or getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}).get(op)
    if original is None:
        cannot_install(op, without, "DTensor has no strategy for it here to add the rule to")
        return False

    def strategy(op_schema):
        mine = rule(op_schema)
        return mine if mine is not None else original(op_schema)

    install_strategy(op, strategy, schema_info)
    return True


def cannot_install(op, without: str, why: str) -> None:
    """Warn (once per op and process) that a rule of ours is not installed for ``op``, and what that costs."""
    if op in _warned:
        return
    _warned.add(op)
    warnings.warn(f"tensor parallel: the sharding rule for {op} is not installed on torch {torch.__version__} "
                  f"({why}): {without}.", stacklevel=3)


def _expanded_single_dim(prop, op, info) -> Callable | None:
    """``op``'s single-dim strategy ``info`` as an op strategy (see [Note: single-dim strategies]), or ``None``
    where this torch lacks the expansion helper."""
    from lightning_par._compat import OpSchema, OpStrategy, TupleStrategy, propagate_tensor_meta

    _expand_single_dim_strategy_to_mesh = expand_single_dim_strategy()
    if _expand_single_dim_strategy_to_mesh is None:
        return None

    def spec(arg):  # DTensor wraps each input spec as a one-choice OpStrategy: take it out again
        if isinstance(arg, OpStrategy):
            return arg.strategies[0].output_spec
        if isinstance(arg, TupleStrategy):
            return [spec(c) for c in arg.children]
        return [spec(a) for a in arg] if isinstance(arg, list) else arg

    def strategy(op_schema):
        specs = OpSchema(op, tuple(spec(a) for a in op_schema.args_schema),
                         {k: spec(v) for k, v in op_schema.kwargs_schema.items()}, schema_info=op_schema.schema_info)
        out_meta = propagate_tensor_meta(specs)
        expand = _expand_single_dim_strategy_to_mesh(op_schema.get_mesh_from_args(validate=False), op_schema, info,
                                                     out_meta)
        return expand(op, op_schema.args_meta, op_schema.kwargs_meta)

    return strategy


def only_spec(strategy):
    """The one placement spec of an argument's strategy on a 1-D mesh, else ``None``."""
    from lightning_par._compat import OpStrategy

    if isinstance(strategy, OpStrategy) and len(strategy.strategies) == 1:
        spec = strategy.strategies[0].output_spec
        if spec.mesh.ndim == 1:
            return spec
    return None
