"""DDP's communication hooks on the hybrid core's data axis ([Note: DDP's hooks on the core's flat buckets] in
lightning_par/dp/comm_hooks.py): the core's flat buckets through torch's hook functions give, element for element,
what DDP's registered hook gives on the same per-rank gradients, at half the bytes for fp16 / bf16; PowerSGD is the
plain average before its start iteration and a low-rank one after; under pipeline and tensor parallelism with two
replicas the compressed run stays within the format's rounding of the uncompressed one and the replicas stay equal.
"""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, free_port, one_process_fit, seeded, start_ranks
from models import corpus, tiny_gpt
from lightning_par import HybridParallelStrategy
from lightning_par.comm import CommCounter, count_comm
from lightning_par.dp.comm_hooks import HookAverage, select_comm_hook
from lightning_par.tensor.mixed import average_flat_

SHAPES = [(8, 8), (7,), (16, 4), (4, 4, 4)]  # what PowerSGD compresses (8 x 8: 64 entries against 16), a vector


def _rank_grads(rank: int, step: int = 0) -> list[torch.Tensor]:
    """Per-rank gradients with a wide range of magnitudes and signs (some halves nearly cancel)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=g) * 10.0 ** torch.randint(-4, 2, s, generator=g) for s in SHAPES]


class _Constants(torch.nn.Module):
    """Parameters whose gradient is the given constants: loss = sum(p * c)."""

    def __init__(self):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES])

    def forward(self, consts):
        return sum((p * c).sum() for p, c in zip(self.ps, consts))


def _group_of_two(rank: int, port: int):
    """This rank's world of two gloo ranks, and a group of both (as the core's dp group: not the world)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    return dist.new_group([0, 1], timeout=timedelta(seconds=60))


def _elementwise_worker(rank, port, comm_hook):
    group = _group_of_two(rank, port)
    grads = _rank_grads(rank)
    # DDP with the hook DataParallelStrategy registers: its reducer's buckets, its hook
    ddp = torch.nn.parallel.DistributedDataParallel(_Constants(), process_group=group)
    ddp.register_comm_hook(*select_comm_hook(comm_hook, process_group=group, backend="gloo"))
    ddp([g.clone() for g in grads]).backward()
    expected = [p.grad for p in ddp.module.ps]
    # the core's: one flat bucket through the same hook function, counted
    mine, counter = [g.clone() for g in grads], CommCounter()
    with count_comm(counter):
        average_flat_(mine, group, 2, average=HookAverage(comm_hook, group))
    for e, m in zip(expected, mine):
        torch.testing.assert_close(m, e, atol=0, rtol=0)
    plain = [g.clone() for g in grads]
    average_flat_(plain, group, 2)
    assert any(not torch.equal(m, p) for m, p in zip(mine, plain)), "the hook did not round anything"
    numel = sum(g.numel() for g in grads)
    assert counter.payload["all_reduce"] == 2 * numel, (dict(counter.payload), numel)  # 16-bit: half of fp32's
    dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("comm_hook", ["fp16", "bf16"])
def test_the_core_buckets_through_a_hook_equal_ddps_hook_element_for_element(comm_hook):
    """The same hook function on the same per-rank values, elementwise (a cast, a sum of two, a division): equal to
    DDP's result bit for bit whatever the bucketing. A rank's failed assertion fails the test (start_ranks raises)."""
    start_ranks(_elementwise_worker, (free_port(), comm_hook), 2)


def _powersgd_worker(rank, port):
    group = _group_of_two(rank, port)
    average = HookAverage("powersgd", group, powersgd_rank=1, powersgd_start_iter=2)
    results = []
    for step in range(3):
        grads = _rank_grads(rank, step)
        mine, plain = [g.clone() for g in grads], [g.clone() for g in grads]
        average_flat_(mine, group, 2, average=average)
        average_flat_(plain, group, 2)
        results.append((mine, plain))
    for step in (0, 1):  # before start_iter: PowerSGD's plain all-reduce
        for m, p in zip(*results[step]):
            torch.testing.assert_close(m, p, atol=0, rtol=0)
    mine, plain = results[2]
    for shape, m, p in zip(SHAPES, mine, plain):
        if len(shape) == 1:  # vectors go uncompressed
            torch.testing.assert_close(m, p, atol=0, rtol=0)
        else:  # each matrix (a 3-D tensor as shape[0] x rest) is P Q^T, of rank 1, and not the plain average
            assert torch.linalg.matrix_rank(m.reshape(shape[0], -1)).item() == 1, shape
            # a rank-1 factorisation of a random matrix with entries of 1e-4 to 10 misses most of them by far more
            assert not torch.allclose(m, p, atol=1e-3), shape
    gathered = [torch.zeros(sum(t.numel() for t in mine)) for _ in range(2)]
    dist.all_gather(gathered, torch.cat([t.reshape(-1) for t in mine]), group=group)
    torch.testing.assert_close(gathered[0], gathered[1], atol=0, rtol=0)  # both replicas got the same average
    dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_powersgd_on_the_core_buckets_is_plain_before_its_start_and_low_rank_after():
    start_ranks(_powersgd_worker, (free_port(),), 2)


# -- the strategies ------------------------------------------------------------------------------------------------
DATA = corpus()
U = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}  # unit roundoff of the hook's format
FLOOR = {"fp16": 2.0 ** -24, "bf16": 0.0}  # fp16's spacing below its normal range; bf16 has fp32's range
# A gradient that is 0 in exact arithmetic (attention's key bias: softmax ignores a shift of all of a query's scores)
# is fp32 rounding noise, ~1e-12 here, in each replica's half as in the one-process sum; the hook rounds the halves,
# whose size the bound cannot see. Per element, far below every real gradient of this model (~1e-4 and up).
NOISE = 1e-9


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout,comm_hook,zero_stage,peers", [
    ("pp2_dp2", "bf16", 0, [(0, 1), (2, 3)]),   # ranks (pp, dp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)
    ("tp2_dp2", "fp16", 1, [(0, 2), (1, 3)]),   # ranks (dp, tp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1); ZeRO-1's shards
])
def test_the_core_compresses_its_replicas_average_within_the_formats_rounding(tmp_path, layout, comm_hook, zero_stage,
                                                                             peers):
    """Step 0 starts from the same weights on the same data as one process: only the hook's rounding differs, so
    each gradient is within ``2u ||exact||`` (+ fp16's subnormal spacing, + fp32 noise) of it, norm-wise (an element
    whose two replicas' halves nearly cancel carries their rounding, not its own), and all of them together differ
    by more than u / 8 (the hook ran: micro-batching and sharding alone move a gradient by ~1e-7). Later steps track
    the uncompressed losses; the two replicas of each stage / shard stay identical."""
    sizes = (dict(pipeline_parallel_size=2, microbatches=2) if layout.startswith("pp")
             else dict(tensor_parallel_size=2))
    ref = one_process_fit(tiny_gpt, DATA.train_set, 8)
    got = fit_and_record(seeded(tiny_gpt), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "h"),
                         strategy=HybridParallelStrategy(start_method="fork", timeout=120, data_parallel_size=2,
                                                         comm_hook=comm_hook, zero_stage=zero_stage, **sizes),
                         devices=4)
    assert len(got) == 4
    for rec in got:
        errs, norms = [], []
        for name, g in rec["grads"][0].items():
            exact = ref["grads"][0][name]
            err = float((g - exact).norm())
            bound = 2 * U[comm_hook] * float(exact.norm()) + (FLOOR[comm_hook] + NOISE) * exact.numel() ** 0.5
            assert err <= bound, f"{name}: |error| {err:.3g} > {bound:.3g}"
            errs.append(err), norms.append(float(exact.norm()))
        # the format's rounding over all of the rank's gradients, not fp32's (~1e-7): the hook ran
        assert torch.tensor(errs).norm() > U[comm_hook] / 8 * torch.tensor(norms).norm(), (errs, norms)
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-3)
    for a, b in peers:
        assert got[a]["params"].keys() == got[b]["params"].keys()
        torch.testing.assert_close(got[a]["params"], got[b]["params"], atol=0, rtol=0)


@pytest.mark.timeout(TIMEOUT_S)
def test_powersgd_on_a_pipeline_counts_its_iterations_by_optimizer_steps(tmp_path):
    """pp 2 x dp 2 with ``powersgd_start_iter=2``: steps 0 and 1 are the plain average, exactly the run without a hook
    (each stage's buckets, the last marked as such, count one iteration a step); step 2 compresses."""
    kw = dict(start_method="fork", timeout=120, data_parallel_size=2, pipeline_parallel_size=2, microbatches=2)
    loader = lambda: DataLoader(DATA.train_set, batch_size=4)  # noqa: E731
    plain = fit_and_record(seeded(tiny_gpt), loader(), str(tmp_path / "plain"),
                           strategy=HybridParallelStrategy(**kw), devices=4)
    psgd = fit_and_record(seeded(tiny_gpt), loader(), str(tmp_path / "psgd"), devices=4,
                          strategy=HybridParallelStrategy(**kw, comm_hook="powersgd", powersgd_start_iter=2))
    for p, g in zip(plain, psgd):
        for step in (0, 1):
            for name, grad in p["grads"][step].items():
                torch.testing.assert_close(g["grads"][step][name], grad, atol=0, rtol=0)
        # step 2 compresses: a rank-1 approximation of a matrix of 8 or more rows and columns drops all its other
        # singular directions, a difference of the gradients' own size (measured 4e-3 to 6e-2 on most of these
        # matrices), against fp32's ~1e-7
        matrices = [n for n, t in p["grads"][2].items() if t.dim() == 2 and min(t.shape) >= 8]
        assert matrices and any(not torch.allclose(g["grads"][2][n], p["grads"][2][n], atol=1e-4) for n in matrices)
        # every recorded loss is computed before step 2's update, on weights the plain averages made: the same
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(p["losses"]), rtol=0, atol=0)
    torch.testing.assert_close(psgd[0]["params"], psgd[1]["params"], atol=0, rtol=0)  # replicas of stage 0
    torch.testing.assert_close(psgd[2]["params"], psgd[3]["params"], atol=0, rtol=0)  # and of stage 1
