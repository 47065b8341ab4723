"""Storage for a rank's owned meta tensors, and their initialization by the module's own init code.

[Note: initializing a materialized share]
:func:`materialize` gives every owned meta parameter and buffer storage on the device, filled with a
sentinel (NaN; the lowest value of an integer dtype), and :func:`initialize` runs, module by module
(children before parents, as ``nn.Module.apply``), what a plain build would have run: the module's
``reset_parameters()`` (torch's layers), then the ``_init_weights(module)`` of the nearest ancestor that
has one (Hugging Face models, nanoGPT-style modules), each under a seed derived from the run's seed and the
module's name. The values therefore do not depend on the layout: a pipeline stage, a tensor shard, an FSDP
shard and one device that materialize the same meta-built module with the same seed hold the same weights.
A sharded (DTensor) parameter is initialized whole, one module at a time, on a temporary tensor of which
the rank keeps its region: the transient cost is the largest single module's parameters (a Linear, the
embedding), never the model. What still holds the sentinel afterwards was written by no init (a custom
``nn.Parameter(torch.ones(d))`` without ``reset_parameters``, a buffer built on the meta device): the
strategy refuses it by name unless the weights file supplies it, instead of training on garbage. Code in a
module's ``__init__`` beyond ``reset_parameters`` / ``_init_weights`` (the reference GPT's scaled init of its
residual projections) is not replayed: such values differ in scale from a plain build (pass ``weights=``).
"""
from __future__ import annotations

import zlib
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_par._compat import apply_to_tensors, init_weights_method
from lightning_par.materialize.meta import is_meta
from lightning_par.weights.regions import dtensor_region, region_slices


def move_real(module: nn.Module, device: torch.device) -> nn.Module:
    """``module.to(device)`` for the tensors that hold storage; meta tensors stay (``.to`` would refuse them)."""
    return apply_to_tensors(module, lambda t: t if is_meta(t) else t.to(device))


def _sentinel(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return False
    return torch.iinfo(dtype).min


def _filled(shape, dtype, device) -> torch.Tensor:
    return torch.full(tuple(shape), _sentinel(dtype), dtype=dtype, device=device)


def _sentinel_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty_like(t, device=device)
    out.fill_(_sentinel(t.dtype))
    return out


def _entries(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, dict]]:
    """(full name, owning module, attribute, the dict holding it) of every parameter and buffer, tied ones under
    each name."""
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for store in (mod._parameters, mod._buffers):
            for attr, t in store.items():
                if t is not None:
                    yield (f"{mod_name}.{attr}" if mod_name else attr), mod, attr, store


def materialize(module: nn.Module, device: torch.device,
                owned: Optional[Callable[[str], bool]] = None) -> dict[str, torch.Tensor]:
    """Give the meta parameters and buffers of ``module`` that ``owned(name)`` accepts (all when ``None``;
    a tensor tied under several names is asked by its first name, as ``named_parameters`` gives it) storage
    on ``device``, filled
    with a sentinel (see [Note: initializing a materialized share]), and move the tensors that hold storage
    there. A DTensor keeps its placements (its local shard gets the storage). Returns ``{name: tensor}``,
    one name per new tensor. Under FSDP2 each rank holds a shard of every tensor FSDP manages, and FSDP's
    own ``_apply`` path (its ``to_empty``) swaps them; what ``owned`` rejects (a pipeline stage's copies of
    what it does not hold, which FSDP ignores) stays meta.
    """
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        before = {name for name, *_ in _entries(module) if is_meta(getattr_entry(module, name))
                  and (owned is None or owned(name))}
        wanted = {id(getattr_entry(module, name)) for name in before}
        apply_to_tensors(module, lambda t: (_sentinel_like(t, device) if id(t) in wanted else t) if is_meta(t)
                         else t.to(device))
        made, seen = {}, set()
        for name, mod, attr, store in _entries(module):
            if name in before and id(store[attr]) not in seen:
                seen.add(id(store[attr]))
                made[name] = store[attr]
        return made
    first: dict[int, str] = {}
    for name, mod, attr, store in _entries(module):
        first.setdefault(id(store[attr]), name)
    chosen = {i for i, name in first.items() if owned is None or owned(name)}
    chosen &= {id(store[attr]) for _, _, attr, store in _entries(module) if is_meta(store[attr])}
    new: dict[int, torch.Tensor] = {}
    made = {}
    for name, mod, attr, store in _entries(module):
        t = store[attr]
        if id(t) not in chosen:
            continue
        if id(t) not in new:
            new[id(t)] = _storage_for(t, device, parameter=store is mod._parameters)
            made[name] = new[id(t)]
        store[attr] = new[id(t)]
    move_real(module, device)
    return made


def getattr_entry(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    return mod._parameters[attr] if attr in mod._parameters else mod._buffers[attr]


def _storage_for(t: torch.Tensor, device: torch.device, *, parameter: bool) -> torch.Tensor:
    if isinstance(t, DTensor):
        local = _filled(t.to_local().shape, t.dtype, device)
        data = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    else:
        data = _filled(t.shape, t.dtype, device)
    return nn.Parameter(data, requires_grad=t.requires_grad) if parameter else data


def _post_order(module: nn.Module, prefix: str = "", seen: Optional[set] = None) -> Iterator[tuple[str, nn.Module]]:
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    for name, child in module._modules.items():
        if child is not None:
            yield from _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


def module_seed(seed: int, name: str) -> int:
    """The seed of module ``name``'s init: the same on every rank and layout for the same run seed."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def initialize(module: nn.Module, made: dict[str, torch.Tensor], *, seed: int, skip: Iterable[str] = ()) -> list[str]:
    """Initialize the tensors :func:`materialize` made (see [Note: initializing a materialized share]);
    modules whose every made tensor is in ``skip`` (read from a weights file next) are left out. Returns the
    names of made tensors outside ``skip`` that no init wrote."""
    made_ids = {id(t) for t in made.values()}
    skip = set(skip)
    by_module: dict[int, list[tuple[str, str, dict]]] = {}
    for name, mod, attr, store in _entries(module):
        if id(store[attr]) in made_ids:
            by_module.setdefault(id(mod), []).append((name, attr, store))
    providers = _init_providers(module)
    device = next(iter(made.values())).device if made else None
    unwritten: dict[int, bool] = {}  # made DTensor id -> whether its whole temporary kept a sentinel
    whole = None
    for mod_name, mod in _post_order(module):
        entries = by_module.get(id(mod))
        if not entries or all(name in skip for name, _, _ in entries):
            continue
        swapped = []
        for name, attr, store in entries:
            t = store[attr]
            if isinstance(t, DTensor):
                whole = _filled(t.shape, t.dtype, t.to_local().device)
                store[attr] = nn.Parameter(whole, requires_grad=t.requires_grad) if store is mod._parameters else whole
                swapped.append((attr, store, t, whole))
        provider = providers.get(id(mod))
        with torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
            torch.manual_seed(module_seed(seed, mod_name))
            with torch.no_grad():
                reset = getattr(mod, "reset_parameters", None)
                if callable(reset):
                    reset()
                if provider is not None:
                    init_weights_method(provider)(mod)
        with torch.no_grad():
            for attr, store, t, whole in swapped:
                t.to_local().copy_(whole[region_slices(dtensor_region(t))])
                unwritten[id(t)] = sentinel_left(whole)  # asked now: the temporary goes with this module
                store[attr] = t
        swapped = whole = None  # this module's temporaries go before the next module's are made
    left = []
    for name, t in made.items():
        if name in skip:
            continue
        if unwritten.get(id(t), sentinel_left(t.to_local() if isinstance(t, DTensor) else t)):
            left.append(name)
    return left


def sentinel_left(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds :func:`materialize`'s sentinel (any NaN; an integer tensor all at its dtype's
    lowest value; a bool tensor always: its sentinel cannot be told from a value)."""
    if t.dtype == torch.bool:
        return True
    if t.numel() == 0:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).all())


def _init_providers(root: nn.Module) -> dict[int, nn.Module]:
    """For every module, the nearest ancestor with an ``_init_weights(module)`` method (itself excluded)."""
    out: dict[int, nn.Module] = {}

    def walk(mod: nn.Module, nearest: Optional[nn.Module]) -> None:
        if id(mod) in out:
            return
        out[id(mod)] = nearest
        here = mod if init_weights_method(mod) is not None else nearest
        for child in mod._modules.values():
            if child is not None:
                walk(child, here)

    walk(root, None)
    return {k: v for k, v in out.items() if v is not None}
