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


def compile_counters() -> dict[str, int]:
    """dynamo's counts since the last :func:`reset_compile_counters`: ``graphs`` (unique graphs compiled),
    ``frames`` (frames dynamo converted) and ``graph_breaks``. Wraps ``torch._dynamo.utils.counters``."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "frames": int(counters["frames"]["ok"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def reset_compile_counters() -> None:
    from torch._dynamo.utils import counters

    counters.clear()
