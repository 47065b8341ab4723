"""The setup check of rewritten blocks ([Note: the setup check] in lightning_par/verify.py) on two ranks: a row-wise
layer that adds its bias once per rank (the hypothesis for StarCoder2's drift, reintroduced on purpose) is caught at
setup on the recorded inputs, the region is left replicated with the module and the difference named, and the
model still trains equal to one process; the same check passes the correct rewrite."""

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from harness import (TIMEOUT_S, Recorder, assert_close_records, fit_and_record, free_port, one_process_fit, seeded,
                     start_ranks, trainer_kwargs)
from lightning_par.tensor import parallelize as tp_parallelize
from lightning_par.tensor.transposed import RowwiseParallel
from test_setup_check_families import DATA, MATCHES, PlanRecorder, starcoder2, starcoder2_adamw, tp2

transformers = pytest.importorskip("transformers")


class BiasOncePerRank(RowwiseParallel):
    """A broken row-wise split: each rank adds the bias to its partial sum, so the reduced output holds it
    ``tensor_parallel_size`` times (and its gradient is summed as often). Silent: nothing raises."""

    def _apply(self, module, device_mesh):
        module = super()._apply(module, device_mesh)
        if getattr(module, "bias", None) is not None:
            module.register_forward_hook(lambda mod, args, out: out + (device_mesh.size() - 1) * mod.bias)
        return module


@pytest.fixture
def bias_once_per_rank(monkeypatch):
    # forked ranks inherit the patch: every row-wise layer of the plan gets the broken split
    monkeypatch.setattr(tp_parallelize, "RowwiseParallel", BiasOncePerRank)


@pytest.mark.timeout(TIMEOUT_S)
def test_a_bias_added_once_per_rank_is_caught_and_left_replicated(tmp_path, bias_once_per_rank):
    ref = one_process_fit(starcoder2_adamw, DATA.train_set, 4, max_steps=3)
    plan_file = str(tmp_path / "plan.pt")
    got = fit_and_record(seeded(starcoder2_adamw), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(), devices=2, max_steps=3, callbacks=[PlanRecorder(plan_file)])
    for rec in got:
        assert_close_records(ref, rec)  # never trained differently: every region fell back to replicated
    plan = torch.load(plan_file, weights_only=False)
    assert not {n for n, s in plan["styles"].items() if s in ("colwise", "rowwise")}
    for i in range(2):
        for region, row in (("self_attn", "o_proj"), ("mlp", "c_proj")):
            what = plan["checked"][f"model.model.layers.{i}.{region}"]
            # the output differs by about the perturbed bias (~0.05 and up), far above rounding (~1e-5)
            assert what.startswith("the sharded module's output 0 differs from the whole module's by ")
            error, allowed = (float(w.split(" ")[0].rstrip(")"))
                              for w in (what.split("by ")[1], what.split("allows ")[1]))
            assert error > 1e3 * allowed, what


def _check_by_hand(rank, port, out):
    """apply_setup_check called directly, as context / expert parallelism call it: a StarCoder2 MLP split by hand
    on recorded inputs (its bias added after the reduction, then once per rank)."""
    import datetime

    from lightning_par.verify import apply_setup_check, record_inputs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = starcoder2().eval()
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
        inputs = record_inputs(model, ["model.layers.0.mlp"], lambda: model(input_ids=ids))
        mlp = model.get_submodule("model.layers.0.mlp")

        class Split(nn.Module):
            def __init__(self, m, once_per_rank):
                super().__init__()
                half = m.c_fc.out_features // 2
                rows = slice(rank * half, (rank + 1) * half)
                self.fc = nn.Linear(m.c_fc.in_features, half)
                self.proj = nn.Linear(half, m.c_proj.out_features)
                with torch.no_grad():
                    self.fc.weight.copy_(m.c_fc.weight[rows]), self.fc.bias.copy_(m.c_fc.bias[rows])
                    self.proj.weight.copy_(m.c_proj.weight[:, rows]), self.proj.bias.copy_(m.c_proj.bias)
                self.act, self.once_per_rank = m.act, once_per_rank

            def forward(self, x):
                x = _Enter.apply(x)
                y = torch.nn.functional.linear(self.act(self.fc(x)), self.proj.weight,
                                               self.proj.bias if self.once_per_rank else None)
                y = _AllReduce.apply(y)
                return y if self.once_per_rank else y + self.proj.bias

        found = {}
        for broken in (False, True):
            # the parameters of a hand split are not the original's: compare outputs and input gradients only
            verdict = apply_setup_check(mlp, lambda m: Split(m, broken), inputs["model.layers.0.mlp"],
                                        parameters=False)
            found[broken] = (verdict.ok, verdict.describe("model.layers.0.mlp"))
        torch.save(found, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g  # the output is replicated: each rank's gradient is the whole one


class _Enter(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient (each rank's is its shard's part)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


@pytest.mark.timeout(TIMEOUT_S)
def test_apply_setup_check_is_a_building_block(tmp_path):
    start_ranks(_check_by_hand, (free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        # the correct split matches (outputs and input gradients; its parameters are other tensors)
        assert found[False] == (True, "model.layers.0.mlp: the rewritten block matches the original")
        assert found[True][0] is False
        assert found[True][1].startswith("model.layers.0.mlp: the rewritten block's output 0 differs from the "
                                         "original's by ")


@pytest.mark.timeout(TIMEOUT_S)
def test_verify_false_skips_the_check(tmp_path):
    ref = one_process_fit(starcoder2_adamw, DATA.train_set, 4, max_steps=2)
    plan_file = str(tmp_path / "plan.pt")
    got = fit_and_record(seeded(starcoder2_adamw), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=tp2(verify=False), devices=2, max_steps=2, callbacks=[PlanRecorder(plan_file)])
    for rec in got:
        assert_close_records(ref, rec)
    plan = torch.load(plan_file, weights_only=False)
    assert plan["checked"] == {} and plan["styles"]["model.model.layers.0.mlp.c_proj"] == "rowwise"


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("broken", [False, True], ids=["correct", "bias_once_per_rank"])
def test_a_meta_built_module_checks_its_attention_on_seeded_inputs(tmp_path, monkeypatch, broken):
    """A meta-built StarCoder2 with ``weights=``: its step runs on the meta device at setup, the attention's inputs
    (rotary tables, mask) are recorded as shapes and given seeded values, so the attention is checked as on an eager
    build (it was "not checked": its forward needs more than a hidden state); the broken split is caught there and
    left replicated, and training equals one process on the same weights."""
    from safetensors.torch import save_file

    if broken:  # forked ranks inherit the patch
        monkeypatch.setattr(tp_parallelize, "RowwiseParallel", BiasOncePerRank)
    path = str(tmp_path / "weights.safetensors")
    save_file({k[len("model."):]: v.contiguous() for k, v in seeded(starcoder2_adamw).state_dict().items()
               if k != "model.lm_head.weight"}, path)  # tied to the embedding: stored once, as Hugging Face writes it
    ref = one_process_fit(starcoder2_adamw, DATA.train_set, 4, max_steps=3)
    plan_file = str(tmp_path / "plan.pt")
    trainer = pl.Trainer(**trainer_kwargs(strategy=tp2(weights=path, weights_prefix="model."), devices=2, max_steps=3,
                                          callbacks=[Recorder(str(tmp_path / "tp")), PlanRecorder(plan_file)]))
    with trainer.init_module(empty_init=True):
        module = starcoder2_adamw()
    trainer.fit(module, DataLoader(DATA.train_set, batch_size=4))
    for rank in range(2):
        assert_close_records(ref, torch.load(str(tmp_path / "tp" / f"rank{rank}.pt"), weights_only=False))
    checked = torch.load(plan_file, weights_only=False)["checked"]
    for i in range(2):
        what = checked[f"model.model.layers.{i}.self_attn"]
        if broken:
            assert what.startswith("the sharded module's output 0 differs from the whole module's by "), what
        else:
            assert what == MATCHES
