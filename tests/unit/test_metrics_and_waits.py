"""ParallelMetrics' MFU against the peak FLOP/s of the run's precision (as Lightning's ThroughputMonitor picks
it), and what ``named_wait`` counts as a lost peer: timeouts, closed connections and ``DistBackendError``s,
never a usage error that merely names a backend."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.utilities import throughput
from lightning.pytorch.plugins import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_par import waits
from lightning_par.callbacks import ParallelMetrics
from lightning_par.strategies._precision import PrecisionHooks, layout_precision

PEAKS = {torch.float32: 60e12, torch.bfloat16: 900e12, torch.float16: 950e12, torch.float64: 30e12}


@pytest.mark.parametrize("plugin, dtype", [
    (Precision(), torch.float32),
    (MixedPrecision("bf16-mixed", "cuda"), torch.bfloat16),
    (MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cpu")), torch.float16),
    (HalfPrecision("bf16-true"), torch.bfloat16),
    (DoublePrecision(), torch.float64),
    (layout_precision(MixedPrecision("bf16-mixed", "cuda"), PrecisionHooks()), torch.bfloat16),  # as strategies wrap
])
def test_mfu_is_against_the_peak_of_the_runs_precision(monkeypatch, plugin, dtype):
    asked = []
    monkeypatch.setattr(throughput, "get_available_flops", lambda device, d: asked.append((device, d)) or PEAKS[d])
    module = torch.nn.Linear(10, 10)  # 110 parameters
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), precision_plugin=plugin,
                              world_size=2, is_global_zero=False)
    metrics = ParallelMetrics(summary=False)
    metrics.step_times, metrics.samples_per_step, metrics.tokens_per_step = [0.5, 0.5], 4, 1000  # 2000 tokens/s
    metrics.on_fit_end(trainer, module)
    assert asked == [(torch.device("cuda", 0), dtype)]
    assert metrics.rows[0]["mfu"] == pytest.approx(6 * 110 * 2000 / (PEAKS[dtype] * 2))


def test_mfu_takes_the_given_peak_and_is_absent_without_one(monkeypatch):
    monkeypatch.setattr(throughput, "get_available_flops", lambda *a: pytest.fail("the given peak is used"))
    cpu = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), precision_plugin=Precision(),
                          world_size=1, is_global_zero=False)
    for peak, has_mfu in ((1e9, True), (None, False)):
        metrics = ParallelMetrics(summary=False, peak_flops_per_device=peak)
        metrics.step_times, metrics.samples_per_step, metrics.tokens_per_step = [1.0], 1, 10
        metrics.on_fit_end(cpu, torch.nn.Linear(2, 2))
        assert ("mfu" in metrics.rows[0]) is has_mfu
    assert metrics.rows[0]["tokens_per_s"] == 10


LOST_PEER = [
    RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"),
    RuntimeError("Application timeout caused pair closure"),  # gloo, a receive from a stopped rank
    RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:25778: Connection reset by peer"),
    dist.DistStoreError("wait timeout after 3000ms, keys: /default_pg/0//cpu//0/5"),
    dist.DistBackendError("NCCL communicator was aborted on rank 1."),
    dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4, "
                          "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out."),
]
NOT_LOST = [
    # what gloo says for a wrong output list (seen on a one-rank group): a mistake, whatever backend it names
    RuntimeError("ProcessGroupGloo::allgather: invalid output tensor list at index 0 (expected length 1, got 2)"),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN)"),
    RuntimeError("NCCL does not support this dtype"),
    RuntimeError("Cannot use ReduceOp.BAND with non-integral dtype"),
    RuntimeError("timeout of my own"),
    ValueError("Timed out waiting for my own queue"),  # not a backend's error type
]


@pytest.mark.parametrize("error", LOST_PEER, ids=lambda e: str(e)[:40])
def test_timeouts_closed_connections_and_backend_errors_are_a_lost_peer(error):
    with pytest.raises(waits.CommunicationError, match=r"^the all-reduce did not complete: .* A rank of the group "
                                                       r"stopped answering .* or died") as info:
        with waits.named_wait("the all-reduce"):
            raise error
    assert info.value.__cause__ is error


@pytest.mark.parametrize("error", NOT_LOST, ids=lambda e: str(e)[:40])
def test_other_errors_pass_through_as_they_are(error):
    with pytest.raises(type(error)) as info:
        with waits.named_wait("the all-reduce", peer=1):
            raise error
    assert info.value is error and not isinstance(info.value, waits.CommunicationError)
