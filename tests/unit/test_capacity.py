"""The capacity recipe's parts that need no ranks: the search over the ladder, the advisor's ladder of profiles,
the ladder's check, and the peak-memory meter."""
import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from lightning_par.advisor import profile_lightning_module
from lightning_par.models import GPT
from lightning_par.peak_memory import PeakMemory
from lightning_par.recipe import load_config
from lightning_par.recipes._capacity_job import is_oom, largest_fitting
from lightning_par.recipes.capacity import ladder
from lightning_par.recipes.decision import scaled_profile


def search(measured, predicted, budget, start):
    calls = []

    def measure(i):
        calls.append(i)
        return measured[i]

    best, peaks = largest_fitting(measure, predicted, budget, start)
    assert sorted(peaks) == sorted(calls) and len(calls) == len(set(calls))  # no rung measured twice
    return best, calls


@pytest.mark.parametrize("budget", [5, 10, 15, 25, 35, 55, 100])
@pytest.mark.parametrize("start", [0, 2, 4])
@pytest.mark.parametrize("bias", [0.5, 1.0, 1.3])  # the advisor low, right, high
def test_search_finds_the_largest_rung_within_the_budget_from_any_start(budget, start, bias):
    measured = [10, 20, 30, 40, 50]
    predicted = [int(m / bias) for m in measured]
    best, calls = search(measured, predicted, budget, start)
    expected = max((i for i, m in enumerate(measured) if m <= budget), default=None)
    assert best == expected
    # the answer is bracketed by measurements: it fit, and the rung above (if any) was measured and did not
    if best is not None:
        assert best in calls
    if expected is None or expected < len(measured) - 1:
        assert (0 if expected is None else expected + 1) in calls


def test_search_from_a_right_prediction_costs_two_fits():
    measured = [10, 20, 30, 40, 50]
    assert search(measured, [11, 21, 31, 41, 51], 35, start=2) == (2, [2, 3])


def test_search_counts_a_run_out_of_memory_as_not_fitting():
    measured = [10, 20, None, None, None]  # None: the allocator refused (CUDA, set_per_process_memory_fraction)
    assert search(measured, [10, 20, 30, 40, 50], 45, start=4)[0] == 1


def test_out_of_memory_is_told_from_other_failures():
    assert is_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB")
    assert not is_oom("RuntimeError: mat1 and mat2 shapes cannot be multiplied")


def test_the_advisors_ladder_profile_equals_a_profile_of_the_deeper_model():
    """scaled_profile of a 2-block probe at the ladder's width is exact for every rung (the blocks are alike)."""
    kw = dict(vocab_size=32, block_size=8, n_head=2, n_embd=16)
    tokens = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    probe = profile_lightning_module(GPT(**kw, n_layer=2), batch)
    direct = profile_lightning_module(GPT(**kw, n_layer=5), batch)
    scaled = scaled_profile(probe, 32, 5, 16, 2, 32, 8)
    timed = ("step_s_per_sample", "block_forward_s_per_sample", "selective_recompute_share")  # clocks, not counts
    assert ({k: v for k, v in dataclasses.asdict(scaled).items() if k not in timed}
            == {k: v for k, v in dataclasses.asdict(direct).items() if k not in timed})


def test_ladder_needs_a_block_per_pipeline_stage():
    cfg = load_config("capacity", quick=True, overrides=[])
    assert ladder(cfg)[:3] == [2, 3, 4]
    bad = OmegaConf.merge(cfg, {"ladder": {"first": 1}})
    with pytest.raises(ValueError, match=r"ladder.first=1.*largest pipeline size \(2"):
        ladder(bad)


def test_peak_memory_sees_a_buffer_allocated_and_freed_after_start():
    meter = PeakMemory()
    meter.start()
    buffer = torch.ones(64 * 2**20 // 4)  # 64 MiB, written: resident
    del buffer
    assert meter.net() >= 60 * 2**20
    with pytest.raises(RuntimeError, match="before start"):
        PeakMemory().net()
