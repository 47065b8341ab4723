"""Checkpoints under pipeline parallelism: one consolidated file that the unchanged module loads on one
device (strict), and a resume under the same layout that continues exactly like the uninterrupted run."""
import glob
import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Subset

from harness import TIMEOUT_S, fit_and_record, reference_loader, seeded
from models import corpus, deep_gpt
from test_pipeline import assert_pipeline_matches
from lightning_par.models import GPT
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy

TRAIN = Subset(corpus(train_sequences=16).train_set, range(16))




def pp():
    return PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, start_method="fork", timeout=120)


def run(tmp, name, loader, max_steps, ckpt_path=None, **kw):
    """Fit with a checkpoint at every epoch end (2 steps per epoch)."""
    ckpt = ModelCheckpoint(dirpath=str(tmp / name / "ckpt"), save_top_k=-1, every_n_epochs=1)
    recs = fit_and_record(seeded(deep_gpt), loader, str(tmp / name), max_steps=max_steps, callbacks=[ckpt],
                          enable_checkpointing=True, ckpt_path=ckpt_path, **kw)
    return recs, sorted(glob.glob(str(tmp / name / "ckpt" / "*.ckpt")))


@pytest.mark.timeout(TIMEOUT_S)
def test_consolidated_checkpoint_and_exact_resume(tmp_path):
    ref, ref_ckpts = run(tmp_path, "ref", reference_loader(TRAIN, 8), 4)
    full, ckpts = run(tmp_path, "pp", DataLoader(TRAIN, batch_size=8), 4, strategy=pp(), devices=2)
    assert [os.path.basename(c) for c in ckpts] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]

    # 1. the file holds the whole model under its own names: strict load into the unchanged module, one device
    for mine, theirs in zip(ckpts, ref_ckpts):
        torch.load(mine, weights_only=True)  # plain tensors and containers only
        model = GPT.load_from_checkpoint(mine, strict=True, map_location="cpu")
        expected = torch.load(theirs, weights_only=True)["state_dict"]
        assert model.state_dict().keys() == expected.keys()
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, expected[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")

    # 2. resuming from step 2 under the same layout continues exactly as one device resuming from its own
    #    step-2 file. (Lightning 2.6 itself does not replay the uninterrupted run's batch order after an
    #    epoch-end checkpoint: on one device too, the second resumed batch differs; only the first matches.)
    ref_resumed, _ = run(tmp_path, "ref_resumed", reference_loader(TRAIN, 8), 4, ckpt_path=ref_ckpts[0])
    resumed, _ = run(tmp_path, "resumed", DataLoader(TRAIN, batch_size=8), 4, ckpt_path=ckpts[0],
                     strategy=pp(), devices=2)
    assert ref_resumed[0]["global_step"] == 4 and len(ref_resumed[0]["losses"]) == 2
    assert_pipeline_matches(ref_resumed[0], resumed)
    for whole, part in zip(full, resumed):  # the first resumed step is the uninterrupted run's third, bit for bit
        assert part["losses"][0] == whole["losses"][2]
        for n, g in part["grads"][0].items():
            assert torch.equal(g, whole["grads"][2][n]), n


@pytest.mark.timeout(TIMEOUT_S)
def test_resume_continues_exactly_as_the_uninterrupted_run(tmp_path):
    """With one batch per epoch every checkpoint sits where Lightning restarts the data, so the resumed
    pipeline run must reproduce the uninterrupted one step for step."""
    one_batch = Subset(TRAIN.dataset, range(8))
    full, ckpts = run(tmp_path, "pp", DataLoader(one_batch, batch_size=8), 4, strategy=pp(), devices=2)
    assert os.path.basename(ckpts[1]) == "epoch=1-step=2.ckpt"
    resumed, _ = run(tmp_path, "resumed", DataLoader(one_batch, batch_size=8), 4, ckpt_path=ckpts[1],
                     strategy=pp(), devices=2)
    for whole, part in zip(full, resumed):
        assert part["global_step"] == 4 and part["losses"] == whole["losses"][2:]
        for step in range(2):
            assert part["grads"][step].keys() == whole["grads"][2 + step].keys()
            for n, g in part["grads"][step].items():
                assert torch.equal(g, whole["grads"][2 + step][n]), (step, n)


@pytest.mark.timeout(TIMEOUT_S)
def test_sharded_checkpoint_resumes_exactly_and_under_another_layout(tmp_path):
    """`save_distributed_checkpoint=True`: each stage writes its own part of a torch.distributed.checkpoint
    directory, keyed by the module's names; resuming under the same layout reproduces the uninterrupted
    run bit for bit, and the same directory resumes a 4-stage pipeline too."""
    one_batch = Subset(TRAIN.dataset, range(8))

    def sharded(size=2):
        return PipelineParallelStrategy(pipeline_parallel_size=size, microbatches=2, start_method="fork", timeout=120,
                                        save_distributed_checkpoint=True)

    full, _ = run(tmp_path, "pp", DataLoader(one_batch, batch_size=8), 4, strategy=pp(), devices=2)
    _, dirs = run(tmp_path, "dcp", DataLoader(one_batch, batch_size=8), 2, strategy=sharded(), devices=2)
    dirs = sorted(glob.glob(str(tmp_path / "dcp" / "ckpt" / "*")))
    assert os.path.basename(dirs[-1]) == "epoch=1-step=2.ckpt" and os.path.isdir(dirs[-1])
    assert glob.glob(os.path.join(dirs[-1], "*.distcp")) and os.path.isfile(os.path.join(dirs[-1], ".metadata"))

    resumed, _ = run(tmp_path, "resumed", DataLoader(one_batch, batch_size=8), 4, ckpt_path=dirs[-1],
                     strategy=sharded(), devices=2)
    for whole, part in zip(full, resumed):
        assert part["global_step"] == 4 and part["losses"] == whole["losses"][2:]
        for step in range(2):
            for n, g in part["grads"][step].items():
                assert torch.equal(g, whole["grads"][2 + step][n]), (step, n)

    four, _ = run(tmp_path, "four", DataLoader(one_batch, batch_size=8), 4, ckpt_path=dirs[-1],
                  strategy=sharded(4), devices=4)
    for part in four:
        assert part["global_step"] == 4
        assert part["losses"] == pytest.approx(full[0]["losses"][2:], abs=1e-5)
    trained = four[0]["grads"][-1].keys()  # the first stage's block and embeddings (other copies stay stale)
    assert "blocks.0.attn.q_proj.weight" in trained
    for n in trained:
        torch.testing.assert_close(four[0]["params"][n], full[0]["params"][n], atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.timeout(TIMEOUT_S)
def test_sharded_checkpoint_with_data_parallel_replicas(tmp_path):
    """2 stages × 2 replicas: the first replica writes the directory, every rank reads it back."""
    data = Subset(TRAIN.dataset, range(16))

    def layout(sharded):
        return PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, start_method="fork", timeout=120,
                                        save_distributed_checkpoint=sharded)

    full, _ = run(tmp_path, "pp", DataLoader(data, batch_size=8), 4, strategy=layout(False), devices=4)
    _, dirs = run(tmp_path, "dcp", DataLoader(data, batch_size=8), 2, strategy=layout(True), devices=4)
    assert os.path.basename(dirs[-1]) == "epoch=1-step=2.ckpt"
    resumed, _ = run(tmp_path, "resumed", DataLoader(data, batch_size=8), 4, ckpt_path=dirs[-1],
                     strategy=layout(True), devices=4)
    for whole, part in zip(full, resumed):
        assert part["global_step"] == 4 and part["losses"] == whole["losses"][2:]
        for n, g in part["grads"][-1].items():
            assert torch.equal(g, whole["grads"][-1][n]), n
