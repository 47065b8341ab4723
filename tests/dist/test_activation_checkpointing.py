"""Activation checkpointing under every strategy on real gloo ranks (fork): with ``activation_checkpointing`` on,
every rank's losses, gradients and parameters equal the same layout's run without it (fp32, <= 1e-6: the same
arithmetic, recomputed), for the reference GPT with dropout 0.1 (the recompute draws the same masks), Hugging Face
Llama and T5 (two block stacks); a pipeline stage's blocks really run twice per micro-batch; a meta-built module
with ``weights=`` trains checkpointed; the Hydra app takes ``strategy.activation_checkpointing``."""
import functools
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, seeded
from models import CausalLM, corpus, gpt_factory, hf_model
from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                           TensorParallelStrategy)
from lightning_par.pipeline.ghost import Ghost

DATA = corpus(train_sequences=32)
STEPS = 2
EXACT = dict(atol=1e-6, rtol=0.0)

gpt = gpt_factory(n_layer=4, dropout=0.1)


class LitT5(pl.LightningModule):
    """T5 (an encoder and a decoder stack) as a user wraps it: its own loss from ``labels=``."""

    def __init__(self):
        super().__init__()
        self.model = hf_model("t5", vocab_size=32)

    def training_step(self, batch, batch_idx):
        src, tgt = batch
        # use_cache=False, as Hugging Face's own gradient checkpointing forces: a block that appends to a KV cache
        # would find its own entries there when it recomputes (docs/limitations.md)
        return self.model(input_ids=src, labels=tgt, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-6)


def llama():
    return CausalLM(hf_model("llama", num_hidden_layers=4), call={"use_cache": False})


MODELS = {"gpt": gpt, "llama": llama, "t5": LitT5}
LAYOUTS = {  # name: (strategy class, its keywords, devices)
    "one_device": (DataParallelStrategy, {}, 1),
    "dp2": (DataParallelStrategy, {}, 2),
    "dp2_zero3": (DataParallelStrategy, {"zero_stage": 3}, 2),
    "pp2_1f1b": (PipelineParallelStrategy, {"pipeline_parallel_size": 2, "microbatches": 4}, 2),
    "pp2_interleaved": (PipelineParallelStrategy, {"pipeline_parallel_size": 2, "microbatches": 4,
                                                   "schedule": "interleaved_1f1b", "stages_per_rank": 2}, 2),
    "pp2_zero_bubble": (PipelineParallelStrategy, {"pipeline_parallel_size": 2, "microbatches": 4,
                                                   "schedule": "zero_bubble"}, 2),
    "tp2": (TensorParallelStrategy, {"tensor_parallel_size": 2}, 2),
    "pp2_tp2": (HybridParallelStrategy, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2,
                                         "data_parallel_size": 1, "microbatches": 4}, 4),
}
_WITHOUT: dict = {}  # (model, layout): the records of the run without checkpointing, once per session


def fit(tmp_path, model: str, layout: str, ac, **kw) -> list[dict]:
    cls, options, devices = LAYOUTS[layout]
    # fork at one device too: a one-device fit in this process would leave its process group initialized here
    strategy = cls(activation_checkpointing=ac, start_method="fork", timeout=120, **options)
    return fit_and_record(seeded(MODELS[model]), DataLoader(DATA.train_set, batch_size=8),
                          str(tmp_path / f"{layout}-{ac}"), strategy=strategy, devices=devices, max_steps=STEPS, **kw)


def without(tmp_path, model: str, layout: str) -> list[dict]:
    if (model, layout) not in _WITHOUT:
        _WITHOUT[(model, layout)] = fit(tmp_path, model, layout, None)
    return _WITHOUT[(model, layout)]


def assert_equal_runs(expected: list[dict], got: list[dict]) -> None:
    """Rank by rank: every loss, every gradient the rank holds, every parameter (<= 1e-6)."""
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(e["losses"]), **EXACT)
        assert len(g["grads"]) == len(e["grads"]) == STEPS
        for step, (gg, ee) in enumerate(zip(g["grads"], e["grads"])):
            assert gg and set(gg) == set(ee), step
            for name in ee:
                torch.testing.assert_close(gg[name], ee[name], **EXACT, msg=lambda m: f"step {step} {name}: {m}")
        assert set(g["params"]) == set(e["params"])
        for name in e["params"]:
            torch.testing.assert_close(g["params"][name], e["params"][name], **EXACT, msg=lambda m: f"{name}: {m}")


CASES = [("gpt", "one_device", "full"), ("gpt", "dp2", "full"), ("gpt", "dp2", 2), ("gpt", "dp2", "selective"),
         ("gpt", "dp2_zero3", "full"), ("gpt", "pp2_1f1b", "full"), ("gpt", "pp2_1f1b", "selective"),
         ("gpt", "pp2_interleaved", "full"), ("gpt", "pp2_zero_bubble", "full"), ("gpt", "tp2", "full"),
         ("gpt", "tp2", "selective"), ("gpt", "pp2_tp2", "full"), ("llama", "pp2_1f1b", "full"),
         ("llama", "tp2", "full"), ("t5", "pp2_1f1b", "full"), ("t5", "tp2", "full")]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model,layout,ac", CASES, ids=[f"{m}-{l}-{a}" for m, l, a in CASES])
def test_checkpointed_run_equals_the_run_without(tmp_path, model, layout, ac):
    assert_equal_runs(without(tmp_path, model, layout), fit(tmp_path, model, layout, ac))
