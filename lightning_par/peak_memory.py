"""The most memory a process holds from a point on: resident memory on CPU, the caching allocator's on CUDA.

    meter = PeakMemory()          # CPU
    meter.start()                 # the peak starts over from what the process holds now
    ...                           # build, train
    meter.net()                   # the most held since start() minus what was held at start()

CPU: the peak resident set (``VmHWM`` in ``/proc/self/status``) restarted at ``start()`` by Linux's ``clear_refs``
(``5``), so that what the interpreter, torch and Lightning touched before does not hide a later, smaller peak; the
net subtracts the resident set at ``start()`` (``VmRSS``). It counts tensors, allocator slack and mapped file pages
alike. Elsewhere (no ``/proc``) the lifetime peak (``ru_maxrss``) is all there is. A process that forked this one
holds its own pages: its peak is not this one's. CUDA: ``max_memory_allocated`` of the device after
``reset_peak_memory_stats``, net of ``memory_allocated`` at ``start()`` (tensors only: no context, no slack).

:class:`TensorPeak` counts tensor bytes instead of pages: the most bytes c10's CPU allocator held at once between
its ``start()`` and ``stop()`` beyond what was held at ``start()``, from the torch profiler's allocation events.
Unlike the resident set it is deterministic (no allocator slack, no code or file pages, no other thread's
heap), so tests can bound it; it slows every op down while it runs (keep it to setups of small models). A free
the profiler does not record is never subtracted (seen under tensor parallelism with activation checkpointing,
docs/limitations.md): its counts can only be too high, so an upper bound on them still holds.

Used by ``benchmarks/meta_memory.py``, ``lightning-par-recipe capacity`` and the meta-build tests.
"""
from __future__ import annotations

import resource

import torch


def reset_peak() -> None:
    """Start this process's peak resident memory over from its resident memory now (Linux ``clear_refs``); a no-op
    where there is none (the lifetime peak is kept)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":")), None)
    except OSError:
        return None


def peak_resident() -> int:
    """This process's peak resident memory in bytes since its start or the last :func:`reset_peak`."""
    peak = _status("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident() -> int:
    """This process's resident memory in bytes now (0 where ``/proc`` is missing: nets are then lifetime peaks)."""
    return _status("VmRSS") or 0


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds: DTensors' local shards, tied ones once, meta ones (owned by other
    ranks) not at all."""
    from lightning_par.comm import local_nbytes
    from lightning_par.materialize.meta import is_meta

    return sum(local_nbytes(p) for p in module.parameters() if not is_meta(p))


class PeakMemory:
    """The peak memory of this process (CPU) or of one CUDA device from :meth:`start` on."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.base: int | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            reset_peak()
            self.base = resident()

    def peak(self) -> int:
        """The gross peak since :meth:`start` (bytes)."""
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else peak_resident()

    def net(self) -> int:
        """The peak since :meth:`start` minus what was held at :meth:`start` (bytes)."""
        if self.base is None:
            raise RuntimeError("PeakMemory.net() before start(): call start() where the measured part begins.")
        return self.peak() - self.base


class TensorPeak:
    """The most CPU tensor bytes held at once from :meth:`start` to :meth:`stop`, net of what was held at
    :meth:`start` (``peak``), and the net bytes still held at :meth:`stop` (``held``). ``marks`` gives the net
    bytes held at named points (:meth:`mark`), e.g. after each step of a setup, and ``phase_peaks`` the most
    held between the mark before (or the start) and each.

        meter = TensorPeak()
        meter.start()
        ...                       # build, materialize, read
        meter.stop()
        meter.peak, meter.held    # bytes

    Example:
        >>> meter = TensorPeak(); meter.start()
        >>> a = torch.empty(1 << 20, dtype=torch.uint8); del a; b = torch.empty(1 << 19, dtype=torch.uint8)
        >>> meter.mark("after a")
        >>> meter.stop()
        >>> meter.peak, meter.marks["after a"] // 1024, meter.held // 1024     # bytes, KiB, KiB
        (1048576, 512, 512)
    """

    def __init__(self):
        self._prof = None
        self.peak: int | None = None
        self.held: int | None = None
        self.marks: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        self._prof.__enter__()

    def mark(self, name: str) -> None:
        """Remember this point: after :meth:`stop`, ``marks[name]`` is the net bytes held here."""
        from torch.profiler import record_function

        with record_function(_MARK + name):
            pass

    def stop(self) -> None:
        from lightning_par._compat import profiler_allocations

        if self._prof is None:
            raise RuntimeError("TensorPeak.stop() before start(): call start() where the measured part begins.")
        self._prof.__exit__(None, None, None)
        events, marks = profiler_allocations(self._prof, _MARK)
        self._prof = None
        held = peak = phase = 0
        marks.append((float("inf"), None))
        at = 0
        for t, size in events:
            while marks[at][0] <= t:
                self.marks[marks[at][1]], self.phase_peaks[marks[at][1]] = held, phase
                phase, at = held, at + 1
            held += size
            peak, phase = max(peak, held), max(phase, held)
        for _, name in marks[at:-1]:
            self.marks[name], self.phase_peaks[name], phase = held, phase, held
        self.peak, self.held = peak, held


_MARK = "lightning_par.mark:"
