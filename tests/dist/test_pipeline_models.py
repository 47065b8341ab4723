"""Pipeline parallelism on a tiny Hugging Face decoder (Qwen2, built from a config) and under bf16-mixed."""
import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, one_process_fit, reference_loader, seeded
from models import CausalLM, corpus, deep_gpt, hf_model
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy
from test_pipeline import assert_pipeline_matches

DATA = corpus()


class LitQwen2(CausalLM):
    """How a user wraps a Hugging Face causal LM: the model's own forward (rotary tables, causal mask,
    position ids computed before the decoder layers and passed to each), a tied lm head."""

    def __init__(self, use_cache=False):
        super().__init__(hf_model("qwen2", num_hidden_layers=4, tie_word_embeddings=True, use_cache=use_cache))


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("use_cache", [False, True])  # True: the model also fills a KV cache, layer by layer
def test_hugging_face_qwen2_decoder(tmp_path, use_cache):
    pytest.importorskip("transformers")
    factory = lambda: LitQwen2(use_cache)  # noqa: E731
    ref = one_process_fit(factory, DATA.train_set, 8, max_steps=2)
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "pp"),
                         strategy=PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2,
                                                           start_method="fork", timeout=120),
                         devices=2, max_steps=2)
    assert_pipeline_matches(ref, got)
    assert any(n.startswith("model.model.layers.3.") for n in got[1]["grads"][0])




@pytest.mark.timeout(TIMEOUT_S)
def test_bf16_mixed_equals_one_process_accumulating_the_same_microbatches(tmp_path):
    """Under bf16 autocast a micro-batch of 2 and a batch of 8 round differently, so the exact reference is
    one process running the same micro-batches as accumulation steps (4 × 2 samples per optimizer step)."""
    ref = one_process_fit(deep_gpt, DATA.train_set, 2, max_steps=2, accumulate_grad_batches=4, precision="bf16-mixed")
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "pp"),
                         strategy=PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=4,
                                                           start_method="fork", timeout=120),
                         devices=2, max_steps=2, precision="bf16-mixed")
    step_losses = torch.tensor(ref["losses"]).view(2, 4).sum(1)  # each recorded loss is divided by 4
    ref = {**ref, "losses": step_losses.tolist()}
    assert_pipeline_matches(ref, got)


class OverflowOnStageZero(pl.Callback):
    """At optimizer step 1 make one gradient that only the first stage holds infinite."""

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == 1:
            for name, p in pl_module.named_parameters():
                if name == "blocks.0.ln_1.weight" and p.grad is not None:
                    p.grad.fill_(float("inf"))


def fp16():
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))


@pytest.mark.timeout(TIMEOUT_S)
def test_16_mixed_one_loss_scale_skips_an_overflow_on_every_stage(tmp_path):
    """fp16 autocast + GradScaler (passed as a plugin: Lightning turns "16-mixed" into bf16 on CPU). The
    overflow at step 1 exists on stage 0 only; the step is skipped on both stages, as on one device."""
    ref = fit_and_record(seeded(deep_gpt), reference_loader(DATA.train_set, 2), str(tmp_path / "ref"),
                         max_steps=3, accumulate_grad_batches=4, plugins=[fp16()], callbacks=[OverflowOnStageZero()])[0]
    got = fit_and_record(seeded(deep_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "pp"),
                         strategy=PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=4,
                                                           start_method="fork", timeout=120),
                         devices=2, max_steps=3, plugins=[fp16()], callbacks=[OverflowOnStageZero()])
    assert torch.isinf(ref["grads"][1]["blocks.0.ln_1.weight"]).all()
    ref = {**ref, "losses": torch.tensor(ref["losses"]).view(-1, 4).sum(1).tolist()}
    assert len(ref["losses"]) == len(got[0]["losses"])
    assert_pipeline_matches(ref, got)
