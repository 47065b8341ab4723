"""Families that escaped before the setup check, each as a user wraps it (tiny Hugging Face configs, no downloads),
against one process on the same global batches (fp32, 1e-5, 8 steps): StarCoder2 (biases on every projection, a
GELU MLP, a sliding window shorter than the sequence) under TP 2 with AdamW and with plain SGD, its projections
sharded; Bloom (a fused, head-interleaved ``query_key_value``, ALiBi) under TP 2; T5 with its default
``use_cache=True`` under TP 2 and activation checkpointing; GPT-OSS (sinks, sliding window, experts) under a 1F1B
pipeline with selective activation checkpointing."""
import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_close_records, fit_and_record, one_process_fit, seeded
from models import CausalLM
from lightning_par.data import SyntheticCorpus
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from test_pipeline import assert_pipeline_matches

transformers = pytest.importorskip("transformers")

DATA = SyntheticCorpus(vocab_size=64, seq_len=16, train_sequences=64, val_sequences=8)
STEPS = 8
MATCHES = "sharded copy matches the whole one"
_SPECIAL = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def starcoder2(**extra):
    return transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_bias=True, sliding_window=8, **_SPECIAL, **extra))


class SgdLM(CausalLM):
    """Plain SGD: a gradient off by a constant factor cannot hide behind Adam's normalization."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def starcoder2_adamw():
    return CausalLM(starcoder2())


def starcoder2_sgd():
    return SgdLM(starcoder2())


def bloom():
    return CausalLM(transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=64, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0, **_SPECIAL)))


class T5LM(pl.LightningModule):
    """T5 called the usual way (its own loss, its default use_cache=True)."""

    def __init__(self):
        super().__init__()
        self.model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return self.model(input_ids=inputs, labels=targets).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def t5():
    return T5LM()


def gpt_oss():
    return CausalLM(transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_SPECIAL)))


class PlanRecorder(pl.Callback):
    def __init__(self, path):
        self.path = path

    def on_fit_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            plan = trainer.strategy.plan
            torch.save({"styles": plan.styles, "checked": plan.checked}, self.path)


def run_against_one_process(tmp_path, factory, strategy, batch_size=4, steps=STEPS):
    ref = one_process_fit(factory, DATA.train_set, batch_size, max_steps=steps)
    plan_file = tmp_path / "plan.pt"
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=batch_size), str(tmp_path / "run"),
                         strategy=strategy, devices=2, max_steps=steps,
                         callbacks=[PlanRecorder(str(plan_file))] if isinstance(strategy, TensorParallelStrategy)
                         else [])
    assert len(got) == 2 and len(ref["losses"]) == steps
    if isinstance(strategy, PipelineParallelStrategy):
        assert_pipeline_matches(ref, got)  # each stage its own parameters
    else:
        for rec in got:
            assert_close_records(ref, rec)
    return torch.load(plan_file, weights_only=False) if plan_file.exists() else None


def tp2(**kw):
    return TensorParallelStrategy(tensor_parallel_size=2, start_method="fork", timeout=120, **kw)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("factory", [starcoder2_adamw, starcoder2_sgd], ids=["adamw", "sgd"])
def test_starcoder2_trains_with_its_projections_sharded(tmp_path, factory):
    plan = run_against_one_process(tmp_path, factory, tp2())
    layers = [f"model.model.layers.{i}" for i in range(2)]
    assert {n for n, s in plan["styles"].items() if s == "colwise"} == \
        {f"{b}.self_attn.{p}_proj" for b in layers for p in "qkv"} | {f"{b}.mlp.c_fc" for b in layers}
    assert {n for n, s in plan["styles"].items() if s == "rowwise"} == \
        {f"{b}.self_attn.o_proj" for b in layers} | {f"{b}.mlp.c_proj" for b in layers}
    # the attention (rotary tables, sliding-window mask) is checked on its recorded inputs, not trusted
    assert all(plan["checked"][f"{b}.{r}"] == MATCHES for b in layers for r in ("self_attn", "mlp"))


@pytest.mark.timeout(TIMEOUT_S)
def test_bloom_head_interleaved_fused_projection_trains(tmp_path):
    plan = run_against_one_process(tmp_path, bloom, tp2())
    for i in range(2):
        attn = f"model.transformer.h.{i}.self_attention"
        # split by whole heads (each rank q, k, v of its heads), not part by part
        assert plan["styles"][f"{attn}.query_key_value"] == "colwise"
        assert plan["styles"][f"{attn}.dense"] == "rowwise"
        assert plan["checked"][attn].startswith(MATCHES) and "interleaved head by head" in plan["checked"][attn]


@pytest.mark.timeout(TIMEOUT_S)
def test_t5_default_use_cache_under_activation_checkpointing(tmp_path):
    run_against_one_process(tmp_path, t5, tp2(activation_checkpointing=2), steps=3)


@pytest.mark.timeout(TIMEOUT_S)
def test_gpt_oss_1f1b_with_selective_activation_checkpointing(tmp_path):
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, schedule="1f1b", microbatches=4,
                                        activation_checkpointing="selective", start_method="fork", timeout=120)
    run_against_one_process(tmp_path, gpt_oss, strategy, batch_size=8, steps=3)


@pytest.mark.e2e
@pytest.mark.timeout(TIMEOUT_S)
def test_app_refuses_a_one_block_pipeline_with_the_numbers(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from harness import assert_one_usage_error

    repo = Path(__file__).resolve().parents[2]
    env = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "lightning_par.train", "strategy=pipeline", "model.n_layer=1",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S - 20)
    assert_one_usage_error(res.returncode, res.stdout, res.stderr, "lightning-par-train",
                           "the block stack `blocks` holds 1 block; pipeline_parallel_size=2 needs at least 2")
