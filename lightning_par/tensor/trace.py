"""Megatron pairs read from dataflow: which ``nn.Linear`` of a block reads which.

[Note: pairs from dataflow]
The shape rule (:func:`~lightning_par.tensor.plan.find_megatron_pairs`) sees only the ``nn.Linear`` children of
one module and their widths. It cannot tell square projections apart (BERT's ``query``, ``key`` and ``value``
are all ``C → C``, so it took ``value`` for the row-wise partner of ``query`` and ``key``) and it misses a pair
split over sibling modules (BERT's attention output ``attention.output.dense``, its MLP ``intermediate.dense`` →
``output.dense``). So one block of each kind in every block stack (an ``nn.ModuleList`` / ``nn.Sequential`` of
two or more modules of one class) is run on a copy with a small random hidden state, and autograd's graph
says, for every Linear the block calls, which Linears its input was computed from. A column-wise layer reads
the stream: it depends on no Linear of the block but row-wise ones. A row-wise layer depends only on
column-wise layers that all read its output width: ``q, k, v → o``; ``gate, up → down``. Within a traced block
this replaces the shape rule for every Linear the block called (a fused q/k/v the shape rule found keeps its
fused style); a block that cannot be called with hidden states alone (Hugging Face Llama's layers take the
rotary tables) keeps the shape rule. The region each pair runs in is then the smallest module holding both
sides (:func:`~lightning_par.tensor.regions.finalize`), and :mod:`.probe` checks it on the real mesh.

Example::

    >>> import torch
    >>> from torch import nn
    >>> class Attn(nn.Module):          # square q, k, v; the output projection sits in a sibling module
    ...     def __init__(self, d=8):
    ...         super().__init__(); self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
    ...     def forward(self, x):
    ...         return torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), -1) @ self.v(x)
    >>> class Block(nn.Module):
    ...     def __init__(self, d=8):
    ...         super().__init__(); self.attn, self.out = Attn(d), nn.ModuleDict({"dense": nn.Linear(d, d)})
    ...     def forward(self, x):
    ...         return x + self.out["dense"](self.attn(x))
    >>> traced_roles(nn.ModuleList([Block(), Block()]))["0"]
    {'0.attn.q': 'col', '0.attn.k': 'col', '0.attn.v': 'col', '0.out.dense': 'row'}
"""
from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

TRACE_SHAPE = (2, 4)  # batch, sequence of the random hidden state


def traced_roles(module: nn.Module, is_linear=None) -> dict[str, dict[str, str | None]]:
    """``{block: {linear: "col" | "row" | None}}`` for one block of each kind in every block stack of ``module``,
    for every Linear that block called (``None``: in no pair); blocks that could not be run are absent.
    Blocks of the same kind as a traced one get its roles under their own names."""
    from lightning_par.tensor.layers import _is_plain_linear

    is_linear = is_linear or _is_plain_linear
    found: dict[str, dict[str, str | None]] = {}
    kinds: dict[tuple, tuple[str, dict[str, str | None] | None]] = {}  # kind -> (first block, its roles)
    for name, block in _blocks(module):
        prefix = f"{name}."
        kind = (type(block).__qualname__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))
        if kind not in kinds:
            kinds[kind] = (name, _trace(block, is_linear))
        roles = kinds[kind][1]
        if roles is not None:
            found[name] = {prefix + rel: r for rel, r in roles.items()}
    return found


def _blocks(module: nn.Module):
    for name, stack in module.named_modules():
        if isinstance(stack, (nn.ModuleList, nn.Sequential)) and len(stack) >= 2 and len({type(c) for c in stack}) == 1:
            for child_name, child in stack.named_children():
                yield (f"{name}.{child_name}" if name else child_name), child


def _trace(block: nn.Module, is_linear) -> dict[str, str | None] | None:
    """Roles of the Linears ``block`` calls (names relative to it), or ``None`` when it cannot be run."""
    linears = {n: m for n, m in block.named_modules() if is_linear(m)}
    if not linears:
        return None
    first = next(iter(linears.values()))
    width, weight = first.in_features, first.weight
    if weight.device.type == "meta":
        return None
    copied = copy.deepcopy(block).eval()
    by_module = {m: n for n, m in copied.named_modules() if is_linear(m)}
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, input, output) in call order
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((by_module[mod], args[0], out)))
             for m in by_module]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*TRACE_SHAPE, width, generator=g).to(weight.device, weight.dtype).requires_grad_(True)
              for _ in range(required_positional(copied))]
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[weight.device] if weight.device.type == "cuda" else []):
            copied(*inputs)
    except Exception:  # noqa: BLE001 -- a block that needs more than hidden states keeps the shape rule
        return None
    finally:
        for h in hooks:
            h.remove()
    return _roles(calls, linears)


def _roles(calls, linears: dict[str, nn.Module]) -> dict[str, str | None]:
    """Assign col / row from ``calls`` (see [Note: pairs from dataflow])."""
    out_nodes = {}
    for name, _, out in calls:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out_nodes[out.grad_fn] = name
    upstream = {}
    for name, x, _ in calls:
        if name not in upstream:  # a Linear called twice keeps its first call
            upstream[name] = _reaching(x.grad_fn if isinstance(x, torch.Tensor) else None, out_nodes)
    roles: dict[str, str | None] = {}
    for name, ups in upstream.items():
        m = linears[name]
        if all(roles.get(u) == "row" for u in ups):
            roles[name] = "col"
        elif all(roles.get(u) == "col" and linears[u].in_features == m.out_features for u in ups):
            roles[name] = "row"
        else:
            roles[name] = None
    feeds: dict[str, set[str]] = {}
    for name, ups in upstream.items():
        for u in ups:
            feeds.setdefault(u, set()).add(name)
    changed = True
    while changed:  # a column read by anything but row-wise layers, or a row reading a non-column, is no pair
        changed = False
        for name, role in roles.items():
            broken = (role == "col" and (not feeds.get(name) or any(roles.get(c) != "row" for c in feeds[name]))) or \
                     (role == "row" and any(roles.get(u) != "col" for u in upstream[name]))
            if broken:
                roles[name], changed = None, True
    return roles


def _reaching(node, out_nodes: dict) -> set[str]:
    """Names of the Linears whose outputs ``node`` (a grad_fn) was computed from, not looking past them."""
    found, seen, stack = set(), set(), [node]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if n in out_nodes:
            found.add(out_nodes[n])
            continue
        stack.extend(next_fn for next_fn, _ in n.next_functions)
    return found


def required_positional(m: nn.Module) -> int:
    """How many positional inputs ``m.forward`` requires (at least 1)."""
    try:
        params = inspect.signature(m.forward).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return max(1, sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty))
