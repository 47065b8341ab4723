"""Hugging Face GPT-2 under TensorParallelStrategy: its ``Conv1D`` layers (a linear layer with the weight stored
``[in, out]``) are split as ``nn.Linear`` layers would be, the fused ``c_attn`` (q | k | v) part by part, and the
unchanged LightningModule trains like one process, with Megatron's four all-reduces per layer."""
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_close_records, fit_and_record, one_process_fit, seeded
from models import CausalLM
from lightning_par.data import SyntheticCorpus
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.tensor.plan import build_plan
from test_tensor_checkpoint import fit_tp, reference_pair
from test_tensor_comm import N_LAYER, fit_measure

transformers = pytest.importorskip("transformers")

DATA = SyntheticCorpus(vocab_size=128, seq_len=16, train_sequences=32, val_sequences=8)


class GPT2LM(CausalLM):
    """How a user wraps GPT-2: nothing in it knows about parallelism; the default call (use_cache=True: a KV cache
    is built)."""

    def __init__(self):
        # dropout off: the comparison with one process is exact only without random masks
        cfg = transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_head=4, n_layer=N_LAYER,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
                                      bos_token_id=0, eos_token_id=0)
        super().__init__(transformers.GPT2LMHeadModel(cfg), sync_dist=False)


class Placements(pl.Callback):
    """Records, on every rank, the placements of the parameters the strategy sharded."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        found = {n: tuple(p.placements) for n, p in pl_module.named_parameters() if isinstance(p, DTensor)}
        torch.save({"placements": found, "plan": dict(trainer.strategy.plan.styles)},
                   os.path.join(self.out_dir, f"placements{trainer.global_rank}.pt"))


def test_plan_shards_every_conv1d_and_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # in particular not "every rank computes the whole model"
        plan = build_plan(GPT2LM(), 2)
    for i in range(N_LAYER):
        h = f"model.transformer.h.{i}"
        assert plan.styles[f"{h}.attn.c_attn"] == "fused_colwise" and plan.parts[f"{h}.attn.c_attn"] == 3
        assert plan.styles[f"{h}.attn.c_proj"] == "rowwise"
        assert plan.styles[f"{h}.mlp.c_fc"] == "colwise" and plan.styles[f"{h}.mlp.c_proj"] == "rowwise"
        assert plan.styles[f"{h}.attn"] == plan.styles[f"{h}.mlp"] == "prepare"
    # a size that does not divide a Conv1D's features is refused with the module, its width and the fix
    with pytest.raises(ValueError, match=r"'model\.transformer\.h\.0\.mlp\.c_fc' \(Conv1D\) has out_features=128, "
                                         r"which is not divisible by tensor_parallel_size=3.*'replicate'"):
        build_plan(GPT2LM(), 3)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("sp,lp", [(False, False), (True, False), (True, True)])
def test_gpt2_matches_one_process(tmp_path, sp, lp):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ref = one_process_fit(GPT2LM, DATA.train_set, 4, max_steps=3)
    strategy = TensorParallelStrategy(tensor_parallel_size=2, sequence_parallel=sp, loss_parallel=lp,
                                      start_method="fork", timeout=120)
    got = fit_and_record(seeded(GPT2LM), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=strategy, devices=2, max_steps=3, callbacks=[Placements(str(tmp_path))])
    assert len(ref["losses"]) == 3
    for rec in got:
        assert_close_records(ref, rec)
        assert rec["metrics"] == pytest.approx(ref["metrics"], abs=1e-5)
    for rank in range(2):
        placements = torch.load(tmp_path / f"placements{rank}.pt")["placements"]
        h = "model.transformer.h.1"
        # Conv1D's weight is [in, out]: column-wise splits its dim 1, row-wise its dim 0
        assert placements[f"{h}.attn.c_attn.weight"] == (_StridedShard(1, split_factor=3),)
        assert placements[f"{h}.attn.c_attn.bias"] == (_StridedShard(0, split_factor=3),)
        assert placements[f"{h}.mlp.c_fc.weight"] == (Shard(1),) and placements[f"{h}.mlp.c_fc.bias"] == (Shard(0),)
        assert placements[f"{h}.mlp.c_proj.weight"] == placements[f"{h}.attn.c_proj.weight"] == (Shard(0),)
        assert placements[f"{h}.mlp.c_proj.bias"] == (Replicate(),)
        # the 4 Conv1D of each block, weight and bias; under sequence_parallel also the block's two LayerNorms
        # (replicated DTensors), under loss_parallel the tied lm_head / wte weight
        assert len(placements) == 8 * N_LAYER + 4 * N_LAYER * sp + lp


@pytest.mark.timeout(TIMEOUT_S)
def test_gpt2_reduces_four_times_per_layer(tmp_path):
    for rec in fit_measure(tmp_path, factory=GPT2LM):
        assert len(rec["counts"]) == 2  # one per step
        for counts in rec["counts"]:
            # Megatron: forward attention out + MLP out, backward attention in + MLP in; no gather of q/k/v
            assert counts == {"all_reduce": 4 * N_LAYER}, counts
        assert rec["full"] > 0 and rec["local"] * 2 == rec["full"], rec


@pytest.mark.timeout(TIMEOUT_S)
def test_gpt2_consolidated_checkpoint_loads_on_one_device_and_resumes(tmp_path):
    ref2, ref_resumed = reference_pair(tmp_path, factory=GPT2LM)
    got, _ = fit_tp(tmp_path, "tp", 2, factory=GPT2LM)
    for rec in got:
        assert_close_records(ref2, rec)
    path = str(tmp_path / "ckpt_tp" / "epoch=0-step=2.ckpt")
    raw = torch.load(path, weights_only=True)["state_dict"]
    assert raw["model.transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # whole, in Conv1D's [in, out] layout
    single = GPT2LM.load_from_checkpoint(path)
    for n, p in single.named_parameters():
        torch.testing.assert_close(p.detach(), ref2["params"][n], atol=1e-5, rtol=1e-5)
    resumed, _ = fit_tp(tmp_path, "resumed", 4, ckpt_path=path, factory=GPT2LM)
    for rec in resumed:
        assert_close_records(ref_resumed, rec)
        assert rec["global_step"] == 4
