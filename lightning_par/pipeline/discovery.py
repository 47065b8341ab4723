"""Find the repeated block container of a model: the stack a pipeline cuts into stages.

Example::

    >>> import torch.nn as nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = nn.Embedding(8, 4)
    ...         self.body = nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(4, 4) for _ in range(3))})
    ...         self.heads = nn.ModuleList([nn.Linear(4, 2), nn.ReLU()])
    >>> path, blocks = find_blocks(Net())
    >>> path, len(blocks)
    ('body.layers', 3)
"""
from __future__ import annotations

from torch import nn


def find_blocks(module: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList | nn.Sequential]:
    """The block container named by ``path``, or else the longest ``nn.ModuleList`` / ``nn.Sequential``
    whose children all have one class (at least two of them; the first found wins a tie)."""
    if path is not None:
        try:
            container = module.get_submodule(path)
        except AttributeError:
            raise ValueError(
                f"`blocks={path!r}` names no submodule of {type(module).__name__}. Pass the dotted name of its "
                f"block list, e.g. one of: {_candidates(module) or 'none found'}."
            ) from None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) == 0:
            raise ValueError(
                f"`blocks={path!r}` is a {type(container).__name__}; it must be a non-empty nn.ModuleList or "
                f"nn.Sequential of the model's repeated blocks."
            )
        return path, container
    best: tuple[str, nn.Module] | None = None
    for name, child in module.named_modules():
        if _is_stack(child) and (best is None or len(child) > len(best[1])):
            best = (name, child)
    if best is None:  # a stack of one block (a one-layer model) is still the stack: its size is checked where used
        best = next(((n, c) for n, c in module.named_modules() if isinstance(c, (nn.ModuleList, nn.Sequential))
                     and len(c) == 1 and next(iter(c[0].children()), None) is not None), None)
    if best is None:
        raise ValueError(
            f"No block stack found in {type(module).__name__}: pipeline parallelism needs an nn.ModuleList or "
            f"nn.Sequential of at least two modules of one class (the transformer layers). Name the container "
            f"with `PipelineParallelStrategy(blocks='model.layers')`."
        )
    return best[0], best[1]  # type: ignore[return-value]


def check_enough_blocks(path: str, container: nn.Module, pipeline_parallel_size: int,
                        stages_per_rank: int = 1) -> None:
    """Refuse a block stack with fewer blocks than pipeline stages, naming the stack and the numbers.

    Example::

        >>> check_enough_blocks("blocks", nn.ModuleList([nn.Linear(2, 2)]), 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the block stack `blocks` holds 1 block; pipeline_parallel_size=2 needs at least 2 (2 pipeline ...
    """
    n, stages = len(container), pipeline_parallel_size * stages_per_rank
    if n >= stages:
        return
    per_rank = f" × stages_per_rank={stages_per_rank}" if stages_per_rank > 1 else ""
    raise ValueError(f"the block stack `{path}` holds {n} block{'s' if n != 1 else ''}; pipeline_parallel_size="
                     f"{pipeline_parallel_size}{per_rank} needs at least {stages} ({stages} pipeline stages need at "
                     f"least {stages} blocks, but the block stack has {n}). Use a model with more blocks, or fewer "
                     f"stages (pipeline_parallel_size × stages_per_rank ≤ {n}).")


def _is_stack(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    return len({type(child) for child in module}) == 1


def _candidates(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and n][:5]


def other_stacks(module: nn.Module, path: str) -> list[tuple[str, nn.ModuleList | nn.Sequential]]:
    """Block stacks of ``module`` besides the one at ``path`` (T5's decoder beside its encoder): stacks of
    modules that have submodules of their own (not a list of plain layers), neither inside ``path``, nor
    holding it, nor inside another one listed."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        if name == path or name.startswith(f"{path}.") or path.startswith(f"{name}.") or not _is_stack(child):
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if all(next(iter(b.children()), None) is not None for b in child):
            found.append((name, child))
    return found  # type: ignore[return-value]
