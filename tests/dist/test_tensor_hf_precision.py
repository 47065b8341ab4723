"""TensorParallelStrategy on a tiny Hugging Face Qwen2 decoder built from a config (its base_model_tp_plan,
views with -1, Hugging Face SDPA attention, grouped-query heads) and under mixed precision."""
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_close_records, fit_and_record, reference_loader, seeded
from lightning_par.data import SyntheticCorpus
from lightning_par.models import GPT
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy

DATA = SyntheticCorpus(vocab_size=32, seq_len=16, train_sequences=32, val_sequences=8)


class QwenLM(pl.LightningModule):
    """How a user wraps a Hugging Face causal LM: nothing in it knows about parallelism."""

    def __init__(self, kv_heads=2):
        super().__init__()
        import transformers

        cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
                                       attn_implementation="sdpa")
        self.model = transformers.Qwen2ForCausalLM(cfg)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        # use_cache=False here; QwenWithLabels below calls the model the other usual way, KV cache included
        logits = self.model(input_ids=idx, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tp2(n=2, **kw):
    return TensorParallelStrategy(tensor_parallel_size=n, start_method="fork", timeout=120, **kw)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("plan", ["auto", "hf-globs-only", "auto+sequence_parallel", "auto+loss_parallel"])
def test_qwen2_matches_one_process(tmp_path, plan):
    pytest.importorskip("transformers")
    # "auto" takes the model's base_model_tp_plan; the explicit user plan below is that plan written out
    # by hand, proving that user globs alone reach the same result.
    user = "auto" if plan.startswith("auto") else {"model.model.layers.*.self_attn.[qkv]_proj": "colwise",
                                          "model.model.layers.*.self_attn.o_proj": "rowwise",
                                          "model.model.layers.*.mlp.gate_proj": "colwise",
                                          "model.model.layers.*.mlp.up_proj": "colwise",
                                          "model.model.layers.*.mlp.down_proj": "rowwise"}
    ref = fit_and_record(seeded(QwenLM), reference_loader(DATA.train_set, 4), str(tmp_path / "ref"), max_steps=2)[0]
    got = fit_and_record(seeded(QwenLM), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(plan=user, sequence_parallel=plan.endswith("sequence_parallel"),
                                      loss_parallel=plan.endswith("loss_parallel")), devices=2,
                         max_steps=2)
    for rec in got:
        assert_close_records(ref, rec)


@pytest.mark.timeout(TIMEOUT_S)
def test_qwen2_tp4_sequence_and_loss_parallel(tmp_path):
    pytest.importorskip("transformers")
    factory = lambda: QwenLM(kv_heads=4)  # noqa: E731  (4 key/value heads: divisible by tp=4)
    ref = fit_and_record(seeded(factory), reference_loader(DATA.train_set, 4), str(tmp_path / "ref"), max_steps=2)[0]
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(4, sequence_parallel=True, loss_parallel=True), devices=4, max_steps=2)
    for rec in got:
        assert_close_records(ref, rec)


def tiny_gpt():
    return GPT(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16, warmup_steps=1, lr_decay_steps=10)


@pytest.mark.timeout(TIMEOUT_S)
def test_bf16_mixed(tmp_path):
    ref = fit_and_record(seeded(tiny_gpt), reference_loader(DATA.train_set, 4), str(tmp_path / "ref"), max_steps=2,
                         precision="bf16-mixed")[0]
    got = fit_and_record(seeded(tiny_gpt), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(), devices=2, max_steps=2, precision="bf16-mixed")
    for rec in got:
        # losses and every gradient at bf16 precision
        assert_close_records({**ref, "params": {}}, {**rec, "params": {}}, atol=BF16_ATOL, rtol=BF16_RTOL)
        # parameters only within Adam's step bound: Adam divides each gradient element by its own running
        # RMS, so an element whose gradient is rounding noise (k_proj.bias: its exact gradient is 0, softmax
        # ignores it; measured ~1e-8 here) moves by O(lr) = 3e-3 per step in a direction set by the noise,
        # in either run. Seen: 9e-3 on blocks.1.attn.k_proj.bias after 2 steps; the bound is 4 lr.
        for name, p in rec["params"].items():
            torch.testing.assert_close(p, ref["params"][name], atol=4 * 3e-3, rtol=0)


# bf16 keeps 8 mantissa bits (relative rounding 2^-8 = 3.9e-3). A row-wise layer rounds each rank's partial
# product to bf16 before the all-reduce, one device rounds the whole product once: the results differ by
# a few bf16 ulps of the activations, i.e. ~1e-2 relative, where fp32 runs agree to 1e-5.
BF16_ATOL, BF16_RTOL = 2e-3, 3e-2


@pytest.mark.timeout(TIMEOUT_S)
def test_16_mixed_with_grad_scaler(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugins():  # Lightning would turn precision="16-mixed" into bf16 on CPU; pass fp16 AMP explicitly
        return [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=1024.0))]

    ref = fit_and_record(seeded(tiny_gpt), reference_loader(DATA.train_set, 4), str(tmp_path / "ref"), max_steps=2,
                         plugins=plugins(), gradient_clip_val=0.05)[0]
    got = fit_and_record(seeded(tiny_gpt), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(), devices=2, max_steps=2, plugins=plugins(), gradient_clip_val=0.05)
    for rec in got:
        # fp16 keeps 11 mantissa bits: the same argument as bf16, 8x tighter; gradients are still scaled
        # by 1024 when recorded, so compare them relative to their size
        assert_close_records({**ref, "params": {}}, {**rec, "params": {}}, atol=FP16_ATOL * 1024, rtol=FP16_RTOL)
        for name, p in rec["params"].items():
            torch.testing.assert_close(p, ref["params"][name], atol=4 * 3e-3, rtol=0)


FP16_ATOL, FP16_RTOL = 3e-4, 4e-3


class QwenWithLabels(QwenLM):
    """The other usual way to call a Hugging Face LM: labels in, loss out, and the config's default
    `use_cache=True`, so the model builds a KV cache that starts from an empty tensor (see tensor/attention.py)."""

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        out = self.model(input_ids=idx, labels=targets)
        self.log("train_loss", out.loss)
        return out  # a ModelOutput (a dict with "loss"), as Lightning accepts

    def configure_optimizers(self):
        # SGD: its update is linear in the gradients, so parameters inherit their 1e-5 agreement; AdamW's
        # g/sqrt(v) turns round-off on a near-zero gradient entry into a 1e-5-sized parameter difference
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(TIMEOUT_S)
def test_hugging_face_default_call_with_its_kv_cache(tmp_path):
    ref = fit_and_record(seeded(QwenWithLabels), reference_loader(DATA.train_set, 4), str(tmp_path / "ref"),
                         max_steps=2)[0]
    got = fit_and_record(seeded(QwenWithLabels), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(), devices=2, max_steps=2)
    for rec in got:
        assert_close_records(ref, rec)
