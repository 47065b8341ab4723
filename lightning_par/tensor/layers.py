"""What a layer is, for a tensor-parallel plan: linear layers (plain and transposed), norms, attention head
counts, and the checks that a style fits a layer at a tensor-parallel size (each error names the module, the
value and the fix). Pure: no process group, no DTensor."""
from __future__ import annotations

import torch
from torch import nn

# Attribute names under which attention modules store head counts (own attributes or ``config``).
_HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "nhead", "num_attention_heads")
_KV_HEAD_ATTRS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")


def _is_plain_linear(m: nn.Module) -> bool:
    # nn.Linear subclasses that only rename the class (e.g. NonDynamicallyQuantizableLinear) still count.
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def is_transposed_linear(m: nn.Module) -> bool:
    """A linear layer that stores its weight transposed, ``[in, out]``, and computes ``x @ weight + bias``:
    Hugging Face's ``Conv1D`` (``transformers.pytorch_utils``; GPT-2, OpenAI GPT).

    [Note: transposed linear layers]
    Recognised by duck typing, so that the package never imports transformers: a module without children
    whose parameters are a 2-D ``weight`` ``[nx, nf]`` and an optional ``bias`` ``[nf]``, that either
    stores ``nf`` (``Conv1D(nf, nx)`` keeps ``self.nf``) or is a class named ``Conv1D`` (torch's real
    convolution is ``nn.Conv1d``, with a 3-D weight). Its output features are the weight's dim 1, so the
    column-wise split is ``Shard(1)`` of the weight and ``Shard(0)`` of the bias, the row-wise split
    ``Shard(0)`` of the weight with the bias replicated (:mod:`.transposed`); the plan treats it as an
    ``nn.Linear(nx, nf)`` otherwise.

    Example::

        >>> import torch
        >>> class Conv1D(nn.Module):  # transformers.pytorch_utils.Conv1D, reduced to its parameters
        ...     def __init__(self, nf, nx):
        ...         super().__init__(); self.nf = nf
        ...         self.weight, self.bias = nn.Parameter(torch.zeros(nx, nf)), nn.Parameter(torch.zeros(nf))
        >>> is_transposed_linear(Conv1D(24, 8)), linear_features(Conv1D(24, 8))
        (True, (8, 24))
        >>> is_transposed_linear(nn.Linear(8, 24)), is_transposed_linear(nn.Conv1d(8, 24, 1))
        (False, False)
    """
    if isinstance(m, (nn.Linear, nn.Embedding)) or next(m.children(), None) is not None:
        return False
    weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return False
    nf = getattr(m, "nf", None)
    if not (isinstance(nf, int) and nf == weight.shape[1]) and type(m).__name__ != "Conv1D":
        return False
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[1],)):
        return False
    return {n for n, _ in m.named_parameters(recurse=False)} <= {"weight", "bias"}


def linear_features(m: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a plain ``nn.Linear`` or a transposed linear layer
    (:func:`is_transposed_linear`); ``None`` for anything else."""
    if _is_plain_linear(m):
        return m.in_features, m.out_features
    if is_transposed_linear(m):
        nx, nf = m.weight.shape
        return int(nx), int(nf)
    return None


def multihead_attention_modules(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)]

def is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith(("LayerNorm", "RMSNorm"))


def _check_shardable(name: str, m: nn.Module, style: str, t: int) -> None:
    features = linear_features(m) if not isinstance(m, nn.Linear) else (m.in_features, m.out_features)
    if features is not None:
        dim, what = (features[1], "out_features") if style == "colwise" else (features[0], "in_features")
    elif isinstance(m, nn.Embedding):
        dim, what = (m.embedding_dim, "embedding_dim") if style == "colwise" else (m.num_embeddings, "num_embeddings")
    else:
        raise ValueError(f"plan entry {name!r}: style {style!r} applies to nn.Linear (or a transposed linear such "
                         f"as Hugging Face's Conv1D) or nn.Embedding, not {type(m).__name__}. Give it 'replicate' "
                         f"(or 'sequence' for a norm) instead.")
    if dim % t:
        raise ValueError(f"module {name!r} ({type(m).__name__}) has {what}={dim}, which is not divisible by "
                         f"tensor_parallel_size={t}; {style} sharding needs it to be. Choose a tensor_parallel_size "
                         f"that divides {dim}, or map {name!r} to 'replicate' in `plan`.")


def _check_fused(name: str, m: nn.Module, parts: int, t: int) -> None:
    out_features = linear_features(m)[1]
    width = out_features // parts
    if width % t:
        raise ValueError(f"module {name!r} fuses {parts} projections of width {width} (out_features="
                         f"{out_features}); each is split across ranks, so {width} must be divisible by "
                         f"tensor_parallel_size={t}. Choose a tensor_parallel_size that divides {width}, or map "
                         f"{name!r} and its output projection to 'replicate' in `plan`.")


def head_counts(m: nn.Module) -> dict[str, int]:
    """Head counts a module stores as attributes or in its ``config`` (attention modules)."""
    found = {}
    for owner in (m, getattr(m, "config", None)):
        if owner is None:
            continue
        for attr in _HEAD_ATTRS + _KV_HEAD_ATTRS:
            v = getattr(owner, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and attr not in found:
                found[attr] = v
    return found


def query_heads(m: nn.Module) -> int | None:
    """The query-head count ``m`` stores (see :func:`head_counts`), or ``None``."""
    counts = head_counts(m)
    return next((counts[a] for a in _HEAD_ATTRS if counts.get(a, 0) > 0), None)


def _check_heads(name: str, m: nn.Module, t: int) -> None:
    for attr, n in head_counts(m).items():
        if n % t:
            raise ValueError(f"module {name!r} ({type(m).__name__}) has {attr}={n}, which is not divisible by "
                             f"tensor_parallel_size={t}: attention heads are split across tensor-parallel ranks. "
                             f"Choose a tensor_parallel_size that divides {n}, or map the module's projections to "
                             f"'replicate' in `plan`.")
