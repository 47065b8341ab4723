"""The parallel layout of a run: how many ways data, pipeline, context and tensor parallelism split the world.

One frozen dataclass validates the sizes once, maps a global rank to its coordinates on the named
mesh axes and builds the ``DeviceMesh`` on demand. Axis order (outermost first) is ``("pp", "dp", "tp")``
as in torchtitan and Megatron: tensor-parallel peers are adjacent ranks (they talk the most), pipeline
stages are the farthest apart. ``order=DP_OUTERMOST`` (``("dp", "pp", "tp")``) puts the data-parallel
replicas farthest apart instead: the seeds' "model parallel inside a machine, data parallel across
machines" (a whole pipeline inside a node, only the gradient all-reduce crossing nodes). ``tp`` is
innermost in both, so a tensor-parallel group shares a node. With ``context_parallel_size > 1`` a ``cp`` axis
(the ranks that share every sequence, :mod:`lightning_par.context`) sits just outside ``tp`` in both orders:
world = dp × pp × cp × tp. At cp = 1 the mesh has no ``cp`` axis (a layout without it is as before).

Example::

    >>> t = Topology.resolve(world_size=4, pipeline_parallel_size=2)
    >>> t
    Topology(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=1)
    >>> t.coordinates(3)
    {'pp': 1, 'dp': 1, 'tp': 0}
    >>> t.group_ranks("pp", rank=1)   # the ranks of rank 1's pipeline, stage order
    [1, 3]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence, Union

from lightning_par import patches

Size = Union[int, Literal["auto"]]

AXES = ("pp", "dp", "tp")  # outermost first: the default order
_NAMES_ORDER = ("data_parallel_size", "pipeline_parallel_size", "context_parallel_size", "tensor_parallel_size")
DP_OUTERMOST = ("dp", "pp", "tp")
ORDERS = {"pp_dp_tp": AXES, "dp_pp_tp": DP_OUTERMOST}


@dataclass(frozen=True)
class Topology:
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    order: tuple = field(default=AXES, repr=False)  # mesh axes, outermost first (AXES or DP_OUTERMOST)
    context_parallel_size: int = 1  # the cp axis, just outside tp (shown only when > 1)

    def __repr__(self) -> str:
        cp = f", context_parallel_size={self.context_parallel_size}" if self.context_parallel_size > 1 else ""
        return (f"Topology(data_parallel_size={self.data_parallel_size}, pipeline_parallel_size="
                f"{self.pipeline_parallel_size}{cp}, tensor_parallel_size={self.tensor_parallel_size})")

    def __post_init__(self) -> None:
        if tuple(self.order) not in ORDERS.values():
            raise ValueError(f"`order={self.order!r}` must be one of {sorted(ORDERS.values())}: tp innermost, "
                             f"pp or dp outermost.")
        object.__setattr__(self, "order", tuple(self.order))
        for name in _NAMES_ORDER:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}={value!r}` must be a positive integer (or 'auto' where allowed).")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def resolve(
        cls,
        world_size: int,
        data_parallel_size: Size = "auto",
        pipeline_parallel_size: Size = 1,
        tensor_parallel_size: Size = 1,
        model_axis: str | None = None,
        order: tuple = AXES,
        named: Sequence[str] = tuple(_NAMES_ORDER),
        fix: str = "`Trainer(devices=..., num_nodes=...)`",
        context_parallel_size: int = 1,
    ) -> "Topology":
        """Fill in ``"auto"`` sizes and check that the product is the world size.

        ``model_axis`` ("pp" or "tp") names the model dimension that takes every device left over when
        it is ``"auto"``; ``data_parallel_size="auto"`` is then world size / (pp × cp × tp). A product that is
        not the world size is a ``ValueError`` naming the sizes in ``named`` (those the caller's strategy
        takes: a preset fixes the others) and ``fix`` (where the device count is set).

        Example::

            >>> Topology.resolve(3, tensor_parallel_size=2, model_axis="tp",
            ...                  named=("tensor_parallel_size", "data_parallel_size"))
            Traceback (most recent call last):
            ...
            ValueError: The sizes `data_parallel_size=auto` (1) and `tensor_parallel_size=2` multiplied (2) should \
equal the world size (3). Change the sizes or the number of devices (`Trainer(devices=..., num_nodes=...)`).
        """
        given = {"data_parallel_size": data_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
                 "context_parallel_size": context_parallel_size, "tensor_parallel_size": tensor_parallel_size}
        check_sizes(context_parallel_size=context_parallel_size)
        if context_parallel_size == "auto":
            raise ValueError("`context_parallel_size='auto'` is not a size: give the number of ranks that share "
                             "every sequence (1: none).")
        cp = context_parallel_size
        sizes = {"dp": data_parallel_size, "pp": pipeline_parallel_size, "tp": tensor_parallel_size}
        check_sizes(**{_NAMES[axis]: value for axis, value in sizes.items()})
        for axis in ("pp", "tp"):
            if sizes[axis] == "auto":
                if axis != model_axis:
                    sizes[axis] = 1
                    continue
                fixed = cp * (sizes["dp"] if sizes["dp"] != "auto" else 1) * (
                    sizes["tp" if axis == "pp" else "pp"] if sizes["tp" if axis == "pp" else "pp"] != "auto" else 1
                )
                sizes[axis] = max(world_size // fixed, 1)
        if sizes["dp"] == "auto":
            sizes["dp"] = max(world_size // (sizes["pp"] * cp * sizes["tp"]), 1)
        topo = cls(sizes["dp"], sizes["pp"], sizes["tp"], order=order, context_parallel_size=cp)
        if topo.world_size != world_size:
            shown = [f"`{n}={given[n]}`" + (f" ({getattr(topo, n)})" if given[n] == "auto" else "")
                     for n in _NAMES_ORDER if n in named and (n != "context_parallel_size" or cp != 1)]
            listed = " and ".join(shown) if len(shown) < 3 else ", ".join(shown[:-1]) + " and " + shown[-1]
            raise ValueError(
                f"The size{'s' if len(shown) > 1 else ''} {listed} multiplied ({topo.world_size}) should equal the "
                f"world size ({world_size}). Change the sizes or the number of devices ({fix})."
            )
        return topo

    # -- queries --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return (self.data_parallel_size * self.pipeline_parallel_size * self.context_parallel_size
                * self.tensor_parallel_size)

    def size(self, axis: str) -> int:
        return {"pp": self.pipeline_parallel_size, "dp": self.data_parallel_size, "tp": self.tensor_parallel_size,
                "cp": self.context_parallel_size}[_check_axis(axis)]

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axes, outermost first: :attr:`order`, with ``cp`` just outside ``tp`` when it is > 1."""
        return self.order if self.context_parallel_size == 1 else (*self.order[:-1], "cp", self.order[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in mesh order (outermost first)."""
        return tuple(self.size(a) for a in self.axes)

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(pp, dp, tp) whatever the order: what a checkpoint records as its layout."""
        return tuple(self.size(a) for a in AXES)  # type: ignore[return-value]

    def coordinates(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks.")
        coords = {}
        for axis in reversed(self.axes):
            coords[axis] = rank % self.size(axis)
            rank //= self.size(axis)
        return {a: coords[a] for a in (*AXES[:-1], "cp", AXES[-1]) if a in self.axes}

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for axis in self.axes:
            rank = rank * self.size(axis) + coords.get(axis, 0)
        return rank

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` only along ``axis``, in axis order."""
        coords = self.coordinates(rank)
        return [self.rank_of(**{**coords, _check_axis(axis): i}) for i in range(self.size(axis))]

    def sampler_kwargs(self, rank: int) -> dict[str, int]:
        """``DistributedSampler`` arguments of ``rank``: only data-parallel replicas split the data; the
        ranks of one pipeline, context- or tensor-parallel group must see the same batch."""
        return {"num_replicas": self.data_parallel_size, "rank": self.coordinates(rank)["dp"]}

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (each rank in exactly one); the order ``new_group`` must see on all ranks."""
        seen, groups = set(), []
        for rank in range(self.world_size):
            group = self.group_ranks(axis, rank)
            if group[0] not in seen:
                seen.add(group[0])
                groups.append(group)
        return groups

    def build_mesh(self, device_type: str, timeout=None):
        """The ``DeviceMesh`` over the world with axes named ``pp``, ``dp``, ``tp`` in :attr:`order` (the
        process group must exist).

        ``timeout`` (a ``timedelta``) bounds every collective of the axis groups too: the mesh creates them
        with torch's default (30 minutes on gloo) whatever the world group's timeout is.
        """
        from torch.distributed.device_mesh import init_device_mesh
        from lightning_par._compat import set_pg_timeout

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.axes)
        if timeout is not None:
            for axis in self.axes:
                set_pg_timeout(timeout, mesh.get_group(axis))
        return mesh


def keep_loader_on_one_process(trainer, world_size: int):
    """On a world of one process, let the ``trainer`` iterate the user's loaders as they are; returns the
    function that undoes this (for the strategy's ``teardown``).

    [Note: one process keeps the user's loader]
    Lightning wraps every loader of a ``DDPStrategy`` (our strategies' base) in a ``DistributedSampler``,
    even for one process: a sequential loader is then shuffled (seed 0) and a shuffled one follows the
    sampler's permutation instead of the torch generator, so a run at size 1 would see other batches than
    plain Lightning on one device. With one process there is nothing to split and no peer to agree with, so
    the strategy turns Lightning's ``use_distributed_sampler`` off for the run: size 1 trains on exactly
    the batches of plain Lightning (``Trainer(devices=1)``), and one config serves a laptop and a node.
    """
    from lightning_par._compat import accelerator_connector

    connector = accelerator_connector(trainer)
    if world_size != 1:
        return lambda: None
    before = connector.use_distributed_sampler
    connector.use_distributed_sampler = False

    def restore() -> None:
        connector.use_distributed_sampler = before

    return patches.record("distributed-sampler", restore)


_NAMES = {"dp": "data_parallel_size", "pp": "pipeline_parallel_size", "tp": "tensor_parallel_size"}


def check_sizes(**sizes: Size) -> None:
    """A ``ValueError`` for a size argument that is neither a positive integer nor ``"auto"``.

    Example::

        >>> check_sizes(tensor_parallel_size=2, data_parallel_size="auto")
        >>> check_sizes(pipeline_parallel_size=0)
        Traceback (most recent call last):
        ...
        ValueError: `pipeline_parallel_size=0` must be a positive integer or 'auto'.
    """
    for name, value in sizes.items():
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}={value!r}` must be a positive integer or 'auto'.")


def _check_axis(axis: str) -> str:
    if axis not in AXES and axis != "cp":
        raise ValueError(f"Unknown mesh axis {axis!r}; the axes are {(*AXES, 'cp')}.")
    return axis
