"""No processes: the non-finite checks (lightning_par.nonfinite) and the `nonfinite` argument's refusal."""
import doctest

import pytest
import torch

from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy, nonfinite


def test_docstring_examples():
    result = doctest.testmod(nonfinite)
    assert result.attempted > 0 and result.failed == 0


def test_the_first_bad_gradient_in_parameter_order_is_named():
    grads = [("a", torch.ones(3)), ("b", None), ("c", torch.tensor([float("inf"), 1.0])),
             ("d", torch.tensor([float("nan")]))]
    assert nonfinite.find_nonfinite(None, grads) == ["gradient of `c` is inf"]
    assert nonfinite.find_nonfinite(torch.tensor(float("-inf")), []) == ["loss is -inf"]
    assert nonfinite.kind_of(torch.tensor([float("inf"), float("nan")])) == "nan"  # NaN wins


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_gradients_whose_norm_overflows_are_not_reported(dtype):
    # [Note: one norm for a healthy step]: the squares of these finite values overflow the 2-norm to inf, and
    # the exact per-gradient test must then find nothing; each kind of bad value is still found in each dtype.
    big = torch.full((4,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert nonfinite.find_nonfinite(None, [("big", big), ("one", torch.ones(2, dtype=dtype))]) == []
    for bad, kind in ((float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")):
        g = torch.ones(3, dtype=dtype)
        g[1] = bad
        assert nonfinite.find_nonfinite(None, [("big", big), ("g", g)]) == [f"gradient of `g` is {kind}"]


def test_one_process_agrees_with_itself():
    assert nonfinite.agree(["loss is nan"], where="rank 0", device=torch.device("cpu")) == ["loss is nan on rank 0"]
    assert nonfinite.agree([], where="rank 0", device=torch.device("cpu")) == []


@pytest.mark.parametrize("cls", [DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy])
def test_nonfinite_must_be_error_or_skip(cls):
    with pytest.raises(ValueError, match=r"`nonfinite='ignore'` must be 'error' .* or 'skip'"):
        cls(nonfinite="ignore")
    assert cls(nonfinite="skip")._guard.nonfinite == "skip"


def test_waits_name_the_operation_and_leave_other_errors_alone():
    from lightning_par import waits

    assert doctest.testmod(waits).failed == 0
    with pytest.raises(waits.CommunicationError, match=r"^DDP's all-reduce did not complete: Read error .*Connection "
                                                      r"reset by peer\. A rank of the group stopped answering"):
        with waits.named_wait("DDP's all-reduce"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:25778: Connection reset by peer")
    with pytest.raises(ValueError, match="user's own"):  # not a communication failure: untouched
        with waits.named_wait("anything"):
            raise ValueError("user's own")
    with pytest.raises(RuntimeError, match="^timeout of my own$"):
        with waits.named_wait("anything"):
            raise RuntimeError("timeout of my own")
