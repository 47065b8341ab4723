"""The arguments every strategy takes are checked by one piece of code (``strategies/_base.py``): the same
values refused by all three strategies, with the same message, before any process starts."""
from datetime import timedelta

import pytest

from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                           TensorParallelStrategy)

STRATEGIES = [DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy]


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize("timeout,shown", [
    (timedelta(seconds=-5), r"datetime\.timedelta\(days=-1, seconds=86395\)"),  # TensorParallelStrategy took it
    (timedelta(0), r"datetime\.timedelta\(0\)"),
    (0, "0"),
    (-1.5, r"-1\.5"),
    (float("inf"), "inf"),
    (float("nan"), "nan"),
    (True, "True"),
    ("60", "'60'"),
])
def test_every_strategy_refuses_a_timeout_that_is_not_finite_and_positive(cls, timeout, shown):
    with pytest.raises(ValueError, match=rf"^`timeout={shown}` must be a finite positive number of seconds \(or a "
                                         r"timedelta\): every collective must give up eventually\. The default is "
                                         r"1800\.0 \(30 minutes\)\.$"):
        cls(timeout=timeout)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_every_strategy_takes_seconds_or_a_timedelta(cls):
    assert cls()._timeout == timedelta(minutes=30)
    assert cls(timeout=90)._timeout == timedelta(seconds=90)
    assert cls(timeout=timedelta(minutes=2))._timeout == timedelta(seconds=120)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_every_strategy_refuses_an_unknown_start_method_with_one_message(cls):
    with pytest.raises(ValueError, match=r"^`start_method='thread'` must be one of 'popen', 'spawn', 'fork', "
                                         r"'forkserver' \('popen' is Lightning's default; 'fork' starts CPU ranks "
                                         r"fastest\)\.$"):
        cls(start_method="thread")
    assert cls(start_method="fork")._start_method == "fork"


@pytest.mark.parametrize("cls,size", [(PipelineParallelStrategy, "pipeline_parallel_size"),
                                      (TensorParallelStrategy, "tensor_parallel_size")])
def test_layout_strategies_check_sizes_and_flags_and_have_no_layout_before_setup(cls, size):
    for name in (size, "data_parallel_size"):
        with pytest.raises(ValueError, match=rf"^`{name}=0` must be a positive integer or 'auto'\.$"):
            cls(**{name: 0})
    with pytest.raises(ValueError, match=r"^`save_distributed_checkpoint='yes'` must be True or False\.$"):
        cls(save_distributed_checkpoint="yes")
    with pytest.raises(RuntimeError, match=rf"The layout of {cls.__name__} exists once its processes are set up"):
        cls().topology


CORE = [PipelineParallelStrategy, TensorParallelStrategy, HybridParallelStrategy]


@pytest.mark.parametrize("cls", [DataParallelStrategy, *CORE])
@pytest.mark.parametrize("kwargs,named", [
    (dict(comm_hook="int8"), ["`comm_hook='int8'`", "None, 'fp16', 'bf16', 'powersgd'"]),
    (dict(comm_hook="bf16", zero_stage=2), ["`zero_stage=2`", "FSDP", "comm_hook='bf16'", "zero_stage=0 or 1"]),
    (dict(comm_hook="powersgd", zero_stage=3), ["`zero_stage=3`", "comm_hook='powersgd'"]),
    (dict(comm_hook="fp16", sync="diloco", sync_every=4), ["`sync='diloco'`", "comm_hook='fp16'", "sync='every_step'"]),
    (dict(comm_hook="fp16", fault_tolerance="torchft"), ["`fault_tolerance='torchft'`", "comm_hook='fp16'",
                                                         "comm_hook=None"]),
    (dict(comm_hook="powersgd", powersgd_start_iter=1), ["`powersgd_start_iter=1`"]),
])
def test_every_strategy_refuses_a_comm_hook_it_cannot_apply_naming_it(cls, kwargs, named):
    """The core runs DDP's hooks on its own gradient buckets ([Note: DDP's hooks on the core's flat buckets]): the
    same refusals as DataParallelStrategy's, before any process starts."""
    with pytest.raises(ValueError) as err:
        cls(**kwargs)
    for text in named:
        assert text in str(err.value), (text, str(err.value))


@pytest.mark.parametrize("cls", CORE)
def test_the_core_takes_a_comm_hook_and_keeps_ddps_own_options_out(cls):
    assert cls(comm_hook="bf16", zero_stage=1)._options.comm.comm_hook == "bf16"
    with pytest.raises(TypeError, match="bucket_cap_mb"):  # DDP's reducer's options: DataParallelStrategy's alone
        cls(bucket_cap_mb=1.0)
