"""A Hugging Face MoE file in the per-expert layout read as the fused tensors the module holds.

[Note: per-expert files read as fused experts]
transformers 5 holds a family's routed experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H,
I]``), while the files on the Hub and those ``save_pretrained`` writes keep one module per expert
(``mlp.experts.3.gate_proj.weight [I, H]``, Mixtral's ``block_sparse_moe.experts.3.w1.weight``); transformers
converts them at load. ``weights=`` reads a file under the module's names, so the strict name check would refuse
such a file. :func:`fused_view` puts a view in front of the file: for each fused expert tensor the module expects
and the file lacks, the per-expert tensors of the same layer (``<layer>.<moe>.experts.<i>.<role>.weight``, role
gate = ``gate_proj`` / ``w1``, up = ``up_proj`` / ``w3``, down = ``down_proj`` / ``w2``, every expert present, shapes
fitting ``[2I, H]`` = gate rows then up rows, and ``[H, I]``) become one virtual tensor, read box by box from the
per-expert tensors it overlaps: a rank holding experts ``[lo, hi)`` reads only theirs. Where the file names the
MoE block otherwise (``block_sparse_moe`` for the module's ``mlp``), the block's other tensors (the router) are
renamed with it, only to names the module expects and the file lacks. Anything that does not fit leaves the
file as it is, and the name check refuses it as before. The gate-then-up row order is transformers' own
(``gate, up = linear(x, gate_up_proj[e]).chunk(2, -1)``); the tests compare with ``from_pretrained``.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

import torch

from lightning_par.weights import WeightsReader
from lightning_par.weights.regions import Region
from lightning_par.weights.sources import Source, TensorInfo

ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
FUSED = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}


class FusedExpertsSource(Source):
    """``inner``'s tensors with per-expert ones replaced by fused virtual tensors (``parts``: virtual name ->
    per expert, the ``(file name, first row)`` of each role in order) and ``renamed`` ones (new -> file name)."""

    def __init__(self, inner: Source, parts: Mapping[str, list[list[tuple[str, int]]]],
                 infos: Mapping[str, TensorInfo], renamed: Mapping[str, str]):
        self.inner, self.parts, self.renamed = inner, dict(parts), dict(renamed)
        self.path, self.buffer_bytes, self.counter, self.kind = inner.path, inner.buffer_bytes, inner.counter, \
            getattr(inner, "kind", "weights")
        used = {f for experts in self.parts.values() for roles in experts for f, _ in roles}
        used |= set(self.renamed.values())
        self.tensors = {n: t for n, t in inner.tensors.items() if n not in used}
        self.tensors.update({new: inner.tensors[old] for new, old in self.renamed.items()})
        self.tensors.update(infos)

    def read(self, name: str, region: Region, out: torch.Tensor) -> None:
        if name in self.renamed:
            return self.inner.read(self.renamed[name], region, out)
        if name not in self.parts:
            return self.inner.read(name, region, out)
        (e0, experts), (r0, rows), cols = region[0], region[1], tuple(region[2:])  # (start, length) pairs
        for e in range(e0, e0 + experts):
            for file_name, first in self.parts[name][e]:
                lo = max(r0, first)
                hi = min(r0 + rows, first + self.inner.tensors[file_name].shape[0])
                if lo < hi:
                    self.inner.read(file_name, ((lo - first, hi - lo), *cols), out[e - e0, lo - r0:hi - r0])

    def close(self) -> None:
        self.inner.close()


def fused_view(reader: WeightsReader, expected: Mapping[str, TensorInfo],
               tied: Optional[Mapping[str, str]] = None) -> WeightsReader:
    """``reader`` itself, or a reader over :class:`FusedExpertsSource` where the file holds per-expert tensors for
    fused expert tensors of ``expected`` (module names) that it lacks ([Note: per-expert files read as fused
    experts])."""
    have = reader.tensors
    missing = [n for n, info in expected.items() if n not in have and n.rsplit(".", 1)[-1] in FUSED
               and len(_info(info).shape) == 3]
    if not missing:
        return reader
    file_of = lambda n: reader.strip_prefix + n[len(reader.prefix):]  # noqa: E731  (module name -> file name)
    source = reader.source
    parts, infos, renamed = {}, {}, {}
    for name in missing:
        if not name.startswith(reader.prefix):
            continue
        container, tensor = name.rsplit(".", 1)
        block, _, experts = container.rpartition(".")
        layer, _, moe = block.rpartition(".")
        if experts != "experts" or not layer:
            continue
        found = _per_expert(source.tensors, file_of(layer))
        if found is None:
            continue
        file_moe, table = found
        info = _info(expected[name])
        got = _fuse(source.tensors, table, FUSED[tensor], info)
        if got is None:
            continue
        parts[file_of(name)], infos[file_of(name)] = got, info
        if file_moe != moe:  # the block's other tensors (its router) under the module's name
            old, new = f"{file_of(layer)}.{file_moe}.", f"{file_of(layer)}.{moe}."
            for f in source.tensors:
                if f.startswith(old) and not f.startswith(f"{old}experts.") and f"{new}{f[len(old):]}" not in \
                        source.tensors and reader.prefix + (new + f[len(old):])[len(reader.strip_prefix):] in expected:
                    renamed[new + f[len(old):]] = f
    if not parts:
        return reader
    return WeightsReader(FusedExpertsSource(source, parts, infos, renamed), prefix=reader.prefix,
                         strip_prefix=reader.strip_prefix, tied=tied)


def _info(value) -> TensorInfo:
    if isinstance(value, torch.Tensor):
        return TensorInfo(tuple(value.shape), value.dtype)
    shape, dtype = value
    return TensorInfo(tuple(int(n) for n in shape), dtype)


def _per_expert(tensors: Mapping[str, TensorInfo], layer: str) -> Optional[tuple[str, dict]]:
    """The one MoE block name under ``layer`` holding per-expert tensors, and ``{(expert, role): file name}``."""
    pattern = re.compile(rf"^{re.escape(layer)}\.([^.]+)\.experts\.(\d+)\.([^.]+)\.weight$")
    blocks, table = set(), {}
    for f in tensors:
        m = pattern.match(f)
        if m and m.group(3) in ROLES:
            blocks.add(m.group(1))
            table[(int(m.group(2)), ROLES[m.group(3)])] = f
    if len(blocks) != 1:
        return None
    return blocks.pop(), table


def _fuse(tensors, table: dict, roles: tuple[str, ...], want: TensorInfo) -> Optional[list[list[tuple[str, int]]]]:
    """Per expert, the ``(file name, first row)`` of each role stacked into one ``want[1:]`` slab; None where the
    experts or shapes do not fit."""
    experts, rows, rest = want.shape
    out = []
    for e in range(experts):
        slab, first = [], 0
        for role in roles:
            f = table.get((e, role))
            if f is None or len(tensors[f].shape) != 2 or tensors[f].shape[1] != rest:
                return None
            slab.append((f, first))
            first += tensors[f].shape[0]
        if first != rows:
            return None
        out.append(slab)
    if any(table_e >= experts for table_e, _ in table):
        return None
    return out
