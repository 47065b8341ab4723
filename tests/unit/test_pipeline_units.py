"""Pure pieces of pipeline parallelism (no processes): discovery, partition, schedules, micro-batches,
log routing, and the errors bad arguments raise before any process starts."""
import doctest
from datetime import timedelta

import pytest
import torch
from torch import nn

import lightning_par.pipeline.discovery as discovery
import lightning_par.pipeline.mailbox as mailbox
import lightning_par.pipeline.microbatch as microbatch
import lightning_par.pipeline.p2p as p2p
import lightning_par.pipeline.partition as partition
import lightning_par.pipeline.runner as runner
import lightning_par.pipeline.schedules as schedules
from lightning_par.models import GPT
from lightning_par.pipeline import find_blocks, partition_blocks, stage_actions
from lightning_par.pipeline.microbatch import split_batch, weighted_mean
from lightning_par.pipeline.routing import LogCapture, combine_outputs, concat_outputs
from lightning_par.pipeline.schedules import peak_in_flight
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy


@pytest.mark.parametrize("module", [discovery, mailbox, microbatch, p2p, partition, runner, schedules])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# -- discovery ---------------------------------------------------------------------------------------
def test_finds_the_gpt_blocks_and_a_named_or_sequential_stack():
    gpt = GPT(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=8)
    assert find_blocks(gpt)[0] == "blocks"
    seq = nn.Sequential(nn.Linear(2, 2), nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]))
    assert find_blocks(seq)[0] == "1"
    assert find_blocks(gpt, "blocks")[1] is gpt.blocks


def test_no_stack_or_a_wrong_name_says_how_to_name_one():
    with pytest.raises(ValueError, match=r"blocks='model.layers'"):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ValueError, match=r"`blocks='layers'` names no submodule"):
        find_blocks(GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8), "layers")
    with pytest.raises(ValueError, match="must be a non-empty nn.ModuleList"):
        find_blocks(GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8), "ln_f")


# -- partition ---------------------------------------------------------------------------------------
def test_partition_modes():
    assert partition_blocks(10, 4) == [3, 3, 2, 2]
    assert partition_blocks(6, 3, balance="params", costs=[1.0] * 6) == [2, 2, 2]
    assert partition_blocks(4, 2, balance="params", costs=[4, 1, 1, 1]) == [1, 3]
    assert partition_blocks(6, 3, balance="time", costs=[9, 1, 1, 1, 1, 9]) == [1, 4, 1]
    counts = partition_blocks(12, 4, balance="params", costs=[float(i) for i in range(12)])
    assert sum(counts) == 12 and len(counts) == 4 and min(counts) >= 1


def test_more_stages_than_blocks_and_bad_lists_are_refused():
    with pytest.raises(ValueError, match=r"4 pipeline stages need at least 4 blocks, but the block stack has 3"):
        partition_blocks(3, 4)
    with pytest.raises(ValueError, match=r"`balance=\[2, 1\]` must list 2 positive block counts"):
        partition_blocks(4, 2, balance=[2, 1])
    with pytest.raises(ValueError, match="`balance='fast'`"):
        partition_blocks(4, 2, balance="fast")


# -- schedules ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 2)])
def test_every_microbatch_is_forwarded_before_its_backward(schedule, p, m):
    for s in range(p):
        acts = stage_actions(schedule, stage=s, num_stages=p, microbatches=m)
        assert sorted(acts) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(acts.index(("F", i)) < acts.index(("B", i)) for i in range(m))
        assert [i for k, i in acts if k == "F"] == list(range(m)) == [i for k, i in acts if k == "B"]
        expected_peak = m if schedule == "gpipe" else min(p - s, m)
        assert peak_in_flight(acts) == expected_peak


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (2, 3, 8), (3, 2, 6), (4, 2, 8), (4, 3, 4)])
def test_interleaved_schedule_is_complete_and_deadlock_free(p, v, m):
    orders = [schedules.interleaved_actions(rank=r, ranks=p, chunks=v, microbatches=m) for r in range(p)]
    for acts in orders:
        assert sorted(acts) == sorted((k, c, i) for k in "FB" for c in range(v) for i in range(m))
    rounds = schedules.simulate(orders, ranks=p, chunks=v)
    one_chunk = schedules.simulate([[(k, 0, i) for k, i in stage_actions("1f1b", stage=r, num_stages=p, microbatches=m)]
                                    for r in range(p)], ranks=p, chunks=1)
    # in units of one chunk's work: interleaving shrinks the bubble from (p-1) block-stacks to (p-1)/v
    assert rounds / v < one_chunk
    assert rounds == 2 * m * v + 2 * (p - 1)  # ideal 2·m·v plus the fill and drain of one chunk each way


@pytest.mark.parametrize("p,v,m", [(2, 2, 1), (2, 2, 3), (3, 2, 4)])
def test_looped_gpipe_fallback_is_deadlock_free(p, v, m):
    orders = [schedules.looped_gpipe_actions(chunks=v, microbatches=m) for _ in range(p)]
    schedules.simulate(orders, ranks=p, chunks=v)


def _idle_slots(orders, *, grad_after: str, fill: bool) -> list[tuple[int, int]]:
    """Per stage, the rounds it idles before and after its last forward (unit-time F, B and W; one stage per
    rank). ``grad_after``: the action after which a stage's input gradient goes upstream ("B" when the
    backward is split, "W" for 1F1B's single backward pass). ``fill``: the runner's policy ([Note: filling
    waits] in schedules.zero_bubble_actions): a stage that would wait on a B runs a W that is due instead."""
    p, last, done = len(orders), len(orders) - 1, set()
    todo = [list(acts) for acts in orders]
    idle = [[0, 0] for _ in orders]
    while any(todo):
        ran = []
        for s, acts in enumerate(todo):
            def ready(action, s=s):
                kind, _, i = action
                if kind == "F":
                    return s == 0 or ("F", s - 1, i) in done
                if kind == "W":
                    return ("B", s, i) in done
                return ("F", s, i) in done and (s == last or (grad_after, s + 1, i) in done)
            waits_on_b = fill and acts and acts[0][0] == "B"
            due = [j for j, a in enumerate(acts) if (j == 0 or waits_on_b and a[0] == "W") and ready(a)][:1]
            if due:
                ran.append((s, acts.pop(due[0])))
            elif acts:
                idle[s][not any(a[0] == "F" for a in acts)] += 1
        assert ran, "deadlock"
        done.update((kind, s, i) for s, (kind, _, i) in ran)
    return [tuple(x) for x in idle]


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 2), (4, 4), (4, 8)])
def test_zero_bubble_order_is_complete_and_fills_the_cooldown(p, m):
    orders = [[(k, 0, i) for k, i in schedules.zero_bubble_actions(stage=s, num_stages=p, microbatches=m)]
              for s in range(p)]
    for s, acts in enumerate(orders):
        assert sorted(acts) == sorted((k, 0, i) for k in "FBW" for i in range(m))
        assert all(acts.index(("B", 0, i)) < acts.index(("W", 0, i)) for i in range(m))
        # W placement: before each F or B, the weight gradients stage s holds back (B done, W not yet):
        # never more than p - s - 1, and in its cool-down (after its last forward) every B but the first
        # finds one held back to run while it waits for its output gradient
        last_f = max(j for j, a in enumerate(acts) if a[0] == "F")
        held_at = [{i for k, _, i in acts[:j] if k == "B"} - {i for k, _, i in acts[:j] if k == "W"}
                   for j in range(len(acts))]
        held = [len(held_at[j]) for j, a in enumerate(acts) if a[0] != "W"]
        assert max(held) == min(p - s - 1, m - 1), (s, held, acts)
        if s < p - 1:
            cooldown = [j for j in range(last_f + 2, len(acts)) if acts[j][0] == "B"]
            assert all(held_at[j] for j in cooldown), f"stage {s}: a cool-down B has no W to fill its wait: {acts}"
        if s == p - 1:  # the last stage never defers: each B is followed by its own W
            assert all(acts[acts.index(("B", 0, i)) + 1] == ("W", 0, i) for i in range(m))
    schedules.simulate(orders, ranks=p, chunks=1)
    # idle slots (unit-time F, B, W) under the runner's policy, against 1F1B, whose single backward sends the
    # input gradient only after the weight gradient: the stage's bubble falls from 3(p-1) - 2s units to
    # 2(p-1) - s (ZB-H1's third, Qi et al. 2023), and no stage idles more in its cool-down than under 1F1B
    one_f_one_b = [[a for k, i in stage_actions("1f1b", stage=s, num_stages=p, microbatches=m)
                    for a in ([("F", 0, i)] if k == "F" else [("B", 0, i), ("W", 0, i)])] for s in range(p)]
    zb = _idle_slots(orders, grad_after="B", fill=True)
    ref = _idle_slots(one_f_one_b, grad_after="W", fill=False)
    assert [sum(x) for x in ref] == [3 * (p - 1) - 2 * s for s in range(p)], ref
    assert [sum(x) for x in zb] == [2 * (p - 1) - s for s in range(p)], zb
    assert all(z[1] <= r[1] for z, r in zip(zb, ref)), (zb, ref)


def _orders(schedule, p, v, m):
    if schedule == "interleaved_1f1b":
        return [schedules.interleaved_actions(rank=r, ranks=p, chunks=v, microbatches=m) for r in range(p)]
    if schedule == "looped":
        return [schedules.looped_gpipe_actions(chunks=v, microbatches=m) for _ in range(p)]
    if schedule == "zero_bubble":
        return [[(k, 0, i) for k, i in schedules.zero_bubble_actions(stage=r, num_stages=p, microbatches=m)]
                for r in range(p)]
    return [[(k, 0, i) for k, i in stage_actions(schedule, stage=r, num_stages=p, microbatches=m)] for r in range(p)]


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2),
                                        ("interleaved_1f1b", 3), ("looped", 2)])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (3, 3), (4, 8)])
def test_every_channel_receives_in_the_order_it_sends(schedule, v, p, m):
    """FIFO matching per (kind, source, destination): what NCCL, which ignores tags, relies on."""
    channels = schedules.channel_orders(_orders(schedule, p, v, m), ranks=p, chunks=v)
    assert channels and all(sent == received for sent, received in channels.values())


def test_the_simulator_finds_a_deadlock():
    bad = [[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        schedules.simulate(bad, ranks=2, chunks=1)


# -- micro-batches and routing -------------------------------------------------------------------------
def test_split_keeps_non_batch_leaves_and_handles_small_batches():
    batch = {"x": torch.arange(6).view(3, 2), "table": torch.ones(5), "flag": True}
    parts = split_batch(batch, 4)  # only 3 samples: 3 micro-batches
    assert len(parts) == 3 and all(p["flag"] is True and p["table"].shape == (5,) for p in parts)
    assert [p["x"].tolist() for p in parts] == [[[0, 1]], [[2, 3]], [[4, 5]]]
    with pytest.raises(ValueError, match="holds no tensor with a batch dimension"):
        split_batch({"a": 1.0}, 2)


def test_log_capture_combines_microbatches_by_size():
    class Module(nn.Module):
        def log(self, *args, **kwargs):
            pytest.fail("captured calls must not reach the real log")

    module = Module()
    with LogCapture(module) as cap:
        for mb, value in enumerate([1.0, 2.0, 4.0]):
            cap.microbatch = mb
            module.log("loss", torch.tensor(value), sync_dist=True)
        module.log("once", 3)
    assert "log" not in module.__dict__  # the class's log is back
    combined = {name: (v.item(), kw) for name, v, kw in cap.combined([2, 1, 1])}
    assert combined["loss"] == (pytest.approx((2 * 1 + 2 + 4) / 4), {"sync_dist": True})
    assert combined["once"][0] == 3.0


def test_combine_and_concat_outputs():
    outs = [{"loss": torch.tensor(1.0), "n": 2}, {"loss": torch.tensor(3.0), "n": 4}]
    got = combine_outputs(outs, [1, 3])
    assert got["loss"].item() == pytest.approx(2.5) and got["n"] == pytest.approx(3.5)
    assert concat_outputs([torch.zeros(2, 3), torch.ones(1, 3)]).shape == (3, 3)
    assert weighted_mean([2.0, 4.0], [1, 1]) == 3.0



def test_router_on_one_stage_logs_and_returns_the_combined_result():
    from lightning_par.pipeline.routing import ResultRouter

    logged = []

    class Module(nn.Module):
        def log(self, name, value, **kwargs):
            logged.append((name, value.item(), kwargs))

    module = Module()
    router = ResultRouter(mailbox=None, is_last=True, device=torch.device("cpu"))
    with LogCapture(module) as cap:
        for mb, value in enumerate([1.0, 3.0]):
            cap.microbatch = mb
            module.log("loss", torch.tensor(value), prog_bar=True)
    payload = router.send([torch.tensor(1.0), {"loss": torch.tensor(3.0)}["loss"]], [1, 3], cap)
    assert router.route(payload, module).item() == pytest.approx(2.5)
    assert logged == [("loss", pytest.approx(2.5), {"prog_bar": True})]


# -- strategy arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="pipedream"), r"`schedule='pipedream'` is not a pipeline schedule; choose one of \('gpipe'"),
    (dict(schedule="interleaved_1f1b"), r"needs `stages_per_rank` >= 2 \(got 1\)"),
    (dict(stages_per_rank=2), r"`stages_per_rank=2` needs `schedule='interleaved_1f1b'`"),
    (dict(microbatches=0), r"`microbatches=0` must be a positive integer"),
    (dict(pipeline_parallel_size=0), r"`pipeline_parallel_size=0` must be a positive integer or 'auto'"),
    (dict(balance="fastest"), r"`balance='fastest'` must be one of"),
    (dict(balance=[2, 0]), r"must list positive block counts"),
    (dict(blocks=""), r"must be the dotted name"),
    (dict(start_method="thread"), r"`start_method='thread'`"),
    (dict(timeout=float("inf")), r"must be a finite positive number of seconds"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineParallelStrategy(**kwargs)


def test_arguments_are_keyword_only_and_unknown_keys_rejected():
    with pytest.raises(TypeError):
        PipelineParallelStrategy(2)  # noqa
    with pytest.raises(TypeError):
        PipelineParallelStrategy(micro_batches=4)  # noqa


def test_sizes_that_do_not_multiply_to_the_world_fail_before_the_process_group():
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=3, timeout=timedelta(seconds=5))
    strategy.parallel_devices = [torch.device("cpu")] * 4
    message = r"`data_parallel_size=3` and `pipeline_parallel_size=2`.*world size \(4\)"
    with pytest.raises(ValueError, match=message) as info:
        strategy.setup_environment()
    assert "tensor_parallel_size" not in str(info.value)  # the preset takes none: its message names none
    assert not torch.distributed.is_initialized()


def test_profile_times_each_block_and_the_ends():
    from lightning_par.pipeline.profile import profile_step

    torch.manual_seed(0)
    gpt = GPT(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=8)
    idx = torch.randint(0, 16, (2, 8))
    pre, blocks, post = profile_step(gpt.blocks, lambda: gpt._loss((idx, idx)), torch.device("cpu"), repeats=2)
    assert len(blocks) == 3 and all(t > 0 for t in blocks) and pre > 0 and post > 0
    assert all(p.grad is not None for p in gpt.parameters())  # the step really ran backward


def test_registered_name_and_hydra_option():
    import lightning.pytorch as pl

    import lightning_par  # noqa: F401  (registers the names)
    from lightning_par.config import STRATEGY_SCHEMAS, PipelineStrategyConfig

    trainer = pl.Trainer(strategy="pipeline_parallel", devices=2, accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, lightning_par.PipelineParallelStrategy)
    assert STRATEGY_SCHEMAS["pipeline"] is PipelineStrategyConfig
    fields = set(PipelineStrategyConfig.__dataclass_fields__) - {"_target_"}
    import inspect

    params = inspect.signature(PipelineParallelStrategy).parameters
    assert fields <= set(params)
    for name in fields:  # the schema's defaults are the constructor's
        assert getattr(PipelineStrategyConfig, name) == params[name].default, name
