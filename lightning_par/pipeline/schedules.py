"""The order in which one pipeline stage runs its micro-batches' forwards ("F") and backwards ("B").

Example::

    >>> stage_actions("gpipe", stage=0, num_stages=2, microbatches=2)
    [('F', 0), ('F', 1), ('B', 0), ('B', 1)]
    >>> stage_actions("1f1b", stage=0, num_stages=2, microbatches=3)    # 1 warm-up forward
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    >>> stage_actions("1f1b", stage=1, num_stages=2, microbatches=3)    # the last stage alternates
    [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2)]
    >>> round(bubble_fraction(stages=2, microbatches=4), 3)
    0.2
"""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
IMPLEMENTED = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


def stage_actions(schedule: str, *, stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The actions of ``stage`` (0-based) for one step of ``microbatches`` micro-batches."""
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"`schedule={schedule!r}` has no single-stage action list; see interleaved_actions.")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside the {num_stages} stages.")
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(num_stages - stage - 1, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(m - warmup, m)]
    return actions


def bubble_fraction(*, stages: int, microbatches: int) -> float:
    """The idle share of a GPipe / 1F1B step with equal stage times: (p − 1) / (m + p − 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def peak_in_flight(actions: list[tuple[str, int]]) -> int:
    """The most micro-batches whose activations a stage holds at once (forwarded, not yet backwarded).

    Example::

        >>> peak_in_flight(stage_actions("gpipe", stage=0, num_stages=4, microbatches=8))
        8
        >>> peak_in_flight(stage_actions("1f1b", stage=0, num_stages=4, microbatches=8))
        4
    """
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def interleaved_actions(*, rank: int, ranks: int, chunks: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (Narayanan et al. 2021): rank ``r`` holds virtual stages ``r, r + p, ...`` (local
    chunk ``c`` is virtual stage ``c·p + r``); actions are ``(kind, chunk, micro-batch)``. Micro-batches
    go through a chunk in groups of ``p``, so ``microbatches`` must be a multiple of ``p``.

    Example::

        >>> interleaved_actions(rank=1, ranks=2, chunks=2, microbatches=2)
        [('F', 0, 0), ('F', 0, 1), ('F', 1, 0), ('B', 1, 0), ('F', 1, 1), ('B', 1, 1), ('B', 0, 0), ('B', 0, 1)]
    """
    p, v, m = ranks, chunks, microbatches
    if m % p:
        raise ValueError(f"interleaved_1f1b needs `microbatches` ({m}) to be a multiple of the pipeline size ({p}).")
    total = m * v

    def unit(i: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(i, p * v)
        chunk = (i // p) % v
        return (v - 1 - chunk if backward else chunk), group * p + within % p

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    actions = [("F", *unit(i, False)) for i in range(warmup)]
    for j in range(total - warmup):
        actions.append(("F", *unit(warmup + j, False)))
        actions.append(("B", *unit(j, True)))
    actions += [("B", *unit(j, True)) for j in range(total - warmup, total)]
    return actions


def zero_bubble_actions(*, stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """ZB-H1-style order (Qi et al. 2023) for one stage per rank: 1F1B's forwards ("F") and input-gradient
    backwards ("B"), with each weight-gradient backward ("W") held back while the stage still has
    cool-down backwards to wait for, and run in the gaps between them: stage ``s`` defers at most
    ``p - s - 1`` of them. W needs nothing from other stages, so the order stays deadlock-free.

    [Note: filling waits] The runner treats a W's place as its latest: when a B would wait for its output
    gradient, W's already due run first (whatever their place), so the wait is filled with work; and the
    last stage, which never defers, runs B and W as one backward pass (splitting costs a second pass).

    Example::

        >>> zero_bubble_actions(stage=0, num_stages=2, microbatches=3)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('W', 0), ('B', 2), ('W', 1), ('W', 2)]
        >>> zero_bubble_actions(stage=1, num_stages=2, microbatches=2)   # the last stage does not defer
        [('F', 0), ('B', 0), ('W', 0), ('F', 1), ('B', 1), ('W', 1)]
    """
    defer = num_stages - stage - 1
    pending: list[int] = []
    out: list[tuple[str, int]] = []
    for kind, i in stage_actions("1f1b", stage=stage, num_stages=num_stages, microbatches=microbatches):
        out.append((kind, i))
        if kind == "B":
            pending.append(i)
            if len(pending) > defer:
                out.append(("W", pending.pop(0)))
    out += [("W", i) for i in pending]
    return out


def looped_gpipe_actions(*, chunks: int, microbatches: int) -> list[tuple[str, int, int]]:
    """All forwards (micro-batch by micro-batch, chunks in order), then all backwards in reverse chunk
    order: the fallback of interleaved 1F1B for a batch whose micro-batch count ``p`` does not divide
    (a last partial batch).

    Example::

        >>> looped_gpipe_actions(chunks=2, microbatches=1)
        [('F', 0, 0), ('F', 1, 0), ('B', 1, 0), ('B', 0, 0)]
    """
    fwd = [("F", c, i) for i in range(microbatches) for c in range(chunks)]
    bwd = [("B", c, i) for i in range(microbatches) for c in reversed(range(chunks))]
    return fwd + bwd


def simulate(orders: list[list[tuple[str, int, int]]], ranks: int, chunks: int) -> int:
    """Run per-rank action lists with asynchronous sends and blocking receives; return the number of
    rounds (each rank does at most one action per round), or raise ``RuntimeError`` on a deadlock.

    Virtual stage ``c·p + r`` is chunk ``c`` of rank ``r``. A forward needs the previous virtual stage's
    forward of the micro-batch; a backward needs its own forward and the next virtual stage's backward.

    Example::

        >>> p = 2
        >>> simulate([[(k, 0, i) for k, i in stage_actions("1f1b", stage=r, num_stages=p, microbatches=4)]
        ...           for r in range(p)], ranks=p, chunks=1)
        10
    """
    last = ranks * chunks - 1
    done: set[tuple[str, int, int]] = set()  # (kind, virtual stage, micro-batch)
    pos = [0] * ranks
    rounds = 0
    while any(pos[r] < len(orders[r]) for r in range(ranks)):
        ready = []
        for r in range(ranks):
            if pos[r] == len(orders[r]):
                continue
            kind, chunk, mb = orders[r][pos[r]]
            k = chunk * ranks + r
            if kind == "F":
                ok = k == 0 or ("F", k - 1, mb) in done
            elif kind == "W":
                ok = ("B", k, mb) in done
            else:
                ok = ("F", k, mb) in done and (k == last or ("B", k + 1, mb) in done)
            if ok:
                ready.append((r, (kind, k, mb)))
        if not ready:
            raise RuntimeError(f"deadlock after {rounds} rounds at positions {pos}")
        for r, action in ready:
            done.add(action)
            pos[r] += 1
        rounds += 1
    return rounds


def channel_orders(orders: list[list[tuple[str, int, int]]], ranks: int, chunks: int) -> dict:
    """For each channel (kind of transfer, source rank, destination rank) the sequence of micro-batch
    transfers in the order the sender sends them and in the order the receiver receives them. Where the
    two agree for every channel, transfers match in FIFO order without tags (NCCL ignores tags).

    Example::

        >>> orders = [[(k, 0, i) for k, i in stage_actions("1f1b", stage=r, num_stages=2, microbatches=2)]
        ...           for r in range(2)]
        >>> all(sent == received for sent, received in channel_orders(orders, 2, 1).values())
        True
    """
    last = ranks * chunks - 1
    chans: dict = {}

    def add(kind, src, dst, key, side):
        chans.setdefault((kind, src, dst), ([], []))[side].append(key)

    for r, acts in enumerate(orders):
        for kind, chunk, mb in acts:
            k = chunk * ranks + r
            if kind == "F":
                if k > 0:
                    add("act", (k - 1) % ranks, r, (k, mb), 1)
                if k < last:
                    add("act", r, (k + 1) % ranks, (k + 1, mb), 0)
            elif kind == "B":
                if k < last:
                    add("grad", (k + 1) % ranks, r, (k, mb), 1)
                if k > 0:
                    add("grad", r, (k - 1) % ranks, (k - 1, mb), 0)
    return chans
