"""TensorParallelStrategy on a tiny Hugging Face Qwen2 decoder built from a config (its base_model_tp_plan,
views with -1, Hugging Face SDPA attention, grouped-query heads) and under mixed precision."""
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_close_records, fit_and_record, one_process_fit, reference_loader, seeded
from models import CausalLM, corpus, gpt_factory, hf_model
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy

DATA = corpus(train_sequences=32)


class QwenLM(CausalLM):
    """How a user wraps a Hugging Face causal LM: nothing in it knows about parallelism."""

    def __init__(self, kv_heads=2):
        # use_cache=False here; QwenWithLabels below calls the model the other usual way, KV cache included
        super().__init__(hf_model("qwen2", num_key_value_heads=kv_heads, attn_implementation="sdpa"),
                         call={"use_cache": False})


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
    ref = one_process_fit(QwenLM, DATA.train_set, 4, max_steps=2)
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
    ref = one_process_fit(factory, DATA.train_set, 4, max_steps=2)
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(4, sequence_parallel=True, loss_parallel=True), devices=4, max_steps=2)
    for rec in got:
        assert_close_records(ref, rec)


# [Note: mixed-precision tolerances]
# Both runs compute in the same 16-bit format; they differ only where tensor parallelism rounds what one
# device does not: a row-parallel layer rounds each rank's partial product to 16 bits and sums the two
# (one device rounds the full product once), and a column-parallel layer's input gradient is such a sum in
# backward. On the longest path (loss -> tok_emb) there are K = 8 such sites: out_proj and mlp.proj forward,
# the q|k|v and fc input gradients backward, in each of the 2 blocks. Each site adds at most u (the unit
# roundoff: 2^-11 for float16, 2^-8 for bfloat16) relative to the magnitude it rounds, so:
# - a gradient tensor differs by at most K * u * max|g| (per tensor, per step; measured <= 2u on step 0);
# - a logit by at most K * u * max|z|, and the loss (a mean of cross entropies, whose gradient in the logits
#   has l1 norm <= 2 per token) by at most 2 * K * u * max|z|, with max|z| <= ||h|| * max_j ||w_j|| =
#   sqrt(n_embd) * (largest lm-head row norm) by Cauchy-Schwarz (h is ln_f's output: norm sqrt(n_embd) at init,
#   moved by 2 lr at most in two steps).
# Gradients are recorded unscaled: Lightning's MixedPrecision.optimizer_step calls `scaler.unscale_` before
# `on_before_optimizer_step`, where the Recorder reads them; comparing relative to max|g| is scale-free anyway.
# Parameters: AdamW's first step moves each element by exactly lr * sign(g), so an element whose gradient is
# within rounding of zero moves by +-lr in a direction the rounding picks, differently in the two runs (up to
# 4 lr apart after two steps, which any two unrelated runs also satisfy). Parameters are therefore checked
#   (a) per run: the final parameters are AdamW (the module's own optimizer and schedule, with the same
#       clipping) applied to that run's recorded gradients, to fp32 round-off;
#   (b) across runs, on the elements whose gradient is at least 10 x its tolerance at both steps: there the
#       first step is the same sign and the second step's update lr * m/sqrt(v) depends on g1/g0 with
#       |d update / d ln(g1/g0)| <= lr / 2 (AdamW's betas (0.9, 0.95), two steps), so they agree within
#       lr / 2 * (2 / 10 + the clipping coefficients' relative error, 2 K u = 0.008 in the clipped float16
#       test) <= 0.104 lr < PARAM_TOL_LR * lr;
#   (c) every parameter with a real gradient moved: max|final - initial| >= lr in both runs (>> the tolerance).
# The learning rate is small (LR) because a +-lr flip of such an element perturbs the model: at lr = 3e-3
# step 1's gradients differed by 104 u * max|g| (float16), at 3e-4 by 12 u, at 1e-4 by 4 u (within K u).
# The key projection's bias has an exact gradient of 0 (softmax ignores adding q.b to a query's scores);
# its recorded gradient is round-off, checked as such and not compared.
U_FP16, U_BF16 = 2.0 ** -11, 2.0 ** -8
K_ROUNDINGS, LR, PARAM_TOL_LR, CLIP = 8, 1e-4, 0.12, 0.05
ZERO_GRAD = ("blocks.0.attn.k_proj.bias", "blocks.1.attn.k_proj.bias")


lr_gpt = gpt_factory(n_head=4, lr=LR)  # four_head_gpt at this file's learning rate


def replay_adamw(grads: list[dict], clip: float | None) -> dict:
    """The initial module's own optimizer and LR schedule stepped on recorded gradients (see (a) above)."""
    model = seeded(lr_gpt)
    conf = model.configure_optimizers()
    optimizer, scheduler = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    params = dict(model.named_parameters())
    for step in grads:
        for name, p in params.items():
            p.grad = step[name].clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(params.values(), clip)
        optimizer.step()
        scheduler.step()
    return {n: p.detach().clone() for n, p in params.items()}


def assert_mixed_precision_close(ref: dict, got: dict, u: float, clip: float | None = None) -> None:
    """[Note: mixed-precision tolerances] for one rank's record against the one-process reference."""
    initial = seeded(lr_gpt)
    k = K_ROUNDINGS
    z_max = initial.hparams.n_embd ** 0.5 * float(initial.lm_head.weight.detach().norm(dim=1).max())
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               atol=2 * k * u * z_max, rtol=0)
    assert len(got["grads"]) == len(ref["grads"]) == 2
    grad_tol = []
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        assert set(g) == set(r) == set(dict(initial.named_parameters())), f"step {step}: gradient names differ"
        largest = max(float(t.abs().max()) for t in r.values())
        tol = {}
        for name in r:
            if name in ZERO_GRAD:
                assert max(float(g[name].abs().max()), float(r[name].abs().max())) < 1e-6 * largest, name
                continue
            tol[name] = k * u * float(r[name].abs().max())
            torch.testing.assert_close(g[name], r[name], atol=tol[name], rtol=0,
                                       msg=lambda m: f"step {step} {name}: {m}")
        grad_tol.append(tol)
    init = dict(initial.named_parameters())
    for rec in (ref, got):  # (a)
        for name, p in replay_adamw(rec["grads"], clip).items():
            torch.testing.assert_close(rec["params"][name], p, atol=1e-3 * LR, rtol=0,
                                       msg=lambda m: f"rank {rec['rank']} param {name} is not AdamW of its grads: {m}")
    for name, p in got["params"].items():
        if name in ZERO_GRAD:
            continue
        sure = torch.ones_like(p, dtype=torch.bool)  # (b)
        for step, r in enumerate(ref["grads"]):
            sure &= r[name].abs() >= 10 * grad_tol[step][name]
        torch.testing.assert_close(p[sure], ref["params"][name][sure], atol=PARAM_TOL_LR * LR, rtol=0,
                                   msg=lambda m: f"param {name} ({int(sure.sum())} elements of {p.numel()}): {m}")
        for rec in (ref, got):  # (c)
            moved = float((rec["params"][name] - init[name].detach()).abs().max())
            assert moved >= LR, f"rank {rec['rank']} param {name} moved by {moved:.3g} only (lr {LR})"


@pytest.mark.timeout(TIMEOUT_S)
def test_bf16_mixed(tmp_path):
    ref = one_process_fit(lr_gpt, DATA.train_set, 4, max_steps=2, precision="bf16-mixed")
    got = fit_and_record(seeded(lr_gpt), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(), devices=2, max_steps=2, precision="bf16-mixed")
    for rec in got:
        assert_mixed_precision_close(ref, rec, U_BF16)


@pytest.mark.timeout(TIMEOUT_S)
def test_16_mixed_with_grad_scaler(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugins():  # Lightning would turn precision="16-mixed" into bf16 on CPU; pass fp16 AMP explicitly
        return [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=1024.0))]

    ref = fit_and_record(seeded(lr_gpt), reference_loader(DATA.train_set, 4), str(tmp_path / "ref"), max_steps=2,
                         plugins=plugins(), gradient_clip_val=CLIP)[0]
    got = fit_and_record(seeded(lr_gpt), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(), devices=2, max_steps=2, plugins=plugins(), gradient_clip_val=CLIP)
    for rec in got:
        assert_mixed_precision_close(ref, rec, U_FP16, clip=CLIP)


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
    ref = one_process_fit(QwenWithLabels, DATA.train_set, 4, max_steps=2)
    got = fit_and_record(seeded(QwenWithLabels), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(), devices=2, max_steps=2)
    for rec in got:
        assert_close_records(ref, rec)
