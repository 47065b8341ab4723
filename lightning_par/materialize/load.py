"""Reading a weights file into the tensors a rank owns, through :mod:`lightning_par.weights` (each rank reads
its share only: a whole tensor it holds, the region of a DTensor shard or an FSDP chunk)."""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch
from torch import nn

from lightning_par.materialize.meta import is_meta
from lightning_par.weights import WeightsReader, expected_state, open_weights
from lightning_par.weights.sources import TensorInfo


def module_ties(module: nn.Module) -> dict[str, str]:
    """``{name: first name}`` of every parameter the module holds under several names (an lm head tied to
    the embedding): a file that holds one of them serves both."""
    first: dict[int, str] = {}
    ties = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties[name] = first[id(p)]
            ties.setdefault(first[id(p)], name)
        else:
            first[id(p)] = name
    return ties


def assign_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Take the tensors of ``state`` as ``module``'s own (``load_state_dict(assign=True)``, not strict), keeping
    tied parameters tied: a module whose parameters are meta receives storage this way."""
    ties = module_ties(module)
    module.load_state_dict(dict(state), strict=False, assign=True)

    def place(name):
        owner, _, attr = name.rpartition(".")
        return module.get_submodule(owner) if owner else module, attr

    for alias, first in ties.items():  # both directions are listed: the one that received a tensor wins
        (a, a_attr), (f, f_attr) = place(alias), place(first)
        if is_meta(getattr(f, f_attr)) and not is_meta(getattr(a, a_attr)):
            setattr(f, f_attr, getattr(a, a_attr))
        elif getattr(a, a_attr) is not getattr(f, f_attr):
            setattr(a, a_attr, getattr(f, f_attr))


def open_module_weights(path, module: nn.Module, *, prefix: str = "",
                        expected: Optional[Mapping[str, TensorInfo]] = None) -> WeightsReader:
    """Open ``path`` under the module's names (file names gain ``prefix``) and check it against the module's
    whole state dict (``expected``, by default :func:`~lightning_par.weights.expected_state` of ``module``)
    before anything is read: missing, unexpected and mis-shaped names are one ``ValueError`` listing them."""
    from lightning_par.experts.hf_files import fused_view

    expected = expected if expected is not None else expected_state(module)
    # a Hugging Face file's per-expert tensors read as the module's fused experts ([Note: per-expert files read
    # as fused experts] in lightning_par/experts/hf_files.py)
    reader = fused_view(open_weights(path, prefix=prefix, tied=module_ties(module)), expected, module_ties(module))
    try:
        reader.check(expected)
    except ValueError:
        reader.close()
        raise
    return reader


def weight_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state-dict entries this rank holds storage for, one name per tensor (tied ones once)."""
    seen, out = set(), {}
    for name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or is_meta(t) or id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def read_weights(module: nn.Module, reader: WeightsReader, *, names: Optional[Iterable[str]] = None) -> list[str]:
    """Read every owned state-dict entry of ``module`` (or those of ``names``) from ``reader``, in place;
    returns the names read."""
    targets = weight_targets(module)
    wanted = set(targets) if names is None else set(names) & set(targets)
    done = []
    for name, t in targets.items():
        if name in wanted:
            reader.read_into(name, t)
            done.append(name)
    return done
