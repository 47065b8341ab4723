"""The harness's allowance for Adam's response to rounding ([Note: Adam's response to rounding] in
tests/harness.py): it is what torch's AdamW does with two gradient sequences, and it does not hide a wrong step."""
import pytest
import torch

from harness import adam_response, assert_close_records


def _fit(grads: list[torch.Tensor], lr=3e-3) -> tuple[torch.Tensor, list[dict]]:
    """torch's AdamW on one parameter fed ``grads``; the final value and the per-step settings as recorded."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64) * 0.02)
    opt = torch.optim.AdamW([p], lr=lr)
    settings = []
    for g in grads:
        p.grad = g.clone()
        settings.append({"w": (lr, 0.9, 0.999, 1e-8)})
        opt.step()
    return p.detach().clone(), settings


def _records():
    torch.manual_seed(1)
    ref_grads = [torch.randn(64) * 1e-3 for _ in range(3)]
    got_grads = [g * (1 + 1e-6 * torch.randn(64)) for g in ref_grads]  # a summation order's rounding
    for g, h in zip(ref_grads, got_grads):  # entry 7: a gradient of pure rounding noise, equal to 1e-9
        g[7], h[7] = -2.15e-9, -1.40e-9
    (ref_p, _), (got_p, settings) = _fit(ref_grads), _fit(got_grads)
    ref = {"losses": [1.0] * 3, "grads": [{"w": g} for g in ref_grads], "params": {"w": ref_p}}
    got = {"losses": [1.0] * 3, "grads": [{"w": g} for g in got_grads], "params": {"w": got_p}, "adam": settings}
    return ref, got


def test_the_allowance_is_adams_own_response():
    ref, got = _records()
    diff = (got["params"]["w"] - ref["params"]["w"]).abs()
    assert diff[7] > 1e-4  # the noise entry: far outside 1e-5 ...
    # ... and exactly what the replay predicts (float32 arithmetic of torch against the float64 replay)
    torch.testing.assert_close(diff, adam_response(got, ref, "w"), atol=1e-8, rtol=1e-3)
    assert_close_records(ref, got)
    with pytest.raises(AssertionError):  # without the recorded settings no allowance is made
        assert_close_records(ref, {k: v for k, v in got.items() if k != "adam"})


def test_a_wrong_step_still_fails():
    ref, got = _records()
    for wrong in (got["params"]["w"] - 3e-3 * torch.sign(got["grads"][-1]["w"]),  # a step taken twice
                  ref["params"]["w"].roll(1)):  # a shard put back in the wrong place
        with pytest.raises(AssertionError, match="param w"):
            assert_close_records(ref, {**got, "params": {"w": wrong}})
