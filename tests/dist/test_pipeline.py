"""PipelineParallelStrategy on real gloo ranks (fork) against one process on the same global batches:
losses on every rank, every gradient a stage holds, every parameter it owns (fp32, 1e-5)."""
import pytest
import torch
from torch.utils.data import DataLoader

from harness import (TIMEOUT_S, assert_close_records, fit_and_record, one_process_fit, seeded,
                     union_of_grad_names)
from models import corpus, deep_gpt
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy

DATA = corpus(val_sequences=16)




def pp(**kw):
    return PipelineParallelStrategy(start_method="fork", timeout=120, **kw)


def assert_pipeline_matches(ref: dict, got: list[dict], *, atol=1e-5, rtol=1e-5):
    """Every rank returns the true losses; each stage's gradients and owned parameters equal the reference;
    together the stages hold a gradient for every parameter."""
    for rec in got:
        assert_close_records(ref, {**rec, "params": {n: rec["params"][n] for n in rec["grads"][-1]}},
                             atol=atol, rtol=rtol, require_all_grads=False)
    assert union_of_grad_names(got) == union_of_grad_names([ref])


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("schedule,balance", [("gpipe", "time"), ("1f1b", "params"), ("zero_bubble", "params")])
def test_two_stages_match_one_process(tmp_path, schedule, balance):
    ref = one_process_fit(deep_gpt, DATA.train_set, 8)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "pp"),
                         strategy=pp(pipeline_parallel_size=2, microbatches=4, schedule=schedule, balance=balance),
                         devices=2)
    assert len(got) == 2
    assert_pipeline_matches(ref, got)
    # the first stage holds the tied embedding and block 0-1, the last stage blocks 2-3 and the head
    assert any(n.startswith("blocks.0.") for n in got[0]["grads"][0])
    assert not any(n.startswith("blocks.0.") for n in got[1]["grads"][0])


@pytest.mark.timeout(TIMEOUT_S)
def test_accumulation_clipping_validation_and_partial_batches(tmp_path):
    """accumulate 2, clip at the global norm, validation (sanity check included) with sync_dist val_loss, a
    partial last training batch (64 = 5×12 + 4) and uneven validation micro-batches (16 = 6 + 6 + 4)."""
    settings = dict(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05, limit_val_batches=3,
                    val_check_interval=4, num_sanity_val_steps=1)
    val = DataLoader(DATA.val_set, batch_size=6)
    ref = one_process_fit(deep_gpt, DATA.train_set, 12, val_loader=val, **settings)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=12), str(tmp_path / "pp"),
                         strategy=pp(pipeline_parallel_size=2, microbatches=4), devices=2, val_loader=val, **settings)
    assert len(ref["losses"]) == 6 and len(ref["grads"]) == 3
    assert_pipeline_matches(ref, got)
    assert {"val_loss", "train_loss"} <= set(ref["metrics"])
    for rec in got:
        assert rec["metrics"].keys() == ref["metrics"].keys()
        for k, v in ref["metrics"].items():
            assert rec["metrics"][k] == pytest.approx(v, abs=1e-5), k


@pytest.mark.timeout(300)
def test_four_stages_1f1b(tmp_path):
    ref = one_process_fit(deep_gpt, DATA.train_set, 8, max_steps=2)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "pp"),
                         strategy=pp(pipeline_parallel_size=4, microbatches=4, balance="uniform"), devices=4,
                         max_steps=2)
    assert len(got) == 4
    assert_pipeline_matches(ref, got)
    for stage, rec in enumerate(got):  # one block per stage
        assert {n.split(".")[1] for n in rec["grads"][0] if n.startswith("blocks.")} == {str(stage)}


@pytest.mark.timeout(300)
def test_two_stages_times_two_replicas(tmp_path):
    """Ranks (pp, dp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1); each replica sees half of the global batch of 8."""
    ref = one_process_fit(deep_gpt, DATA.train_set, 8, max_steps=2)
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "pp"),
                         strategy=pp(pipeline_parallel_size=2, data_parallel_size=2, microbatches=2), devices=4,
                         max_steps=2)
    assert len(got) == 4
    # gradients and parameters equal the global batch's; every rank returns and logs the global batch's loss
    assert_pipeline_matches(ref, got)
    for rec in got:
        assert rec["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], abs=1e-6)


class ArgBlock(torch.nn.Module):
    """A block called with a mask, a `None` positional, keyword tensors; returns (hidden, extra)."""

    def __init__(self, d):
        super().__init__()
        self.lin, self.gate = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x, mask, cache=None, *, pos, scale=1.0):
        assert cache is None
        h = torch.tanh(self.lin(x) + pos) * mask.unsqueeze(-1) * scale
        return x + self.gate(h), h.detach().sum()


class ArgLM(__import__("lightning").pytorch.LightningModule):
    """Blocks sliced (`self.layers[: self.used]`), extra args computed before the loop, a learned position
    table every block uses (its gradient comes from every stage), an untied head, logging with sync_dist."""

    def __init__(self, vocab=32, d=16, n=5, used=4):
        super().__init__()
        self.used = used
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(16, d) * 0.1)
        self.layers = torch.nn.ModuleList(ArgBlock(d) for _ in range(n))
        self.head = torch.nn.Linear(d, vocab)

    def training_step(self, batch, batch_idx):
        idx, y = batch
        mask = (idx % 5 != 0).float()
        x = self.emb(idx)
        for layer in self.layers[: self.used]:
            x = layer(x, mask, None, pos=self.pos[: idx.size(1)], scale=0.5)[0]
        loss = torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        self.log_dict({"masked": mask.mean()})
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_blocks_with_extra_args_kwargs_and_shared_parameter(tmp_path, schedule):
    ref = one_process_fit(ArgLM, DATA.train_set, 8)
    got = fit_and_record(seeded(ArgLM), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "pp"),
                         strategy=pp(pipeline_parallel_size=2, microbatches=2, blocks="layers", balance=[3, 2],
                                     schedule=schedule),
                         devices=2)
    assert_pipeline_matches(ref, got)
    assert "pos" in got[0]["grads"][0] and "pos" in got[1]["grads"][0]  # used by both stages, summed
    for rec in got:
        for k in ("train_loss", "masked"):
            assert rec["metrics"][k] == pytest.approx(ref["metrics"][k], abs=1e-6)


@pytest.mark.timeout(TIMEOUT_S)
def test_dropout_is_reproducible_across_schedules(tmp_path):
    """Dropout masks are seeded per (step, micro-batch, block): GPipe and 1F1B give identical runs."""
    loader = DataLoader(DATA.train_set, batch_size=8)
    runs = [fit_and_record(seeded(lambda: deep_gpt(dropout=0.2)), loader, str(tmp_path / s),
                           strategy=pp(pipeline_parallel_size=2, microbatches=4, schedule=s), devices=2)
            for s in ("gpipe", "1f1b")]
    for a, b in zip(*runs):
        assert_close_records(a, b, atol=0, rtol=0)
    no_dropout = one_process_fit(deep_gpt, DATA.train_set, 8)
    assert runs[0][0]["losses"][0] != pytest.approx(no_dropout["losses"][0], abs=1e-4)  # dropout is active


@pytest.mark.timeout(TIMEOUT_S)
def test_torchmetrics_validate_and_predict(tmp_path):
    """MLPClassifier logs torchmetrics Accuracy objects (train_acc per step, val_acc per epoch) and a
    sync_dist val_loss; callback metrics equal one process on every rank. Then `trainer.validate` and
    `trainer.predict` on their own run through the pipeline (uneven last batch: 40 = 3×12 + 4)."""
    import lightning.pytorch as pl

    from harness import trainer_kwargs
    from lightning_par.data import SyntheticClassification
    from lightning_par.models import MLPClassifier

    data = SyntheticClassification(in_features=8, num_classes=4, train_samples=48, val_samples=40)
    make = lambda: MLPClassifier(in_features=8, num_classes=4, width=16, depth=4)  # noqa: E731
    val = DataLoader(data.val_set, batch_size=12)
    settings = dict(max_steps=3, limit_val_batches=4, val_check_interval=3)
    ref = one_process_fit(make, data.train_set, 12, val_loader=val, **settings)
    got = fit_and_record(seeded(make), DataLoader(data.train_set, batch_size=12), str(tmp_path / "pp"),
                         strategy=pp(pipeline_parallel_size=2, microbatches=3), devices=2, val_loader=val, **settings)
    assert_pipeline_matches(ref, got)
    assert {"train_acc", "val_acc", "val_loss"} <= set(ref["metrics"])
    for rec in got:
        for k, v in ref["metrics"].items():
            assert rec["metrics"][k] == pytest.approx(v, abs=1e-5), k

    model = seeded(make)
    single = pl.Trainer(**trainer_kwargs(devices=1, limit_val_batches=1.0))
    expected_val = single.validate(model, val, verbose=False)
    expected_pred = torch.cat(single.predict(model, DataLoader(data.val_set.tensors[0], batch_size=12)))
    trainer = pl.Trainer(**trainer_kwargs(strategy=pp(pipeline_parallel_size=2, microbatches=4), devices=2,
                                          limit_val_batches=1.0))
    got_val = trainer.validate(model, val, verbose=False)
    assert set(expected_val[0]) == {"val_loss", "val_acc"}
    assert got_val[0] == pytest.approx(expected_val[0], abs=1e-5)
    trainer = pl.Trainer(**trainer_kwargs(strategy=pp(pipeline_parallel_size=2, microbatches=4), devices=2,
                                          callbacks=[SavePredictions(str(tmp_path))]))
    trainer.predict(model, DataLoader(data.val_set.tensors[0], batch_size=12), return_predictions=False)
    for rank in range(2):  # every rank of the pipeline returns the predictions
        got_pred = torch.cat(torch.load(tmp_path / f"pred{rank}.pt"))
        torch.testing.assert_close(got_pred, expected_pred, atol=1e-5, rtol=1e-5)


class SavePredictions(__import__("lightning").pytorch.Callback):
    def __init__(self, out_dir):
        self.out_dir, self.preds = out_dir, []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.preds.append(outputs.cpu())

    def on_predict_end(self, trainer, pl_module):
        torch.save(self.preds, f"{self.out_dir}/pred{trainer.global_rank}.pt")


@pytest.mark.timeout(TIMEOUT_S)
def test_interleaved_1f1b_two_chunks_per_rank_and_a_partial_last_batch(tmp_path):
    """4 blocks = 4 virtual stages: rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3. The third batch has 3
    samples (19 = 8 + 8 + 3): 3 micro-batches, not a multiple of 2, run in the looped-GPipe order."""
    from torch.utils.data import Subset

    train = Subset(DATA.train_set, range(19))
    ref = one_process_fit(deep_gpt, train, 8)
    got = fit_and_record(seeded(deep_gpt), DataLoader(train, batch_size=8), str(tmp_path / "pp"),
                         strategy=pp(pipeline_parallel_size=2, microbatches=4, schedule="interleaved_1f1b",
                                     stages_per_rank=2, balance="uniform"), devices=2)
    assert_pipeline_matches(ref, got)
    blocks = [{n.split(".")[1] for n in rec["grads"][0] if n.startswith("blocks.")} for rec in got]
    assert blocks == [{"0", "2"}, {"1", "3"}]


@pytest.mark.timeout(TIMEOUT_S)
def test_test_loop_through_the_pipeline(tmp_path):
    """`trainer.test` on its own (no fit): test_step's sync_dist test_loss equals one device's, with an
    uneven last batch (16 = 3 × 5 + 1)."""
    import lightning.pytorch as pl

    from harness import trainer_kwargs

    model = seeded(deep_gpt)
    loader = DataLoader(DATA.val_set, batch_size=5)
    expected = pl.Trainer(**trainer_kwargs(devices=1)).test(model, loader, verbose=False)
    got = pl.Trainer(**trainer_kwargs(devices=2, strategy=pp(pipeline_parallel_size=2, microbatches=2))).test(
        model, loader, verbose=False)
    assert set(expected[0]) == {"test_loss"}
    assert got[0]["test_loss"] == pytest.approx(expected[0]["test_loss"], abs=1e-5)
