"""Ulysses context parallelism ([Note: Ulysses] in lightning_par/context/ulysses.py) on real gloo ranks: the
module's own attention, on whole sequences for this rank's heads, gives one process's loss and (averaged over the
group) every gradient, float32 within 1e-5, for the reference GPT (its own SDPA call), Hugging Face Llama (SDPA,
grouped-query with fewer k/v heads than cp at cp 4), Gemma-2 with eager attention (soft-capping, a sliding window)
and GPT-NeoX; also under full activation checkpointing (and selective, the GPT). Through HybridParallelStrategy(context_parallel_method=
"ulysses"): 8 AdamW steps against one process (losses within 2e-4), and composed with tp, pp and dp."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from context_models import family_model
from harness import TIMEOUT_S, free_port, start_ranks
from lightning_par.context import apply_context_parallel
from lightning_par.memory.checkpointing import apply_activation_checkpointing
from models import hf_model, tiny_gpt

B, S = 2, 16


def _build(family):
    torch.manual_seed(0)
    if family == "gpt":
        return tiny_gpt()
    if family == "llama":
        return hf_model("llama", attn_implementation="sdpa")
    return family_model(family, attn_implementation="eager" if family == "gemma2" else "sdpa")


def _loss(family, model, idx, targets):
    logits = model(idx) if family == "gpt" else model(input_ids=idx, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _check(family, cp, group, checkpointing=None):
    model = _build(family)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(1, 32, (B, S), generator=g), torch.randint(0, 32, (B, S), generator=g)
    ref_loss = _loss(family, reference, idx, targets)
    ref_loss.backward()
    undo = apply_activation_checkpointing(model, checkpointing).undo if checkpointing else None
    applied = apply_context_parallel(model, group, method="ulysses")
    loss = _loss(family, model, idx, targets)
    loss.backward()
    applied.remove()
    if undo:
        undo()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name, grad in got.items():
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad / cp, want[name], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{family} cp{cp} {checkpointing} {name}: {m}")


def _worker(rank, cp, port, families):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", rank=rank, world_size=cp, init_method=f"tcp://127.0.0.1:{port}")
    try:
        group = dist.new_group(list(range(cp)))
        for family in families:
            _check(family, cp, group)
        _check(families[0], cp, group, checkpointing="full")
        if families[0] == "gpt":  # a Hugging Face model's cached cuts break selective checkpointing under any method
            _check("gpt", cp, group, checkpointing="selective")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("cp,families", [(2, ("gpt", "llama", "gemma2", "gpt_neox")), (4, ("llama",))])
def test_ulysses_equals_one_process(cp, families):
    start_ranks(_worker, (cp, free_port(), families), nprocs=cp)


# -- through the strategy ---------------------------------------------------------------------------------------
from torch.utils.data import DataLoader  # noqa: E402

from context_models import family_lm  # noqa: E402
from harness import SharesSequences, fit_and_record, one_process_fit, seeded  # noqa: E402
from models import causal_lm, corpus, gpt_factory  # noqa: E402
from harness import hybrid  # noqa: E402
from test_context_strategy import assert_steps_match  # noqa: E402

DATA = corpus(val_sequences=8)
FACTORIES = {"gpt": tiny_gpt,
             "llama": causal_lm("llama", call={"use_cache": False}, attn_implementation="sdpa",
                                max_position_embeddings=16),
             "gemma2": family_lm("gemma2", attn_implementation="eager"),
             "gpt_neox": family_lm("gpt_neox", attn_implementation="sdpa")}


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_cp2_ulysses_trains_as_one_process(tmp_path, family):
    """8 AdamW steps: every rank's losses within 2e-4, the first two steps' gradients and the parameters after."""
    factory = FACTORIES[family]
    ref = one_process_fit(factory, DATA.train_set, 4, max_steps=8)
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "u"),
                         strategy=hybrid(context_parallel_size=2, context_parallel_method="ulysses"), devices=2,
                         max_steps=8, callbacks=[SharesSequences()])
    assert_steps_match(ref, got, 8)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", ["dp2_full_checkpointing", "tp2", "pp2"])
def test_ulysses_composes_with_dp_tp_pp_and_checkpointing(tmp_path, layout):
    """2 AdamW steps on 4 ranks: dp 2 × cp 2 with full activation checkpointing, cp 2 × tp 2 (each tensor-parallel
    rank's local heads go through the all-to-all), pp 2 × cp 2 (1F1B)."""
    gpt4 = gpt_factory(n_layer=4, n_head=4)  # 2 local heads per tensor-parallel rank: cp 2 divides them
    kw, batch = {"dp2_full_checkpointing": (dict(data_parallel_size=2, activation_checkpointing="full"), 8),
                 "tp2": (dict(tensor_parallel_size=2), 4),
                 "pp2": (dict(pipeline_parallel_size=2, microbatches=2), 4)}[layout]
    ref = one_process_fit(gpt4, DATA.train_set, batch, max_steps=2)
    got = fit_and_record(seeded(gpt4), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "c"),
                         strategy=hybrid(context_parallel_size=2, context_parallel_method="ulysses", **kw), devices=4,
                         max_steps=2)
    for rec in got:
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), atol=2e-4, rtol=0)
        for name, grad in rec["grads"][0].items():
            torch.testing.assert_close(grad, ref["grads"][0][name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
