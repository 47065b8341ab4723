"""``balance="time"``: measure what each block (and the code before and after the stack) costs on the
real device, forward plus backward, by running the user's own step on one micro-batch.

[Note: profiling the unchanged step] The stack's ends are not blocks: the embedding runs on the first
stage, the head and the loss on the last, and a large vocabulary can make the head cost several blocks.
Hooks time the forward of each block (pre/post hooks) and its backward (full backward pre/post hooks);
the code before the first block and after the last one is the rest of the step. The median over a few
repetitions is taken after one warm-up. Every rank profiles at once (the strategy averages them), so
the timings include the contention the real run has: ranks that share CPU cores and memory bandwidth
slow a large, memory-bound head more than the blocks, and a lone or a fastest-of-several measurement
then puts too many blocks on the head's stage. All ranks still hold the whole module at this point.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn


def profile_step(container: nn.Module, step: Callable[[], torch.Tensor], device: torch.device,
                 repeats: int = 5) -> tuple[float, list[float], float]:
    """(seconds before the stack, seconds per block, seconds after the stack), forward + backward."""
    n = len(container)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    marks: dict[tuple[str, int], float] = {}

    def stamp(key):
        def hook(*_):
            sync()
            marks[key] = time.perf_counter()
        return hook

    handles = []
    for i, block in enumerate(container):
        handles += [block.register_forward_pre_hook(stamp(("f0", i))), block.register_forward_hook(stamp(("f1", i))),
                    block.register_full_backward_pre_hook(stamp(("b0", i))),
                    block.register_full_backward_hook(stamp(("b1", i)))]
    samples = []
    try:
        for _ in range(repeats + 1):
            marks.clear()
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            t1 = time.perf_counter()
            loss.backward()
            sync()
            t2 = time.perf_counter()
            called = [i for i in range(n) if ("f0", i) in marks]
            if not called:
                raise ValueError("The step never called a block of the stack; balance='time' cannot profile it.")
            first, last = called[0], called[-1]
            blocks = [0.0] * n
            for i in called:
                blocks[i] = (marks[("f1", i)] - marks[("f0", i)]) + (marks.get(("b1", i), 0) - marks.get(("b0", i), 0))
            pre = (marks[("f0", first)] - t0) + (t2 - marks.get(("b1", first), t2))
            post = (t1 - marks[("f1", last)]) + (marks.get(("b0", last), t1) - t1)
            samples.append((pre, blocks, post))
    finally:
        for h in handles:
            h.remove()
    samples = samples[1:]  # the first run warms up
    pre = statistics.median(s[0] for s in samples)
    post = statistics.median(s[2] for s in samples)
    blocks = [statistics.median(s[1][i] for s in samples) for i in range(n)]
    return pre, blocks, post


def mean_over_ranks(measure: Callable[[], tuple[float, list[float], float]]) -> tuple[float, list[float], float]:
    """Every rank runs ``measure`` (a :func:`profile_step`) at once and gets the mean over ranks, so all
    choose the same split (see [Note: profiling the unchanged step]). Every rank calls it."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.barrier()  # start together: every repetition runs while the other ranks run theirs
    dist.all_gather_object(everyone, measure())
    pre, blocks, post = zip(*everyone)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return mean(pre), [mean(b) for b in zip(*blocks)], mean(post)
