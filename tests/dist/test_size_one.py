"""Every strategy at size 1 on its model axis trains as plain Lightning does: one config serves a laptop and a
node. On one device, against ``Trainer(devices=1)`` on the same loader (sequential and shuffled: the strategy
must not put a sampler of its own in, see [Note: one process keeps the user's loader] in topology.py); on two
devices (pipeline or tensor size 1, two data-parallel replicas), against Lightning's own ``DDPStrategy``."""
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_close_records, fit_and_record, reference_loader, seeded
from models import corpus, gpt_factory
from lightning_par import DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy

DATA = corpus(val_sequences=16)
EXACT = dict(atol=0, rtol=0)


STRATEGIES = {
    "data_parallel": lambda **kw: DataParallelStrategy(start_method="fork", **kw),
    "pipeline_parallel": lambda **kw: PipelineParallelStrategy(pipeline_parallel_size=1, microbatches=1,
                                                               start_method="fork", timeout=120, **kw),
    "tensor_parallel": lambda **kw: TensorParallelStrategy(tensor_parallel_size=1, start_method="fork", timeout=120,
                                                           **kw),
    "hybrid_parallel": lambda **kw: HybridParallelStrategy(start_method="fork", timeout=120, **kw),  # 1 × 1 × dp
}


def loader(batch_size: int, shuffle: bool) -> DataLoader:
    return DataLoader(DATA.train_set, batch_size=batch_size, shuffle=shuffle)


def fit(name: str, data: DataLoader, **kw) -> list[dict]:
    torch.manual_seed(1)  # a shuffled loader draws its order from the global generator, as in plain Lightning
    return fit_and_record(seeded(gpt_factory()), data, name, **kw)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_one_device_is_plain_lightning_bit_for_bit(tmp_path, strategy):
    for shuffle in (False, True):
        ref = fit(str(tmp_path / f"ref{shuffle}"), loader(8, shuffle))[0]
        got = fit(str(tmp_path / f"got{shuffle}"), loader(8, shuffle), strategy=STRATEGIES[strategy]())
        assert len(got) == 1 and len(got[0]["losses"]) == 3
        assert_close_records(ref, got[0], **EXACT)
        assert got[0]["metrics"] == ref["metrics"]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("schedule,microbatches,stages_per_rank", [("1f1b", None, 1), ("gpipe", 4, 1),
                                                                   ("zero_bubble", 4, 1), ("interleaved_1f1b", 4, 2)])
def test_pipeline_options_at_size_one(tmp_path, schedule, microbatches, stages_per_rank):
    """Micro-batching still happens at pipeline_parallel_size=1 (``microbatches=None``: 2); the one stage runs
    the micro-batches one after another, so gradients and weights are plain Lightning's with
    ``accumulate_grad_batches=m`` on batches of batch / m (bit for bit), and the loss is the full batch's
    up to the order of the sum (a size-weighted mean of the micro-batch losses)."""
    m = microbatches or 2
    strategy = PipelineParallelStrategy(pipeline_parallel_size=1, microbatches=microbatches, schedule=schedule,
                                        stages_per_rank=stages_per_rank, start_method="fork", timeout=120)
    got = fit(str(tmp_path / "pp"), loader(8, False), strategy=strategy)[0]
    accumulated = fit(str(tmp_path / "acc"), loader(8 // m, False), accumulate_grad_batches=m)[0]
    whole = fit(str(tmp_path / "one"), loader(8, False))[0]
    assert_close_records(accumulated, got, losses=False, **EXACT)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(whole["losses"]), atol=1e-6, rtol=0)
    # the step really was split: the full batch's gradients differ from the accumulated ones in the last bits
    assert any(not torch.equal(g, whole["grads"][0][n]) for n, g in got["grads"][0].items())


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_two_replicas_of_a_size_one_model_axis_are_lightning_ddp(tmp_path, strategy):
    ddp = fit(str(tmp_path / "ddp"), loader(4, False), strategy=DDPStrategy(start_method="fork"), devices=2)
    got = fit(str(tmp_path / "got"), loader(4, False), strategy=STRATEGIES[strategy](), devices=2)
    assert len(got) == len(ddp) == 2
    for rec, ref in zip(got, ddp):
        # gradients and weights bit for bit; losses as each strategy reports them: rank-local as DDP for data
        # parallel, the replicas' mean (one device's loss on the global batch) for the model-parallel layouts
        assert_close_records(ref, rec, losses=strategy == "data_parallel", **EXACT)
    if strategy != "data_parallel":
        whole = fit(str(tmp_path / "one"), reference_loader(DATA.train_set, 8))[0]
        for rec in got:
            torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(whole["losses"]), atol=1e-6, rtol=0)


@pytest.mark.timeout(TIMEOUT_S)
def test_pipeline_dropout_at_size_one_is_the_two_stage_run(tmp_path):
    """Dropout masks are drawn per (step, micro-batch, block) at every pipeline size, so a laptop at size 1
    reproduces the node's run (not plain Lightning's masks, which come from one stream in another order)."""
    make = gpt_factory(dropout=0.2)
    two = fit_and_record(seeded(make), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "pp2"),
                         strategy=PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2,
                                                           start_method="fork", timeout=120), devices=2)
    one = fit_and_record(seeded(make), reference_loader(DATA.train_set, 8), str(tmp_path / "pp1"),
                         strategy=PipelineParallelStrategy(pipeline_parallel_size=1, microbatches=2,
                                                           start_method="fork", timeout=120))[0]
    for rec in two:
        owned = {n: rec["params"][n] for n in rec["grads"][-1]}
        assert_close_records(one, {**rec, "params": owned}, atol=1e-6, rtol=0, require_all_grads=False)
    no_dropout = fit_and_record(seeded(gpt_factory()), reference_loader(DATA.train_set, 8), str(tmp_path / "ref"))[0]
    assert one["losses"][0] != pytest.approx(no_dropout["losses"][0], abs=1e-4)  # dropout is active


@pytest.mark.parametrize("world_size,during", [(1, False), (2, True)])
def test_the_loader_switch_is_undone_at_teardown(world_size, during):
    from types import SimpleNamespace

    from lightning_par.topology import keep_loader_on_one_process

    trainer = SimpleNamespace(_accelerator_connector=SimpleNamespace(use_distributed_sampler=True))
    restore = keep_loader_on_one_process(trainer, world_size)
    assert trainer._accelerator_connector.use_distributed_sampler is during
    restore()
    assert trainer._accelerator_connector.use_distributed_sampler is True
