"""Split a stack of blocks into contiguous pipeline stages (pure functions, no torch.distributed).

Example::

    >>> partition_blocks(8, 2)                       # "uniform"
    [4, 4]
    >>> partition_blocks(5, 2)
    [3, 2]
    >>> partition_blocks(4, 2, balance="params", costs=[1, 1, 1, 3])   # balance the slowest stage
    [3, 1]
    >>> partition_blocks(4, 2, balance=[1, 3])
    [1, 3]
    >>> stage_bounds([3, 1])
    [(0, 3), (3, 4)]
"""
from __future__ import annotations

from typing import Sequence, Union

Balance = Union[str, Sequence[int]]
BALANCES = ("uniform", "params", "time")


def partition_blocks(
    num_blocks: int, num_stages: int, *, balance: Balance = "uniform", costs: Sequence[float] | None = None,
    first_extra: float = 0.0, last_extra: float = 0.0,
) -> list[int]:
    """Blocks per stage. ``balance`` is a list of counts (checked and returned), or a mode: with ``costs``
    (one per block) the split minimizes the most expensive stage (ties: the most even split), where the
    first stage also pays ``first_extra`` (embeddings) and the last ``last_extra`` (head and loss);
    without costs, or with ``"uniform"``, earlier stages take one extra block when the split is uneven.

    Example::

        >>> partition_blocks(8, 2, balance="time", costs=[1.0] * 8, last_extra=4.0)   # a heavy head
        [6, 2]
    """
    if num_stages < 1:
        raise ValueError(f"The number of pipeline stages ({num_stages}) must be at least 1.")
    if num_stages > num_blocks:
        raise ValueError(
            f"{num_stages} pipeline stages need at least {num_stages} blocks, but the block stack has "
            f"{num_blocks}. Use fewer stages (pipeline_parallel_size × stages_per_rank ≤ {num_blocks})."
        )
    if not isinstance(balance, str):
        counts = list(balance)
        if len(counts) != num_stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts) \
                or sum(counts) != num_blocks:
            raise ValueError(
                f"`balance={counts}` must list {num_stages} positive block counts (one per stage) summing to "
                f"the {num_blocks} blocks of the stack."
            )
        return counts
    if balance not in BALANCES:
        raise ValueError(f"`balance={balance!r}` is not one of {BALANCES} or a list of blocks per stage.")
    if balance == "uniform" or costs is None or (len(set(costs)) == 1 and first_extra == last_extra == 0):
        base, extra = divmod(num_blocks, num_stages)
        return [base + (1 if s < extra else 0) for s in range(num_stages)]
    if len(costs) != num_blocks:
        raise ValueError(f"Got {len(costs)} block costs for {num_blocks} blocks.")
    return _min_max_split([float(c) for c in costs], num_stages, float(first_extra), float(last_extra))


def stage_costs(counts: Sequence[int], costs: Sequence[float], first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    """The cost of each stage of a split (blocks plus the ends).

    Example::

        >>> stage_costs([3, 1], [1, 1, 1, 3], last_extra=1.0)
        [3.0, 4.0]
    """
    out = [float(sum(costs[lo:hi])) for lo, hi in stage_bounds(counts)]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def _min_max_split(costs: list[float], k: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Contiguous split of ``costs`` into ``k`` non-empty parts minimizing (max part, sum of squares)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[j][i]: the best split of the first i blocks into j parts; cut[j][i]: where the last part starts
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                if best[j - 1][s] == inf:
                    continue
                part = prefix[i] - prefix[s] + (first_extra if s == 0 else 0.0) + (last_extra if i == n else 0.0)
                cand = (max(best[j - 1][s][0], part), best[j - 1][s][1] + part * part)
                if _lt(cand, best[j][i]):
                    best[j][i], cut[j][i] = cand, s
    counts, i = [], n
    for j in range(k, 0, -1):
        s = cut[j][i]
        counts.append(i - s)
        i = s
    return counts[::-1]


def _lt(a: tuple[float, float], b: tuple[float, float], eps: float = 1e-9) -> bool:
    if b[0] == float("inf"):
        return a[0] < b[0]
    if a[0] < b[0] - eps * max(1.0, abs(b[0])):
        return True
    if a[0] > b[0] + eps * max(1.0, abs(b[0])):
        return False
    return a[1] < b[1] - eps * max(1.0, abs(b[1]))


def stage_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` block ranges of the stages, in order."""
    bounds, lo = [], 0
    for c in counts:
        bounds.append((lo, lo + c))
        lo += c
    return bounds


def stage_table(counts: Sequence[int], block_params: Sequence[int],
                times: tuple[float, Sequence[float], float] | None = None, *, path: str = "blocks",
                total_params: int | None = None, replicas: int = 1, schedule: str = "", balance: Balance = "") -> str:
    """A table of a split: blocks, parameters and ~MB of fp32 Adam state per stage, and with ``times``
    (seconds before the stack, per block, after it: ``balance="time"``) the profiled ms.

    Example::

        >>> print(stage_table([3, 1], [10, 10, 10, 30], total_params=100, schedule="1f1b", balance="params"))
        Pipeline: 2 stages over `blocks` (4 blocks), 1 data-parallel replica(s), schedule=1f1b, balance=params
        stage    blocks  block params  ~MB (fp32 Adam)
            0       0-2            30             0.00
            1       3-3            30             0.00
        non-block parameters (40: embeddings, head) live on the stages that use them
    """
    lines = [f"Pipeline: {len(counts)} stages over `{path}` ({len(block_params)} blocks), "
             f"{replicas} data-parallel replica(s), schedule={schedule}, balance={balance}",
             f"{'stage':>5} {'blocks':>9} {'block params':>13} {'~MB (fp32 Adam)':>16}"
             + (f" {'profiled ms':>12}" if times else "")]
    stage_ms = stage_costs(counts, times[1], times[0], times[2]) if times else None
    for s, (lo, hi) in enumerate(stage_bounds(counts)):
        n = sum(block_params[lo:hi])
        lines.append(f"{s:>5} {f'{lo}-{hi - 1}':>9} {n:>13,} {n * 16 / 2**20:>16.2f}"
                     + (f" {stage_ms[s] * 1e3:>12.2f}" if stage_ms else ""))
    other = (total_params if total_params is not None else sum(block_params)) - sum(block_params)
    lines.append(f"non-block parameters ({other:,}: embeddings, head) live on the stages that use them")
    return "\n".join(lines)
