"""The weights reader: a weights source seen under the module's parameter names, checked against the
module before anything is read, and read into each rank's share one tensor (one box) at a time.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from safetensors.torch import save_file
    >>> from torch.distributed.tensor import Shard
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> save_file({"proj.weight": torch.arange(12.).reshape(4, 3), "proj.bias": torch.zeros(4)}, path)
    >>> with torch.device("meta"):
    ...     net = nn.Sequential()
    ...     net.add_module("proj", nn.Linear(3, 4))
    >>> reader = open_weights(path, prefix="net.")
    >>> reader.check({f"net.{k}": v for k, v in expected_state(net).items()})   # before any read
    WeightsMatch(missing=(), unexpected=())
    >>> rows = torch.empty(2, 3)                                                 # rank 1 of 2, Shard(0)
    >>> reader.read_into("net.proj.weight", rows, shard_region((4, 3), [Shard(0)], (2,), (1,)))
    tensor([[ 6.,  7.,  8.],
            [ 9., 10., 11.]])
    >>> reader.bytes_read                                                        # half the tensor's 48
    24
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, Mapping, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.weights.regions import Index, as_region, dtensor_region, region_shape
from lightning_par.weights.regions import shard_region  # noqa: F401  (the module docstring's example uses it)
from lightning_par.weights.sources import DEFAULT_BUFFER_BYTES, Source, TensorInfo, open_source

_SHOWN = 10  # names listed per kind of mismatch; the rest are counted


class WeightsMatch(NamedTuple):
    """What :meth:`WeightsReader.check` allowed under ``strict=False``: module names the file lacks, and
    (module-side) names of file tensors the module lacks."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def expected_state(module: nn.Module) -> dict[str, TensorInfo]:
    """The names, shapes and dtypes of ``module.state_dict()`` (build the module on the meta device and
    this costs no memory); a DTensor entry has its full shape."""
    return {name: TensorInfo(tuple(t.shape), t.dtype) for name, t in module.state_dict().items()
            if isinstance(t, torch.Tensor)}


def open_weights(path, *, prefix: str = "", strip_prefix: str = "", tied: Optional[Mapping[str, str]] = None,
                 dcp_root: Optional[str] = "state_dict", buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> "WeightsReader":
    """Open the weights at ``path`` (see :func:`~lightning_par.weights.sources.open_source` for the kinds) and
    list its tensors; nothing but headers, indexes and pickles is read.

    Names: a file name loses ``strip_prefix`` if it starts with it, then gains ``prefix``: with
    ``prefix="net."`` the file's ``model.layers.0.mlp.up_proj.weight`` is the module's
    ``net.model.layers.0.mlp.up_proj.weight``. ``tied`` maps module names to module names
    (``{"lm_head.weight": "model.embed_tokens.weight"}``): a tied name the file lacks reads the entry of the
    one it is tied to (Hugging Face files of tied models hold the embedding only). ``dcp_root``: the entry
    of a DCP directory that holds the weights. ``buffer_bytes`` bounds what one read holds at once.
    """
    return WeightsReader(open_source(path, dcp_root=dcp_root, buffer_bytes=buffer_bytes), prefix=prefix,
                         strip_prefix=strip_prefix, tied=tied)


class WeightsReader:
    """A :class:`~lightning_par.weights.sources.Source` under module names (see :func:`open_weights`)."""

    def __init__(self, source: Source, *, prefix: str = "", strip_prefix: str = "",
                 tied: Optional[Mapping[str, str]] = None):
        self.source = source
        self.prefix, self.strip_prefix = prefix, strip_prefix
        self._file_names: dict[str, str] = {}
        for file_name in source.tensors:
            name = file_name[len(strip_prefix):] if strip_prefix and file_name.startswith(strip_prefix) else file_name
            name = prefix + name
            if name in self._file_names:
                raise ValueError(f"{self.path}: the file's {self._file_names[name]!r} and {file_name!r} both map to "
                                 f"{name!r} under prefix={prefix!r}, strip_prefix={strip_prefix!r}")
            self._file_names[name] = file_name
        self._aliases = set()
        for alias, target in (tied or {}).items():
            if alias not in self._file_names and target in self._file_names:
                self._file_names[alias] = self._file_names[target]
                self._aliases.add(alias)

    @property
    def path(self) -> str:
        return self.source.path

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Module name -> shape and dtype in the file (tied names the file lacks included)."""
        return {name: self.source.tensors[f] for name, f in self._file_names.items()}

    def file_name(self, name: str) -> str:
        """The file's name for the module name ``name``."""
        self._known(name)
        return self._file_names[name]

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor elements read from the files so far (the bytes this package's reads fetched; for a
        torch file or a DCP chunk whose storage offset torch did not report, the bytes of the boxes taken from
        torch's mapping or of the whole chunk)."""
        return self.source.counter.data

    @property
    def overhead_bytes(self) -> int:
        """Bytes of zip directories and pickles read through this package's file views (not the tensors);
        safetensors headers, indexes and DCP ``.metadata`` are read by their libraries and not counted."""
        return self.source.counter.overhead

    def check(self, expected: Mapping[str, object], *, strict: bool = True,
              ignore: Iterable[str] = ()) -> WeightsMatch:
        """Compare the file with the module's ``expected`` names (values: ``(shape, dtype)``, a
        :class:`TensorInfo` or a tensor, e.g. :func:`expected_state`) before anything is read.

        Mis-shaped names (another shape, or a dtype of another kind: floating, integer, bool, complex)
        always raise; missing and unexpected names raise under ``strict``. ``ignore``: ``fnmatch`` patterns
        of module names left out of the comparison (non-persistent buffers an older file holds, tied
        duplicates). The one ``ValueError`` names the path and lists up to 10 names of each kind, with counts.
        """
        patterns = tuple(ignore)

        def kept(name: str) -> bool:
            return not any(fnmatch.fnmatchcase(name, p) for p in patterns)

        want = {name: _info(value) for name, value in expected.items() if kept(name)}
        have = self.tensors
        missing = tuple(n for n in want if n not in have)
        unexpected = tuple(n for n in have if n not in want and n not in self._aliases and kept(n))
        mismatched = tuple(n for n in want if n in have and not _fits(have[n], want[n]))
        if mismatched or (strict and (missing or unexpected)):
            raise ValueError(self._mismatch_message(missing if strict else (), unexpected if strict else (),
                                                    mismatched, have, want))
        return WeightsMatch(missing, unexpected)

    def _mismatch_message(self, missing, unexpected, mismatched, have, want) -> str:
        parts = [f"The weights in {self.path} do not fit the module (file names mapped with "
                 f"prefix={self.prefix!r}, strip_prefix={self.strip_prefix!r}):"]
        if missing:
            parts.append(f"{len(missing)} missing (the module has them, the file does not): {_listed(missing)}")
        if unexpected:
            shown = [n if self._file_names[n] == n else f"{n} (file: {self._file_names[n]})" for n in unexpected]
            parts.append(f"{len(unexpected)} unexpected (the file has them, the module does not): {_listed(shown)}")
        if mismatched:
            shown = [f"{n}: file {have[n].shape} {have[n].dtype}, module {want[n].shape} {want[n].dtype}"
                     for n in mismatched]
            parts.append(f"{len(mismatched)} mis-shaped: {_listed(shown)}")
        hint = _prefix_hint(missing, [self._file_names[n] for n in unexpected])
        parts.append((hint + " " if hint else "") + "Map names with prefix=/strip_prefix=, leave names out with "
                     "ignore=, accept tied weights with tied=, or allow missing and unexpected names with "
                     "strict=False.")
        return "\n  ".join(parts)

    def read_into(self, name: str, target: torch.Tensor, index: Index = None) -> torch.Tensor:
        """Copy the box ``index`` of the file's tensor for the module name ``name`` into ``target`` in place
        (converted to its dtype, on its device) and return ``target``.

        ``index``: ``None`` (the whole tensor), a tuple of slices, ``(dim, start, length)`` or a region (see
        :func:`~lightning_par.weights.regions.shard_region` for a DTensor shard or an FSDP chunk); its shape
        must be ``target``'s. A DTensor ``target`` receives its local shard, the box given by its placements
        unless ``index`` says otherwise. Reads go through a buffer of at most ``buffer_bytes``.
        """
        self._known(name)
        info = self.source.tensors[self._file_names[name]]
        local = target
        if isinstance(target, DTensor):
            if index is None:
                index = dtensor_region(target)
            local = target.to_local()
        if local.device.type == "meta":
            raise ValueError(f"the target for {name!r} is on the meta device: materialize it (e.g. to_empty) "
                             f"before reading weights into it")
        region = as_region(index, info.shape)
        if tuple(local.shape) != region_shape(region):
            raise ValueError(f"{self.path}: the box {region} of {name!r} (file shape {info.shape}) has the shape "
                             f"{region_shape(region)}, the target {tuple(local.shape)}")
        if _kind(info.dtype) != _kind(local.dtype):
            raise ValueError(f"{self.path}: {name!r} is {info.dtype} in the file, the target {local.dtype}; a "
                             f"{_kind(info.dtype)} tensor is not converted to {_kind(local.dtype)}")
        with torch.no_grad():
            self.source.read(self._file_names[name], region, local)
        return target

    def _known(self, name: str) -> None:
        if name not in self._file_names:
            raise ValueError(f"{name!r} is not in the weights {self.path} (file names mapped with "
                             f"prefix={self.prefix!r}, strip_prefix={self.strip_prefix!r}); "
                             f"call check() first to see every difference")

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> "WeightsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _info(value) -> TensorInfo:
    if isinstance(value, torch.Tensor):
        return TensorInfo(tuple(value.shape), value.dtype)
    shape, dtype = value
    return TensorInfo(tuple(int(n) for n in shape), dtype)


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def _fits(have: TensorInfo, want: TensorInfo) -> bool:
    return tuple(have.shape) == tuple(want.shape) and _kind(have.dtype) == _kind(want.dtype)


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _prefix_hint(missing: Sequence[str], unexpected_files: Sequence[str]) -> str:
    """A prefix that turns a file name into a missing module name, if one does (a suggestion, never applied)."""
    for file_name in unexpected_files[:50]:
        for name in missing[:50]:
            if len(name) > len(file_name) and name.endswith(file_name) and name[:-len(file_name)].endswith("."):
                return f"The file's {file_name!r} looks like the module's {name!r}: prefix={name[:-len(file_name)]!r}?"
            if len(file_name) > len(name) and file_name.endswith(name) and file_name[:-len(name)].endswith("."):
                return (f"The file's {file_name!r} looks like the module's {name!r}: "
                        f"strip_prefix={file_name[:-len(name)]!r}?")
    return ""
