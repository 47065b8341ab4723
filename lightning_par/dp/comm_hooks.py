"""DDP communication hooks by name: validation, selection, and a bf16 compression hook for CPU builds.

A hook decides how DDP reduces one gradient bucket. ``None`` keeps DDP's built-in all-reduce (in C++,
the fastest on every backend); ``"fp16"`` and ``"bf16"`` halve the bytes on the wire by casting the
bucket to 16 bits; ``"powersgd"`` sends a rank-``r`` factorisation of each gradient matrix.

[Note: bf16 hook on CPU]
``DistributedDataParallel.register_comm_hook`` refuses torch's ``bf16_compress_hook`` *by its name*
unless CUDA + NCCL >= 2.10 (or XCCL) are present, although gloo reduces bf16 tensors fine. On such
builds we register :func:`bf16_compress_hook_gloo` instead: the same compression written here under
another name. It casts the bucket to bf16, sums it over the group, and in the callback divides by the
group size in fp32 while casting back into the bucket (dividing after the sum, in fp32, costs no
precision; the sum of bf16 values cannot overflow where fp32 would not). Where torch accepts its own
hook we use torch's. (No ``from __future__ import annotations`` in this module: DDP checks a hook's
annotations as objects.)

[Note: PowerSGD on gloo]
torch's PowerSGD hook issues its second and third all-reduce (of the P and Q factors) from the
callbacks of the first one's future. On gloo those callbacks run on gloo's own threads as soon as a
collective completes, while the backward thread goes on launching the next bucket's first
all-reduce, so with more than one bucket the ranks can issue collectives in different orders; gloo
then aborts ("Received data size doesn't match expected size") or hangs. Where the backend is not
NCCL we therefore register :func:`serialized_hook`: before a bucket's hook starts, it waits for the
previous bucket's future, so every rank issues every bucket's collectives in bucket order. This
gives up overlapping one bucket's PowerSGD with the next bucket's gradients (not with the backward
pass itself: the hook of bucket k+1 runs when its gradients are ready). fp16/bf16 hooks only cast in
their callbacks and need no such care.
"""
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

COMM_HOOKS = (None, "fp16", "bf16", "powersgd")


def validate_comm_hook(comm_hook: str | None, powersgd_rank: int, powersgd_start_iter: int) -> None:
    """Raise ``ValueError`` for a hook name or PowerSGD setting that cannot work.

    Example:
        >>> validate_comm_hook("fp16", 1, 1000)
        >>> validate_comm_hook("int8", 1, 1000)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `comm_hook='int8'` is not a known DDP communication hook. Choose one of None, 'fp16', ...
    """
    if comm_hook not in COMM_HOOKS:
        choices = ", ".join(repr(h) for h in COMM_HOOKS)
        raise ValueError(f"`comm_hook={comm_hook!r}` is not a known DDP communication hook. "
                         f"Choose one of {choices} (None = DDP's own all-reduce).")
    if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int) or powersgd_rank < 1:
        raise ValueError(f"`powersgd_rank={powersgd_rank!r}` must be an integer >= 1 (the rank of PowerSGD's "
                         f"low-rank gradient approximation; 1-4 is typical).")
    if isinstance(powersgd_start_iter, bool) or not isinstance(powersgd_start_iter, int) or powersgd_start_iter < 2:
        raise ValueError(f"`powersgd_start_iter={powersgd_start_iter!r}` must be an integer >= 2: DDP rebuilds its "
                         f"buckets after the first iteration, so PowerSGD (with error feedback) can start at "
                         f"iteration 2 at the earliest.")


def bf16_compress_hook_gloo(process_group: dist.ProcessGroup | None,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce a gradient bucket in bf16 and return its fp32 mean (see [Note: bf16 hook on CPU])."""
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = group.size()
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0]).div_(world_size)
        return buffer

    return fut.then(decompress)


class SerializedHookState:
    """The state of :func:`serialized_hook`: the wrapped ``(state, hook)`` and the last future."""

    def __init__(self, state: Any, hook: Callable) -> None:
        self.state, self.hook = state, hook
        self.pending: Optional[torch.futures.Future] = None

    def __getattr__(self, name: str) -> Any:       # DDP's logging asks hook states for their attributes
        if "state" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["state"], name)


def serialized_hook(state: SerializedHookState,
                    bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run the wrapped hook on ``bucket`` once the previous bucket's future is done (see
    [Note: PowerSGD on gloo])."""
    if state.pending is not None:
        state.pending.wait()
    fut = state.hook(state.state, bucket)
    state.pending = fut
    return fut


def _torch_accepts_bf16_hook() -> bool:
    """Whether ``register_comm_hook`` takes torch's own ``bf16_compress_hook`` on this build."""
    cuda = (torch.version.cuda is not None or torch.version.hip is not None) and dist.is_nccl_available()
    if cuda:
        try:
            cuda = torch.cuda.nccl.version() >= (2, 10)
        except Exception:  # no usable NCCL in this build
            cuda = False
    xpu = dist.is_xccl_available() and torch.xpu.is_available() if hasattr(dist, "is_xccl_available") else False
    return bool(cuda or xpu)


def select_comm_hook(comm_hook: str | None, *, process_group: Any = None, powersgd_rank: int = 1,
                     powersgd_start_iter: int = 1000, backend: str = "gloo") -> tuple[Any, Callable] | None:
    """The ``(state, hook)`` pair to pass to ``DistributedDataParallel.register_comm_hook``, or ``None``
    for DDP's built-in all-reduce. ``backend`` is the process group's (see [Note: PowerSGD on gloo])."""
    if comm_hook is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if comm_hook == "fp16":
        return process_group, default_hooks.fp16_compress_hook
    if comm_hook == "bf16":
        hook = default_hooks.bf16_compress_hook if _torch_accepts_bf16_hook() else bf16_compress_hook_gloo
        return process_group, hook
    if comm_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=process_group, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=powersgd_start_iter)
        if backend == "nccl":
            return state, powerSGD_hook.powerSGD_hook
        return SerializedHookState(state, powerSGD_hook.powerSGD_hook), serialized_hook
    raise ValueError(f"`comm_hook={comm_hook!r}` is not a known DDP communication hook.")  # validated earlier


# [Note: DDP's hooks on the core's flat buckets]
# The hybrid core (pipeline, tensor, context layouts) averages its replicas' gradients itself, one flat all-reduce
# per dtype after the step's backward ([Note: gradients under context parallelism] and ``average_flat_`` in
# lightning_par.tensor.mixed): torch's DDP cannot wrap a pipeline stage run by our schedule nor take DTensor
# parameters. ``comm_hook`` there runs the same torch hook functions DDP would, on each of those flat buffers
# presented as a DDP ``GradBucket`` (:class:`FlatBucket`: the buffer, its gradients as views into it, its index,
# whether it is the step's last), waiting for each bucket's future before the next (so PowerSGD's chained
# collectives keep one order on every rank, as :func:`serialized_hook` does for DDP on gloo). fp16 / bf16 are
# elementwise, so they give what DDP's hook gives whatever the bucketing; PowerSGD compresses each gradient matrix
# as DDP's hook does, but the batching of its factors and the seeds of its random starts follow the core's buckets
# (one per dtype), not DDP's 25 MiB ones.
class FlatBucket:
    """What torch's DDP hooks read of a ``GradBucket`` (``buffer``, ``gradients``, ``index``, ``is_last``), over one
    flat buffer whose ``shapes`` are the gradients it concatenates."""

    def __init__(self, index: int, buffer: torch.Tensor, shapes: list, last: bool) -> None:
        self._index, self._buffer, self._last = index, buffer, last
        self._grads, offset = [], 0
        for shape in shapes:
            n = int(torch.Size(shape).numel())
            self._grads.append(buffer[offset:offset + n].view(shape))
            offset += n

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list:
        return self._grads

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


class HookAverage:
    """The replicas' average of the core's flat gradient buckets through a DDP communication hook ([Note: DDP's hooks
    on the core's flat buckets]): ``average(flat, tensors, last)`` for each bucket of a step in order (``tensors``:
    what ``flat`` concatenates; ``last``: the step's last bucket), in place."""

    def __init__(self, comm_hook: str, group: dist.ProcessGroup, *, powersgd_rank: int = 1,
                 powersgd_start_iter: int = 1000) -> None:
        selected = select_comm_hook(comm_hook, process_group=group, powersgd_rank=powersgd_rank,
                                    powersgd_start_iter=powersgd_start_iter, backend=dist.get_backend(group))
        if selected is None:
            raise ValueError("comm_hook=None averages with a plain all-reduce, not a hook.")
        self.state, self.hook = selected
        self._index = 0  # the bucket's index within its step (PowerSGD keys its error feedback by it)

    def __call__(self, flat: torch.Tensor, tensors: list, last: bool = True) -> None:
        bucket = FlatBucket(self._index, flat, [t.shape for t in tensors], last=last)
        self._index = 0 if last else self._index + 1
        out = self.hook(self.state, bucket).wait()
        if out is not flat:
            flat.copy_(out)
