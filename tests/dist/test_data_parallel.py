"""DataParallelStrategy on 2 real gloo ranks (fork start) against Lightning's DDPStrategy and one process.

Every fit trains the reference GPT (width 16, 2 blocks, tied lm head, warmup + cosine LambdaLR) on the
synthetic Markov corpus; :func:`harness.reference_loader` gives the one-process run the same global
batches as the two ranks. Lightning's DDP and the one-process reference are fitted once per module.
"""
import json
import os

import pytest
from torch.multiprocessing.spawn import ProcessRaisedException
import torch
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from harness import (TIMEOUT_S, assert_close_records, assert_ranks_close, fit_and_record, fit_two_ranks,
                     one_process_fit, reference_loader, seeded)
from models import corpus, warm_gpt
from lightning_par import DataParallelStrategy
from lightning_par.dp.zero import optimizer_state_bytes
from lightning_par.models import GPT

PER_RANK = 4
STEPS = 6
EXACT = dict(atol=0.0, rtol=0.0)




def ours(**kw):
    return DataParallelStrategy(start_method="fork", **kw)


class StateBytes(Callback):
    """Writes the optimizer-state bytes this rank holds after training to ``<dir>/state<rank>.json``."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"state{trainer.global_rank}.json"), "w") as f:
            json.dump({"bytes": sum(optimizer_state_bytes(o) for o in trainer.optimizers)}, f)


def read_state_bytes(out_dir, ranks):
    out = []
    for r in range(ranks):
        with open(os.path.join(out_dir, f"state{r}.json")) as f:
            out.append(json.load(f)["bytes"])
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Lightning DDP (2 ranks) and one process on the same global batches, STEPS steps; the one-process
    run also reports its full optimizer-state bytes."""
    tmp = tmp_path_factory.mktemp("base")
    data = corpus()
    ref = fit_and_record(seeded(warm_gpt), reference_loader(data.train_set, 2 * PER_RANK), str(tmp / "ref"),
                         max_steps=STEPS, callbacks=[StateBytes(str(tmp / "ref"))])[0]
    ddp = fit_two_ranks(tmp, "ddp", DDPStrategy(start_method="fork"), max_steps=STEPS)
    return {"ref": ref, "ddp": ddp, "ref_state_bytes": read_state_bytes(str(tmp / "ref"), 1)[0]}


def assert_matches_one_process(ref, records, atol=1e-5):
    assert len(records) == 2
    mean_losses = torch.tensor([r["losses"] for r in records]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref["losses"]), atol=atol, rtol=atol)
    for rec in records:
        assert_close_records(ref, rec, losses=False, atol=atol, rtol=atol)


def first_step_grads_differ(a, b):
    return any(not torch.equal(a["grads"][0][n], b["grads"][0][n]) for n in a["grads"][0])


# -- plain: Lightning's DDP, bit for bit ------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT_S)
def test_default_is_lightning_ddp_bit_for_bit(tmp_path, base):
    got = fit_two_ranks(tmp_path, "ours", ours(), max_steps=STEPS)
    assert len(got) == 2
    assert_ranks_close(base["ddp"], got, **EXACT)      # losses, grads, params, callback metrics per rank
    assert {"train_loss", "val_loss"} <= got[0]["metrics"].keys()
    assert_matches_one_process(base["ref"], got)


# -- communication hooks ---------------------------------------------------------------------------

def assert_normwise_close(got, expected, unit_roundoff, floor):
    """Compressed all-reduce vs exact, per gradient tensor: ``||got - exp|| <= 2u ||exp|| + floor sqrt(n)``.
    Norm-wise, because an element whose two per-rank halves nearly cancel carries their rounding error,
    not its own; ``floor`` is the spacing below the format's normal range (fp16 flushes gradients
    under ~6e-5 to a grid of 2^-24)."""
    for name, exp in expected.items():
        err = float((got[name] - exp).norm())
        bound = 2 * unit_roundoff * float(exp.norm()) + floor * exp.numel() ** 0.5
        assert err <= bound, f"{name}: |error| {err:.3g} > {bound:.3g}"


def assert_hook_run(got, ddp, *, first_step, unit_roundoff, floor, loss_atol):
    assert len(got) == len(ddp) == 2
    for d, g in zip(ddp, got):
        # Step 0 starts from the same weights on the same data: only the compression differs.
        assert first_step_grads_differ(d, g), "the hook did not change any gradient: is it registered?"
        if first_step:
            assert_normwise_close(g["grads"][0], d["grads"][0], unit_roundoff, floor)
        # It trains like plain DDP: the losses track the uncompressed run's.
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(d["losses"]), rtol=0, atol=loss_atol)
    torch.testing.assert_close(got[0]["params"], got[1]["params"], **EXACT)  # replicas stay identical


@pytest.mark.timeout(TIMEOUT_S)
def test_fp16_hook_within_fp16_tolerance(tmp_path, base):
    got = fit_two_ranks(tmp_path, "fp16", ours(comm_hook="fp16"), max_steps=STEPS)
    assert_hook_run(got, base["ddp"], first_step=True, unit_roundoff=2.0**-11, floor=2.0**-24, loss_atol=1e-4)


@pytest.mark.timeout(TIMEOUT_S)
def test_bf16_hook_runs_on_gloo_and_trains(tmp_path, base):
    got = fit_two_ranks(tmp_path, "bf16", ours(comm_hook="bf16"), max_steps=STEPS)
    assert_hook_run(got, base["ddp"], first_step=True, unit_roundoff=2.0**-8, floor=0.0, loss_atol=1e-3)


@pytest.mark.timeout(TIMEOUT_S)
def test_powersgd_hook_compresses_from_start_iter_and_trains(tmp_path, base):
    # Small buckets: several buckets are in flight at once, whose PowerSGD collectives gloo must see in the
    # same order on every rank (see [Note: PowerSGD on gloo]).
    got = fit_two_ranks(tmp_path, "psgd", ours(comm_hook="powersgd", powersgd_rank=1, powersgd_start_iter=2,
                                               bucket_cap_mb=0.004), max_steps=STEPS)
    ddp = base["ddp"]
    assert len(got) == len(ddp) == 2
    for d, g in zip(ddp, got):
        for step in (0, 1):                        # before start_iter PowerSGD runs the plain all-reduce
            for n, ref_grad in d["grads"][step].items():
                torch.testing.assert_close(g["grads"][step][n], ref_grad, **EXACT)
        matrices = [n for n, t in d["grads"][2].items() if t.dim() == 2]
        assert any(not torch.allclose(g["grads"][2][n], d["grads"][2][n], atol=1e-4) for n in matrices), \
            "step 2 gradients equal plain DDP's: PowerSGD did not compress"
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(d["losses"]), rtol=0, atol=2e-2)
    torch.testing.assert_close(got[0]["params"], got[1]["params"], **EXACT)


# -- ZeRO-1 ----------------------------------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT_S)
def test_zero1_equals_ddp_and_halves_optimizer_state(tmp_path, base):
    got = fit_two_ranks(tmp_path, "zero", ours(zero_stage=1), callbacks=[StateBytes(str(tmp_path / "zero"))], max_steps=STEPS)
    assert_ranks_close(base["ddp"], got, atol=1e-5, rtol=1e-5)
    assert_matches_one_process(base["ref"], got)
    full = base["ref_state_bytes"]
    per_rank = read_state_bytes(str(tmp_path / "zero"), 2)
    # ZeRO partitions whole parameters greedily by size, so the halves are close, not exact.
    assert sum(per_rank) == full, (per_rank, full)
    for b in per_rank:
        assert 0.4 <= b / full <= 0.6, (per_rank, full)


@pytest.mark.timeout(TIMEOUT_S)
def test_zero1_checkpoint_is_consolidated_and_resumes(tmp_path):
    # One global batch per epoch (8 sequences = 2 ranks x 4), checkpoint after step 4. Lightning restarts
    # a non-stateful dataloader from the start of its epoch after a mid-epoch (or epoch-end callback)
    # checkpoint, which changes the data order of any strategy; with one batch per epoch the resumed run
    # sees exactly the batches the uninterrupted run saw, so the comparison can be exact.
    data = corpus(train_sequences=2 * PER_RANK)
    full = fit_two_ranks(tmp_path, "full", ours(zero_stage=1), max_steps=8, data=data, validate=False)
    ckpt_dir = tmp_path / "ckpt"
    fit_two_ranks(tmp_path, "first", ours(zero_stage=1), max_steps=4, data=data, validate=False,
                  enable_checkpointing=True,
                  callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir), filename="step4", every_n_train_steps=4,
                                             save_on_train_epoch_end=False)])
    path = str(ckpt_dir / "step4.ckpt")
    ckpt = torch.load(path, weights_only=True)               # plain content
    n_params = len(list(seeded(warm_gpt).parameters()))
    opt_state = ckpt["optimizer_states"][0]
    assert sorted(opt_state["state"]) == list(range(n_params))  # every parameter's state, not a shard
    assert len(opt_state["param_groups"]) == 2

    resumed = fit_two_ranks(tmp_path, "resumed", ours(zero_stage=1), max_steps=8, data=data, validate=False,
                            ckpt_path=path)
    assert len(full) == len(resumed) == 2
    for f, r in zip(full, resumed):
        assert r["global_step"] == 8
        assert len(r["grads"]) == 4
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(f["losses"][4:]), **EXACT)
        for step, grads in enumerate(r["grads"]):
            for n, grad in grads.items():
                torch.testing.assert_close(grad, f["grads"][4 + step][n], **EXACT)
        torch.testing.assert_close(r["params"], f["params"], **EXACT)

    # The consolidated state loads into a plain optimizer on one device and continues the same run.
    single = fit_and_record(seeded(warm_gpt), reference_loader(data.train_set, 2 * PER_RANK),
                            str(tmp_path / "single"), max_steps=8, ckpt_path=path)[0]
    assert single["global_step"] == 8
    for name, p in full[0]["params"].items():
        torch.testing.assert_close(single["params"][name], p, atol=1e-5, rtol=1e-5)
    assert isinstance(GPT.load_from_checkpoint(path), GPT)


# -- accumulation -----------------------------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT_S)
def test_two_ranks_accumulate_two_equals_one_process(tmp_path):
    data = corpus()
    # Optimizer step j: each rank takes its loader batches 2j and 2j+1 of 2 samples; together these are
    # exactly the one-process step-j batch of 8 of the same sampler (see harness.reference_loader).
    ref = one_process_fit(warm_gpt, data.train_set, 8)
    got = fit_two_ranks(tmp_path, "acc", ours(), max_steps=3, per_rank=2, accumulate_grad_batches=2, data=data)
    # The loss a callback sees under accumulation is divided by k: the step's loss is the sum over the
    # k micro-batches of the mean over ranks.
    per_micro = torch.tensor([r["losses"] for r in got]).mean(0)
    torch.testing.assert_close(per_micro.view(-1, 2).sum(1), torch.tensor(ref["losses"]), atol=1e-5, rtol=1e-5)
    for rec in got:
        assert_close_records(ref, rec, losses=False)


# -- learning-rate scaling --------------------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_linear_lr_scaling_scales_scheduler_base_lrs_and_logs(tmp_path, zero_stage):
    data = corpus()
    lr = 3e-3
    # Two ranks of 4 -> global batch 8 = 2 x the one-device batch: factor 2. The one-process reference
    # is configured with 2 x lr; its LambdaLR derives every later lr from that base, so the parallel run
    # matches it only if the scheduler's base_lrs were scaled too (a scaled group["lr"] alone is undone
    # at the first scheduler step, and the warmup makes every step's lr different).
    ref = fit_and_record(seeded(lambda: warm_gpt(lr=2 * lr)), reference_loader(data.train_set, 8),
                         str(tmp_path / "ref"))[0]
    logger = CSVLogger(str(tmp_path / "logs"), name="run", version=0)
    # (Under zero_stage=1 the scheduler drives the ZeroRedundancyOptimizer that replaced the user's.)
    got = fit_two_ranks(tmp_path, "scaled", ours(lr_scaling="linear", zero_stage=zero_stage), max_steps=3,
                        model=lambda: warm_gpt(lr=lr), data=data, logger=logger)
    assert_matches_one_process(ref, got)
    with open(tmp_path / "logs" / "run" / "version_0" / "hparams.yaml") as f:
        assert yaml.safe_load(f)["lr_scale_factor"] == 2.0


@pytest.mark.timeout(TIMEOUT_S)
def test_lr_scaling_without_batch_size_is_refused(tmp_path):
    data = corpus()
    batches = [list(range(i, i + 4)) for i in range(0, 32, 4)]     # a batch sampler that states no size
    loader = DataLoader(data.train_set, batch_sampler=batches)
    with pytest.raises(ProcessRaisedException, match=r"ValueError: `lr_scaling='linear'` needs the per-device batch size"):
        fit_and_record(seeded(warm_gpt), loader, str(tmp_path / "x"), strategy=ours(lr_scaling="linear"),
                       devices=2, max_steps=1, use_distributed_sampler=False)
