"""``nonfinite="error" | "skip"`` on 2 real gloo ranks under data, pipeline and tensor parallelism: a NaN loss
or an inf gradient (on one rank only) stops training with the value, the step, the rank, the stage and the
parameter; "skip" leaves every rank's weights unchanged at that step and trains on."""
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.multiprocessing.spawn import ProcessRaisedException
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, _full, seeded, trainer_kwargs
from models import corpus
from lightning_par import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_par.models import GPT

DATA = corpus()
PARAM = "blocks.1.mlp.fc.weight"  # on pipeline stage 1 of 2, column-sharded under tensor parallelism
STEP = 1


class Poisoned(GPT):
    """At global step ``STEP``: ``kind="loss"``: the loss is NaN on every rank; ``kind="grad"``: rank 1 adds
    inf to the gradient of ``PARAM`` after backward (the other rank's gradients stay finite); ``kind="hook"``:
    rank 1's backward makes that gradient inf (before DDP averages it: every replica receives the inf)."""

    def __init__(self, kind: str):
        super().__init__(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16, warmup_steps=1,
                         lr_decay_steps=10)
        self.kind = kind

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.kind == "hook" and self.trainer.global_step == STEP and self.global_rank == 1:
            self.hook = dict(self.named_parameters())[PARAM].register_hook(lambda g: g + float("inf"))
        return loss * float("nan") if self.kind == "loss" and self.trainer.global_step == STEP else loss

    def on_after_backward(self):
        if getattr(self, "hook", None) is not None:  # this step only
            self.hook = self.hook.remove()
        if self.kind == "grad" and self.trainer.global_step == STEP and self.global_rank == 1:
            with torch.no_grad():
                dict(self.named_parameters())[PARAM].grad.add_(float("inf"))


class Snapshots(pl.Callback):
    """Every rank's parameters (full tensors) after every training batch, and the steps the strategy skipped."""

    def __init__(self, out_dir):
        self.out_dir, self.params, self.losses = out_dir, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # (a pipeline stage's parameters of other stages' ends are meta: it holds nothing there)
        self.params.append({n: _full(p) for n, p in pl_module.named_parameters() if not p.is_meta})
        self.losses.append(float(_full(outputs["loss"] if isinstance(outputs, dict) else outputs)))

    def on_fit_end(self, trainer, pl_module):
        torch.save({"params": self.params, "losses": self.losses, "skipped": trainer.strategy.skipped_steps,
                    "global_step": trainer.global_step}, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def strategy(name: str, **kw):
    if name == "dp":
        return DataParallelStrategy(start_method="fork", timeout=60, **kw)
    if name == "pp":
        return PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, start_method="fork", timeout=60, **kw)
    return TensorParallelStrategy(tensor_parallel_size=2, start_method="fork", timeout=60, **kw)


def fit(name: str, kind: str, out_dir=None, steps: int = 3, **strategy_kw):
    callbacks = [Snapshots(out_dir)] if out_dir else []
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy(name, **strategy_kw), devices=2, max_steps=steps,
                                          callbacks=callbacks))
    trainer.fit(seeded(lambda: Poisoned(kind)), DataLoader(DATA.train_set, batch_size=4))


STAGES = {"dp": "pipeline stage 0 of 1", "pp": "pipeline stage 1 of 2", "tp": "pipeline stage 0 of 1"}


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", ["dp", "pp", "tp"])
def test_a_nan_loss_stops_training_naming_step_rank_and_stage(name):
    # DP: each replica's own loss; PP: the loss exists on the last stage (rank 1); TP: both ranks compute it
    rank = "rank 1" if name == "pp" else "rank 0"
    with pytest.raises(ProcessRaisedException) as info:
        fit(name, "loss")
    text = str(info.value)
    assert "NonFiniteError: Non-finite values at global step 1 (epoch 0)" in text
    assert f"loss is nan on {rank} ({STAGES[name]})" in text
    assert "gradient of `" in text and "is nan" in text  # a NaN loss reaches the gradients too
    assert 'nonfinite="skip"' in text


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", ["dp", "pp", "tp"])
def test_an_inf_gradient_on_one_rank_stops_every_rank_naming_the_parameter(name):
    with pytest.raises(ProcessRaisedException) as info:
        fit(name, "grad")
    text = str(info.value)
    assert "Non-finite values at global step 1 (epoch 0)" in text
    assert f"gradient of `{PARAM}` is inf on rank 1 ({STAGES[name]})" in text
    assert "on rank 0" not in text  # rank 0 found nothing, and stopped with rank 1


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", ["dp", "pp", "tp"])
def test_skip_leaves_every_rank_unchanged_at_that_step_and_trains_on(tmp_path, name):
    fit(name, "grad", out_dir=str(tmp_path), steps=4, nonfinite="skip")
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rec in records:
        assert rec["skipped"] == [STEP] and rec["global_step"] == 4
        assert len(rec["params"]) == 4 and all(torch.isfinite(torch.tensor(rec["losses"])))
        for step in range(4):
            changed = [n for n in rec["params"][step]
                       if not torch.equal(rec["params"][step][n], (rec["params"][step - 1] if step else {})
                                          .get(n, torch.full_like(rec["params"][step][n], float("nan"))))]
            if step == STEP:
                assert changed == [], f"step {step} changed {changed}"
            else:
                assert changed, f"step {step} changed nothing"
            for p in rec["params"][step].values():
                assert torch.isfinite(p).all()
    if name != "pp":  # replicas (DP) and gathered shards (TP) hold the same weights on both ranks
        for n, p in records[0]["params"][-1].items():
            torch.testing.assert_close(records[1]["params"][-1][n], p, atol=0, rtol=0)


@pytest.mark.timeout(TIMEOUT_S)
def test_under_16_mixed_the_scaler_skips_inf_gradients_itself(tmp_path):
    # the GradScaler finds the inf, skips the step and lowers the scale; nonfinite="error" must not stop it
    precision = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy("dp"), devices=2, max_steps=3, plugins=[precision],
                                          callbacks=[Snapshots(str(tmp_path))]))
    trainer.fit(seeded(lambda: Poisoned("hook")), DataLoader(DATA.train_set, batch_size=4))
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rec in records:
        assert rec["skipped"] == [] and rec["global_step"] == 3
        before, at = rec["params"][STEP - 1], rec["params"][STEP]
        assert all(torch.equal(before[n], at[n]) for n in at)  # the scaler skipped that step
    for n, p in records[0]["params"][-1].items():
        torch.testing.assert_close(records[1]["params"][-1][n], p, atol=0, rtol=0)
