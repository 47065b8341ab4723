"""Private torch APIs of compile (:mod:`lightning_par.compile`; part of :mod:`lightning_par._compat`, which re-exports
them)."""
from __future__ import annotations

import torch


# -- compile (lightning_par.compile) ------------------------------------------------------------------------------
def compile_backends() -> list[str]:
    """Every backend name ``torch.compile`` accepts here, debug ones (``aot_eager``) included: wraps
    ``torch._dynamo.list_backends(exclude_tags=())`` (its default leaves the debug backends out)."""
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


def compile_modes() -> list[str]:
    """The ``mode=`` values ``torch.compile`` accepts: wraps ``torch._inductor.list_mode_options()``."""
    import torch._inductor

    return list(torch._inductor.list_mode_options())


def user_compiler(compiled):
    """The compiler a user's ``torch.compile`` call made, with every keyword they gave (backend, mode, options,
    fullgraph, dynamic): the ``OptimizeContext`` an ``OptimizedModule`` keeps (``dynamo_ctx``), or the one
    Lightning's ``from_compiled`` keeps on the LightningModule (``_compiler_ctx["dynamo_ctx"]``). Called on a
    function it compiles that function as the user's call would have (Lightning's ``from_compiled`` reuses it the
    same way). None where ``compiled`` holds none."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(compiled, OptimizedModule):
        return compiled.dynamo_ctx
    ctx = getattr(compiled, "_compiler_ctx", None)
    return ctx.get("dynamo_ctx") if isinstance(ctx, dict) else None


def is_optimized_module(module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns (``torch._dynamo.OptimizedModule``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def optimized_original(module):
    """The module a ``torch.compile(module)`` wrapper holds (``OptimizedModule._orig_mod``)."""
    return module._orig_mod


_SHARED_HOOK_IDS: dict = {}  # a role's hook id, the same on every module given hooks of that role


def register_shared_forward_hooks(module, role: str, pre, post) -> None:
    """``pre`` as ``register_forward_pre_hook(pre, with_kwargs=True)`` and ``post`` as ``register_forward_hook(post,
    with_kwargs=True, always_call=True, prepend=True)`` would register them, but under hook ids of ``role`` that every
    module given hooks of that role shares (a later registration of the role on a module replaces the earlier).
    Inside a compiled frame dynamo guards on a hook's id (``hook_id in module._forward_hooks_always_called``): with
    ids of their own, each block's hooks fail the guards the first block's graph was traced with, and every block
    compiles a graph of its own. Writes ``nn.Module``'s hook dicts (``_forward_pre_hooks``, ``_forward_hooks`` and
    their ``_with_kwargs`` / ``_always_called`` marks)."""
    from collections import OrderedDict

    from torch.utils.hooks import RemovableHandle

    if role not in _SHARED_HOOK_IDS:
        ids = RemovableHandle.next_id, RemovableHandle.next_id + 1
        RemovableHandle.next_id += 2
        _SHARED_HOOK_IDS[role] = ids
    pre_id, post_id = _SHARED_HOOK_IDS[role]
    module._forward_pre_hooks.pop(pre_id, None)
    module._forward_pre_hooks[pre_id] = pre  # after the module's other pre-hooks
    module._forward_pre_hooks_with_kwargs[pre_id] = True
    others = [(k, v) for k, v in module._forward_hooks.items() if k != post_id]
    module._forward_hooks.clear()
    module._forward_hooks.update(OrderedDict([(post_id, post), *others]))  # before its other forward hooks
    module._forward_hooks_with_kwargs[post_id] = True
    module._forward_hooks_always_called[post_id] = True


def compile_counters() -> dict:
    """dynamo's counts since the last :func:`reset_compile_counters`: ``graphs`` (unique graphs compiled),
    ``frames`` (frames dynamo converted), ``graph_breaks``, ``recompiles`` (compiles of a frame that had compiled
    before: a guard failed) and ``compile_s`` (seconds spent compiling, forward frames and their backward graphs).
    Wraps ``torch._dynamo.utils.counters`` and ``get_compilation_metrics()``."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    metrics = get_compilation_metrics()
    seconds = sum((m.entire_frame_compile_time_s or 0.0) if m.is_forward is not False
                  else (m.backward_cumulative_compile_time_us or 0) / 1e6 for m in metrics)
    return {"graphs": int(counters["stats"]["unique_graphs"]), "frames": int(counters["frames"]["ok"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": sum(1 for m in metrics if m.recompile_reason), "compile_s": round(seconds, 3)}


def reset_compile_counters() -> None:
    from torch._dynamo.utils import clear_compilation_metrics, counters

    counters.clear()
    clear_compilation_metrics()
