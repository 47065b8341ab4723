"""DataParallelStrategy(sync="local_sgd" | "diloco") on 2 real gloo ranks (fork start): against every-step DP,
against each other, against a hand-written one-process reference of the algorithm, resumed from its checkpoint,
and the bytes each step communicates.

The hand references train a small regression MLP on the batches each rank recorded (so the reference needs no
knowledge of Lightning's sampler): the two replicas step with their own SGD (momentum 0.9), and at every H-th step
they are averaged (local SGD) or stepped by Nesterov SGD on their mean parameter change (DiLoCo), written out
below without torch's optimizer.
"""
import contextlib
import copy
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from harness import TIMEOUT_S, assert_resumed_exactly, fit_and_record, fit_whole_then_resumed, seeded
from models import GPT_SIZES, corpus, sgd_gpt, warm_gpt
from lightning_par import DataParallelStrategy
from lightning_par.comm import CommCounter, count_comm
from lightning_par.models import GPT
from lightning_par.strategies.hybrid_parallel import SYNC_KEY

TOL = dict(atol=1e-5, rtol=1e-5)


class Regression(pl.LightningModule):
    LR, MOMENTUM = 0.05, 0.9

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.LR, momentum=self.MOMENTUM)


def regression_data(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])).tanh() + 0.1 * torch.randn(n, 1, generator=g))


class Batches(pl.Callback):
    """Each rank's training batches, saved to ``<dir>/batches<rank>.pt`` at the end of fit."""

    def __init__(self, out_dir):
        self.out_dir, self.batches = out_dir, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([t.clone() for t in batch])

    def on_fit_end(self, trainer, pl_module):
        torch.save(self.batches, os.path.join(self.out_dir, f"batches{trainer.global_rank}.pt"))


def ours(**kw):
    return DataParallelStrategy(start_method="fork", **kw)


def fit_two(tmp, name, strategy, model=warm_gpt, data=None, per_rank=4, max_steps=4, callbacks=(), **kw):
    train = data if data is not None else corpus().train_set
    out = str(tmp / name)
    os.makedirs(out, exist_ok=True)
    return fit_and_record(seeded(model), DataLoader(train, batch_size=per_rank), out, strategy=strategy, devices=2,
                          max_steps=max_steps, callbacks=callbacks, **kw)


def assert_same_runs(got, expected, **tol):
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(e["losses"]), **tol)
        for name, p in e["params"].items():
            torch.testing.assert_close(g["params"][name], p, **tol, msg=lambda m: f"rank {e['rank']} {name}: {m}")


@pytest.mark.timeout(TIMEOUT_S)
def test_local_sgd_every_step_equals_every_step_data_parallel_under_sgd(tmp_path):
    """H = 1 with SGD: the mean of the replicas' steps is the step on the mean gradient (fp32 rounding apart)."""
    ddp = fit_two(tmp_path, "ddp", ours(), model=sgd_gpt)
    local = fit_two(tmp_path, "local", ours(sync="local_sgd", sync_every=1), model=sgd_gpt)
    assert_same_runs(local, ddp, **TOL)
    assert all(r["global_step"] == 4 for r in local)


@pytest.mark.timeout(TIMEOUT_S)
def test_diloco_with_outer_lr_one_and_no_momentum_is_local_sgd(tmp_path):
    """AdamW inside (its state stays each replica's own), H = 2, two syncs."""
    local = fit_two(tmp_path, "local", ours(sync="local_sgd", sync_every=2))
    diloco = fit_two(tmp_path, "diloco", ours(sync="diloco", sync_every=2, outer_lr=1.0, outer_momentum=0.0))
    assert_same_runs(diloco, local, **TOL)
    torch.testing.assert_close(local[0]["params"], local[1]["params"], atol=0, rtol=0)  # step 4 synced


def reference(sync, every, batches, start, outer_lr=0.7, outer_momentum=0.9):
    """The algorithm by hand on one process: losses per replica and the replicas' final parameters."""
    replicas = [copy.deepcopy(start) for _ in batches]
    inner = [torch.optim.SGD(m.parameters(), lr=Regression.LR, momentum=Regression.MOMENTUM) for m in replicas]
    theta = [p.detach().clone() for p in start.parameters()]
    buf = None
    losses = [[] for _ in batches]
    for step in range(len(batches[0])):
        for r, (m, opt) in enumerate(zip(replicas, inner)):
            x, y = batches[r][step]
            loss = F.mse_loss(m.net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[r].append(loss.item())
        if (step + 1) % every:
            continue
        local = [[p.detach().clone() for p in m.parameters()] for m in replicas]
        mean = [sum(ps) / len(ps) for ps in zip(*local)]
        if sync == "local_sgd":
            new = mean
        else:
            delta = [t - a for t, a in zip(theta, mean)]  # the mean pseudo-gradient
            buf = delta if buf is None else [outer_momentum * b + d for b, d in zip(buf, delta)]
            theta = [t - outer_lr * (d + outer_momentum * b) for t, d, b in zip(theta, delta, buf)]
            new = theta
        for m in replicas:
            with torch.no_grad():
                for p, v in zip(m.parameters(), new):
                    p.copy_(v)
    return losses, [dict(m.named_parameters()) for m in replicas]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("sync, every, steps", [("local_sgd", 4, 8), ("diloco", 3, 7)])
def test_against_the_algorithm_by_hand(tmp_path, sync, every, steps):
    """Local SGD at H = 4 (two syncs), DiLoCo at H = 3 with the paper's outer step, ending between syncs."""
    out = tmp_path / "run"
    os.makedirs(out)
    recs = fit_two(tmp_path, "run", ours(sync=sync, sync_every=every), model=Regression, data=regression_data(),
                   max_steps=steps, callbacks=[Batches(str(out))])
    batches = [torch.load(out / f"batches{r}.pt") for r in range(2)]
    losses, params = reference(sync, every, batches, seeded(Regression))
    for r, rec in enumerate(recs):
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(losses[r]), **TOL)
        for name, p in params[r].items():
            torch.testing.assert_close(rec["params"][name], p.detach(), **TOL, msg=lambda m: f"rank {r} {name}: {m}")
    if steps % every:  # ended between syncs: the replicas are apart
        assert not torch.equal(recs[0]["params"]["net.0.weight"], recs[1]["params"]["net.0.weight"])


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("dcp", [False, True], ids=["file", "dcp"])
def test_diloco_resumes_exactly_between_syncs(tmp_path, dcp):
    """4 steps an epoch, H = 3: the checkpoint of step 4 is one step past a sync; resumed, steps 5-8 are the
    uninterrupted run's, bit for bit, on both replicas."""
    data, kw = regression_data(32), dict(sync="diloco", sync_every=3, save_distributed_checkpoint=dcp)
    whole, resumed, path = fit_whole_then_resumed(fit_two, tmp_path, lambda: ours(**kw), model=Regression, data=data)
    if not dcp:
        state = torch.load(path, weights_only=False)[SYNC_KEY]
        assert (state["sync"], state["since"], len(state["ranks"])) == ("diloco", 1, 2)
        assert state["ranks"][0]["sync"]["outer"]["state"][0]["momentum_buffer"].abs().sum() > 0  # one outer step
    assert_resumed_exactly(whole, resumed, steps=8, resumed_at=4)
    assert not torch.equal(whole[0]["params"]["net.0.weight"], whole[1]["params"]["net.0.weight"])  # step 8: apart
    if not dcp:  # each rank resumes its own replica: another number of ranks is refused, naming both
        with pytest.raises(Exception, match=r"holds the replicas of a 2-rank sync='diloco' run; this run has 1 ranks"):
            fit_and_record(seeded(Regression), DataLoader(data, batch_size=4), str(tmp_path / "one"),
                           strategy=ours(**kw), devices=1, max_steps=-1, max_epochs=2, ckpt_path=path)


class StepBytes(pl.Callback):
    """Per training batch: the all-reduce payload bytes (all, and those inside backward) and whether the two
    replicas' parameters agree after it, saved to ``<dir>/bytes<rank>.pt``."""

    def __init__(self, out_dir):
        self.out_dir, self.rows, self.stack = out_dir, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counter = CommCounter()
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(count_comm(self.counter))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.stack.close()
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        both = trainer.strategy.all_gather(flat)  # outside the count
        periodic = trainer.strategy._engine.periodic
        self.rows.append({"all_reduce": self.counter.payload["all_reduce"],
                          "backward": self.counter.payload["all_reduce[bwd]"], "equal": bool(torch.equal(*both)),
                          "in_flight": sorted(periodic.pending) if periodic is not None else []})

    def on_fit_end(self, trainer, pl_module):
        torch.save(self.rows, os.path.join(self.out_dir, f"bytes{trainer.global_rank}.pt"))


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_bytes_per_step_nothing_but_the_nonfinite_flag_between_syncs(tmp_path):
    params = sum(p.numel() * 4 for p in warm_gpt().parameters())
    flag = 4  # the one-element non-finite flag (lightning_par.nonfinite), every step
    rows = {}
    for name, kw in {"every_step": {}, "local_sgd": dict(sync="local_sgd", sync_every=3),
                     "diloco": dict(sync="diloco", sync_every=3)}.items():
        out = tmp_path / name
        os.makedirs(out)
        fit_two(tmp_path, name, ours(**kw), max_steps=6, callbacks=[StepBytes(str(out))])
        rows[name] = [torch.load(out / f"bytes{r}.pt") for r in range(2)]
    for rank in range(2):
        ddp = rows["every_step"][rank]
        assert all(r["backward"] == params and r["all_reduce"] == flag and r["equal"] for r in ddp), ddp
        for name in ("local_sgd", "diloco"):
            got = rows[name][rank]
            synced = [step % 3 == 2 for step in range(6)]
            assert [r["backward"] for r in got] == [0] * 6, got  # no gradient all-reduce, ever
            assert [r["all_reduce"] for r in got] == [flag + (params if s else 0) for s in synced], got
            assert [r["equal"] for r in got] == synced, got  # hooks after a sync step see the synced model


@pytest.mark.timeout(TIMEOUT_S)
def test_sync_every_counts_optimizer_steps_under_gradient_accumulation(tmp_path):
    """accumulate_grad_batches=2, sync_every=2: 8 batches are 4 optimizer steps, synced after batches 4 and 8 (and
    apart after the batches that end an unsynced step, 2 and 6, until the next step)."""
    out = tmp_path / "acc"
    os.makedirs(out)
    recs = fit_two(tmp_path, "acc", ours(sync="local_sgd", sync_every=2), model=Regression, data=regression_data(),
                   max_steps=4, accumulate_grad_batches=2, callbacks=[StepBytes(str(out))])
    assert all(r["global_step"] == 4 for r in recs)
    for rank in range(2):
        rows = torch.load(out / f"bytes{rank}.pt")
        assert [r["equal"] for r in rows] == [True, False, False, True] * 2, rows
        assert [r["backward"] for r in rows] == [0] * 8  # accumulation or not: no gradient all-reduce


# -- streaming DiLoCo (fragments > 1): [Note: streaming DiLoCo] in lightning_par/dp/local_sgd.py ----------------
class MomentumGPT(GPT):
    """The reference GPT with SGD and momentum (each replica's inner state matters), no schedule."""

    LR, MOMENTUM = 0.3, 0.9

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.LR, momentum=self.MOMENTUM)


def momentum_gpt():
    return MomentumGPT(**GPT_SIZES)


def streaming_reference(batches, start, every, fragments, outer_lr=0.7, outer_momentum=0.9):
    """Streaming DiLoCo by hand on one process: the blocks cut in ``fragments`` ranges (the parameters before them
    with the first, after them with the last); fragment f synced at steps (f + 1) H / F + k H."""
    replicas = [copy.deepcopy(start) for _ in batches]
    inner = [torch.optim.SGD(m.parameters(), lr=MomentumGPT.LR, momentum=MomentumGPT.MOMENTUM) for m in replicas]
    names = [n for n, _ in start.named_parameters()]
    n_blocks = len(start.blocks)
    per = n_blocks // fragments

    def fragment(name):
        if name.startswith("blocks."):
            return min(int(name.split(".")[1]) // per, fragments - 1)
        return 0 if names.index(name) < names.index("blocks.0.ln_1.weight") else fragments - 1

    theta = {n: p.detach().clone() for n, p in start.named_parameters()}
    buf: dict = {}
    losses = [[] for _ in batches]
    for step in range(1, len(batches[0]) + 1):
        for r, (m, opt) in enumerate(zip(replicas, inner)):
            loss = m._loss(batches[r][step - 1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[r].append(loss.item())
        for f in range(fragments):
            if step < (f + 1) * every // fragments or (step - (f + 1) * every // fragments) % every:
                continue
            for n in (n for n in names if fragment(n) == f):
                mean = sum(dict(m.named_parameters())[n].detach() for m in replicas) / len(replicas)
                d = theta[n] - mean
                buf[n] = d if n not in buf else outer_momentum * buf[n] + d
                theta[n] = theta[n] - outer_lr * (d + outer_momentum * buf[n])
                for m in replicas:
                    with torch.no_grad():
                        dict(m.named_parameters())[n].copy_(theta[n])
    return losses, [{n: p.detach() for n, p in m.named_parameters()} for m in replicas]


@pytest.mark.timeout(TIMEOUT_S)
def test_streaming_diloco_against_the_algorithm_by_hand(tmp_path):
    """fragments=2, H = 4: fragment 0 (embeddings, block 0) synced at steps 2 and 6, fragment 1 (block 1, the
    head) at 4 and 8; the last one still in flight when training ends (finished at its end)."""
    out = tmp_path / "run"
    os.makedirs(out)
    recs = fit_two(tmp_path, "run", ours(sync="diloco", sync_every=4, fragments=2), model=momentum_gpt,
                   max_steps=8, callbacks=[Batches(str(out))])
    batches = [torch.load(out / f"batches{r}.pt") for r in range(2)]
    losses, params = streaming_reference(batches, seeded(momentum_gpt), every=4, fragments=2)
    for r, rec in enumerate(recs):
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(losses[r]), **TOL)
        for name, p in params[r].items():
            torch.testing.assert_close(rec["params"][name], p, **TOL, msg=lambda m: f"rank {r} {name}: {m}")
    # step 8 synced fragment 1 (block 1, the head): equal replicas there; fragment 0 stepped apart after step 6
    for name in recs[0]["params"]:
        same = torch.equal(recs[0]["params"][name], recs[1]["params"][name])
        assert same == (name.startswith("blocks.1.") or name.startswith(("ln_f.", "lm_head."))), name


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_streaming_diloco_resumes_exactly_with_a_fragment_in_flight(tmp_path):
    """2 steps an epoch, H = 4, 2 fragments: the checkpoint of step 2 is taken while fragment 0's sync is in
    flight (the save finishes it, as its next forward would); resumed, steps 3-8 are the uninterrupted run's."""
    kw = dict(sync="diloco", sync_every=4, fragments=2)
    whole, resumed, path = fit_whole_then_resumed(fit_two, tmp_path, lambda: ours(**kw), epochs=4, model=momentum_gpt,
                                                  data=corpus(train_sequences=16).train_set)
    state = torch.load(path, weights_only=False)[SYNC_KEY]
    assert (state["since"], state["ranks"][0]["sync"]["fragments"]) == (2, 2)
    assert_resumed_exactly(whole, resumed, steps=8, resumed_at=2)


@pytest.mark.timeout(TIMEOUT_S)
def test_streaming_diloco_sends_one_fragment_per_sync_step_and_overlaps_it(tmp_path):
    model = warm_gpt()
    names = [n for n, _ in model.named_parameters()]
    sizes = [0, 0]
    for n, p in model.named_parameters():
        f = (int(n.split(".")[1]) if n.startswith("blocks.") else
             0 if names.index(n) < names.index("blocks.0.ln_1.weight") else 1)
        sizes[f] += p.numel() * 4
    assert sizes[0] != sizes[1]
    out = tmp_path / "streaming"
    os.makedirs(out)
    fit_two(tmp_path, "streaming", ours(sync="diloco", sync_every=4, fragments=2), max_steps=8,
            callbacks=[StepBytes(str(out))])
    flag = 4  # the one-element non-finite flag, every step
    expected = {2: 0, 4: 1, 6: 0, 8: 1}  # step: the fragment it syncs
    for rank in range(2):
        rows = torch.load(out / f"bytes{rank}.pt")
        assert [r["backward"] for r in rows] == [0] * 8, rows
        assert [r["all_reduce"] for r in rows] == [flag + (sizes[expected[s]] if s in expected else 0)
                                                   for s in range(1, 9)], rows
        # the fragment's all-reduce is still in flight when its sync step ends (finished at its next forward)
        assert [r["in_flight"] for r in rows] == [[expected[s]] if s in expected else [] for s in range(1, 9)], rows
