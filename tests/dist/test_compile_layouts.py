"""Compiled blocks under every strategy on real gloo ranks (fork): with ``compile={"backend": "aot_eager"}`` (the
eager kernels, traced) every rank's losses, gradients and parameters equal the same layout's eager run (fp32,
<= 1e-6), for the reference GPT and a tiny Hugging Face Llama, one graph serving every block with no graph break
and no recompile (dynamo's counters), and teardown gives the blocks their eager forward back; a module the user
compiled (its blocks wrapped in ``torch.compile``, or ``trainer.fit(torch.compile(module))``) trains sharded as the
uncompiled module, with its results; checkpoints saved compiled resume eager and the other way round; inductor
once, within a tolerance."""
import os
import re

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

from harness import TIMEOUT_S, fit_and_record, seeded, trainer_kwargs
from models import CausalLM, corpus, gpt_factory, hf_model
from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                           TensorParallelStrategy)
from lightning_par._compat import compile_counters, reset_compile_counters
from lightning_par.compile import is_compiled
from lightning_par.pipeline.ghost import Ghost

DATA = corpus(train_sequences=32)
STEPS = 2
EXACT = dict(atol=1e-6, rtol=0.0)  # aot_eager runs the eager kernels on the same values: 0 or rounding
AOT = {"backend": "aot_eager"}

gpt = gpt_factory(n_layer=4)


def llama():
    return CausalLM(hf_model("llama", num_hidden_layers=4), call={"use_cache": False})


MODELS = {"gpt": gpt, "llama": llama}
LAYOUTS = {  # name: (strategy class, its keywords, devices)
    "one_device": (DataParallelStrategy, {}, 1),
    "dp2": (DataParallelStrategy, {}, 2),
    "dp2_zero1": (DataParallelStrategy, {"zero_stage": 1}, 2),
    "dp2_zero3": (DataParallelStrategy, {"zero_stage": 3}, 2),
    "dp2_ac": (DataParallelStrategy, {"activation_checkpointing": "full"}, 2),
    "pp2_gpipe": (PipelineParallelStrategy, {"pipeline_parallel_size": 2, "microbatches": 4, "schedule": "gpipe"}, 2),
    "pp2_1f1b": (PipelineParallelStrategy, {"pipeline_parallel_size": 2, "microbatches": 4}, 2),
    "pp2_interleaved": (PipelineParallelStrategy, {"pipeline_parallel_size": 2, "microbatches": 4,
                                                   "schedule": "interleaved_1f1b", "stages_per_rank": 2}, 2),
    "pp2_zero_bubble": (PipelineParallelStrategy, {"pipeline_parallel_size": 2, "microbatches": 4,
                                                   "schedule": "zero_bubble"}, 2),
    "pp2_ac_selective": (PipelineParallelStrategy, {"pipeline_parallel_size": 2, "microbatches": 4,
                                                    "activation_checkpointing": "selective"}, 2),
    "tp2": (TensorParallelStrategy, {"tensor_parallel_size": 2}, 2),
    "tp2_sp": (TensorParallelStrategy, {"tensor_parallel_size": 2, "sequence_parallel": True}, 2),
    "tp2_ac": (TensorParallelStrategy, {"tensor_parallel_size": 2, "activation_checkpointing": 2}, 2),
    "pp2_tp2": (HybridParallelStrategy, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2,
                                         "data_parallel_size": 1, "microbatches": 4}, 4),
    "dp2_tp2": (HybridParallelStrategy, {"tensor_parallel_size": 2, "data_parallel_size": 2}, 4),
}
_EAGER: dict = {}  # (model, layout): the records of the eager run, once per session


class Layout(pl.Callback):
    """Per rank at the start of training: the elements of parameters this rank holds (DTensor shards counted
    locally), whether any parameter is a DTensor, and which of its blocks run a compiled forward, to
    ``<out_dir>/layout<rank>.pt``."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        reset_compile_counters()  # blocks compile lazily: in the steps that follow

        local = lambda p: p.to_local() if isinstance(p, DTensor) else p  # noqa: E731
        held = [p for p in pl_module.parameters() if not p.is_meta]
        stack = _stack(pl_module)
        torch.save({"numel": sum(local(p).numel() for p in held),
                    "dtensor": any(isinstance(p, DTensor) for p in held),
                    "compiled": [is_compiled(b) for b in stack if not isinstance(b, Ghost)],
                    "names": [n for n, _ in pl_module.named_parameters()]},
                   os.path.join(self.out_dir, f"layout{trainer.global_rank}.pt"))

    def on_train_end(self, trainer, pl_module):
        torch.save(compile_counters(), os.path.join(self.out_dir, f"counts{trainer.global_rank}.pt"))

    def on_fit_end(self, trainer, pl_module):  # after the strategy's teardown: which blocks still run compiled
        torch.save([is_compiled(b) for b in _stack(pl_module) if not isinstance(b, Ghost)],
                   os.path.join(self.out_dir, f"after{trainer.global_rank}.pt"))


def _stack(pl_module):
    return pl_module.model.model.layers if hasattr(pl_module, "model") else pl_module.blocks


def compiled_after_teardown(out_dir, ranks: int) -> list[list[bool]]:
    return [torch.load(os.path.join(out_dir, f"after{r}.pt")) for r in range(ranks)]


def layouts(out_dir: str, ranks: int) -> list[dict]:
    return [torch.load(os.path.join(out_dir, f"layout{r}.pt"), weights_only=False) for r in range(ranks)]


def fit(tmp_path, model: str, layout: str, compile=False, *, user=None, tag="", **kw) -> list[dict]:
    """``user``: None, "blocks" (the blocks wrapped in torch.compile(..., **user_kw)) or "module"
    (``trainer.fit(torch.compile(module))``)."""
    cls, options, devices = LAYOUTS[layout]
    strategy = cls(compile=compile, start_method="fork", timeout=120, **options)
    out = tmp_path / f"{layout}-{compile}-{user}{tag}"
    out.mkdir(parents=True, exist_ok=True)
    module = seeded(MODELS[model])
    user_kw = kw.pop("user_kw", AOT)
    if user == "blocks":
        stack = module.model.model.layers if model == "llama" else module.blocks
        for i, block in enumerate(stack):
            stack[i] = torch.compile(block, **user_kw)
    elif user == "module":
        module = torch.compile(module, **user_kw)
    return fit_and_record(module, DataLoader(DATA.train_set, batch_size=8), str(out), strategy=strategy,
                          devices=devices, max_steps=kw.pop("max_steps", STEPS),
                          callbacks=[Layout(str(out)), *kw.pop("callbacks", ())], **kw)


def eager(tmp_path, model: str, layout: str) -> list[dict]:
    """The eager run's records (and, in ``_EAGER``, its ranks' layouts)."""
    if (model, layout) not in _EAGER:
        records = fit(tmp_path, model, layout)
        _EAGER[(model, layout)] = records, layouts(str(tmp_path / f"{layout}-False-None"), LAYOUTS[layout][2])
    return _EAGER[(model, layout)][0]


def assert_equal_runs(expected: list[dict], got: list[dict], steps: int = STEPS, **tol) -> None:
    """Rank by rank: every loss, every gradient the rank holds, every parameter (<= 1e-6 unless given)."""
    tol = tol or EXACT
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(e["losses"]), **tol)
        assert len(g["grads"]) == len(e["grads"]) == steps
        for step, (gg, ee) in enumerate(zip(g["grads"], e["grads"])):
            assert gg and set(gg) == set(ee), step
            for name in ee:
                torch.testing.assert_close(gg[name], ee[name], **tol, msg=lambda m: f"step {step} {name}: {m}")
        assert set(g["params"]) == set(e["params"])
        for name in e["params"]:
            torch.testing.assert_close(g["params"][name], e["params"][name], **tol, msg=lambda m: f"{name}: {m}")


def assert_compiled_as_eager(tmp_path, model, layout, got_dir_tag, ranks):
    """Every rank compiled each block it holds, holds the eager run's share of the parameters, under its names."""
    compiled = layouts(str(tmp_path / got_dir_tag), ranks)
    plain = _EAGER[(model, layout)][1]
    for c, p in zip(compiled, plain):
        assert c["compiled"] and all(c["compiled"]), c["compiled"]
        assert not any(p["compiled"])
        assert (c["numel"], c["dtensor"], c["names"]) == (p["numel"], p["dtensor"], p["names"])


CASES = [("gpt", "one_device"), ("gpt", "dp2"), ("gpt", "dp2_zero1"), ("gpt", "dp2_zero3"), ("gpt", "dp2_ac"),
         ("gpt", "pp2_gpipe"), ("gpt", "pp2_1f1b"), ("gpt", "pp2_interleaved"), ("gpt", "pp2_zero_bubble"),
         ("gpt", "pp2_ac_selective"), ("gpt", "tp2"), ("gpt", "tp2_sp"), ("gpt", "tp2_ac"), ("gpt", "pp2_tp2"),
         ("gpt", "dp2_tp2"), ("llama", "dp2"), ("llama", "pp2_1f1b"), ("llama", "tp2")]
SLOW = {"pp2_gpipe", "pp2_interleaved", "pp2_ac_selective", "tp2_ac", "dp2_tp2", "dp2_zero1", "one_device"}


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model,layout", [
    pytest.param(m, l, marks=[pytest.mark.slow] if l in SLOW or (m, l) in {("llama", "dp2"), ("gpt", "tp2")} else [])
    for m, l in CASES], ids=[f"{m}-{l}" for m, l in CASES])
def test_aot_eager_compiled_run_equals_the_eager_run(tmp_path, model, layout):
    expected = eager(tmp_path, model, layout)
    got = fit(tmp_path, model, layout, AOT)
    assert_equal_runs(expected, got)
    assert_compiled_as_eager(tmp_path, model, layout, f"{layout}-{AOT}-None", LAYOUTS[layout][2])
    # one graph serves every block of each rank, whole (no graph break: a tensor plan's regions neither) and
    # traced once (no guard of one block fails on the next: no recompile)
    for rank in range(LAYOUTS[layout][2]):
        counts = torch.load(tmp_path / f"{layout}-{AOT}-None" / f"counts{rank}.pt")
        assert (counts["graphs"], counts["graph_breaks"], counts["recompiles"]) == (1, 0, 0), (rank, counts)
    # teardown gives the blocks their eager forward back (a later Trainer applies its own compile setting)
    after = compiled_after_teardown(str(tmp_path / f"{layout}-{AOT}-None"), LAYOUTS[layout][2])
    assert all(blocks and not any(blocks) for blocks in after), after


USER = [("gpt", "dp2", "blocks"), ("gpt", "dp2", "module"), ("gpt", "pp2_1f1b", "blocks"),
        ("gpt", "pp2_1f1b", "module"), ("gpt", "tp2", "blocks"), ("gpt", "tp2", "module"),
        ("gpt", "pp2_tp2", "blocks"), ("llama", "tp2", "blocks"), ("gpt", "dp2_tp2", "module")]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model,layout,user", [
    pytest.param(m, l, u, marks=[pytest.mark.slow] if l in SLOW or (l, u) in {
        ("pp2_1f1b", "blocks"), ("dp2", "blocks"), ("tp2", "module")} else [])
    for m, l, u in USER], ids=[f"{m}-{l}-{u}" for m, l, u in USER])
def test_a_module_the_user_compiled_trains_sharded_as_the_uncompiled_one(tmp_path, model, layout, user):
    """The user's torch.compile (aot_eager, as they wrote it) is undone and applied to each block: the ranks hold
    the uncompiled module's shares under its names, every block compiled, and the results are the eager run's."""
    expected = eager(tmp_path, model, layout)
    got = fit(tmp_path, model, layout, user=user)
    assert_equal_runs(expected, got)
    assert_compiled_as_eager(tmp_path, model, layout, f"{layout}-False-{user}", LAYOUTS[layout][2])
    # the user's compile is theirs: the blocks stay compiled with it after teardown
    after = compiled_after_teardown(str(tmp_path / f"{layout}-False-{user}"), LAYOUTS[layout][2])
    assert all(blocks and all(blocks) for blocks in after), after


@pytest.mark.timeout(TIMEOUT_S)
def test_inductor_under_data_parallel_within_float_reassociation(tmp_path):
    """compile=True (inductor) on DP2: inductor fuses and reorders fp32 sums (layer norm, softmax, the matmuls'
    epilogues), each within a few ulps (2^-23 ~ 1.2e-7 relative) per op; over 2 AdamW steps of a 4-block width-16
    GPT that stays under 1e-4 relative / 1e-5 absolute (measured: ~1e-6)."""
    expected = eager(tmp_path, "gpt", "dp2")
    got = fit(tmp_path, "gpt", "dp2", True)
    assert_equal_runs(expected, got, atol=1e-5, rtol=1e-4)
    assert_compiled_as_eager(tmp_path, "gpt", "dp2", "dp2-True-None", 2)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", ["tp2", pytest.param("pp2_1f1b", marks=pytest.mark.slow)])
def test_inductor_under_tensor_and_pipeline_parallel_within_float_reassociation(tmp_path, layout):
    """compile=True (inductor) where the graph is traced on DTensor blocks (TP2: the regions' DTensor code traced
    away, [Note: a region in a compiled block]) and on a pipeline stage's blocks: the same bound as on DP2 (a few
    ulps, 2^-23 relative, per fused op; under 1e-4 relative / 1e-5 absolute over 2 AdamW steps)."""
    expected = eager(tmp_path, "gpt", layout)
    got = fit(tmp_path, "gpt", layout, True)
    assert_equal_runs(expected, got, atol=1e-5, rtol=1e-4)
    assert_compiled_as_eager(tmp_path, "gpt", layout, f"{layout}-True-None", 2)


class NoStack(pl.LightningModule):
    """A regression with no repeated block stack."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("case", ["keyword", "user", "user_cp", "experts_tp"])
def test_what_cannot_be_compiled_is_refused_at_setup_on_every_rank(case):
    """``compile=True``, or the user's ``torch.compile(module)``, on a module with no block stack: every rank
    refuses at setup naming ``blocks=`` and the strategy (never silently eager); the user's compile with context
    parallel, and compile where tensor parallelism divides a module's routed experts (not composed yet): refused
    naming it. Under fork the rank's ValueError reaches the caller inside torch's ProcessRaisedException, whose
    message is the rank's traceback."""
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    if case == "experts_tp":
        from experts_models import MoEModule

        module, data = MoEModule("mixtral"), DATA.train_set
        strategy = HybridParallelStrategy(tensor_parallel_size=2, compile=AOT, start_method="fork", timeout=60)
        match = "routed experts are divided over the tensor-parallel ranks, which compile does not compose with"
    elif case == "user_cp":
        module, data = torch.compile(seeded(gpt), backend="aot_eager"), DATA.train_set
        strategy = HybridParallelStrategy(context_parallel_size=2, start_method="fork", timeout=60)
        match = re.escape("GPT was compiled with torch.compile, which is not composed with context parallel yet")
    else:
        module = NoStack() if case == "keyword" else torch.compile(NoStack(), backend="aot_eager")
        strategy = DataParallelStrategy(compile=case == "keyword", start_method="fork", timeout=60)
        what = "compile=True" if case == "keyword" else "torch.compile (the module's"
        named = re.escape("`blocks='...'` (DataParallelStrategy's option")
        match = f"(?s)ValueError: `{re.escape(what)}.*compiles the blocks of a repeated block stack.*{named}"
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=2, max_steps=1))
    with pytest.raises(ProcessRaisedException, match=match):
        trainer.fit(module, DataLoader(data, batch_size=4))


class SaveAtEnd(pl.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def assert_same_values(got, expected, where="") -> None:
    """Nested dicts / lists of tensors and plain values: the same structure, every tensor equal."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), where
        for k in expected:
            assert_same_values(got[k], expected[k], f"{where}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same_values(g, e, f"{where}/{i}")
    else:
        assert got == expected, where


CHECKPOINT_LAYOUTS = ["pp2_1f1b", "dp2", "dp2_zero3", "dp2_tp2", "tp2"]
CHECKPOINT_SLOW = {"tp2", "dp2", "dp2_tp2"}


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", [pytest.param(l, marks=[pytest.mark.slow] if l in CHECKPOINT_SLOW else [])
                                    for l in CHECKPOINT_LAYOUTS])
def test_checkpoints_saved_compiled_resume_eager_and_back(tmp_path, layout):
    """A checkpoint saved compiled equals one saved eager (names and values of the parameters and of the optimizer
    state) and loads into a plain module; resuming it eager trains as resuming the eager one compiled. Under
    pipeline, tensor, data parallel (ZeRO 0 and 3: FSDP2's sharded state consolidated) and hybrid (DP2 x TP2)."""
    settings = {"eager": False, "compiled": AOT}
    saved = {name: str(tmp_path / f"{name}.ckpt") for name in settings}
    for name, path in saved.items():
        fit(tmp_path, "gpt", layout, settings[name], tag="-save", callbacks=[SaveAtEnd(path)])
    plain, compiled = (torch.load(saved[name], weights_only=True) for name in ("eager", "compiled"))
    assert list(compiled["state_dict"]) == list(plain["state_dict"]) == list(seeded(gpt).state_dict())
    for name in plain["state_dict"]:
        assert torch.equal(compiled["state_dict"][name], plain["state_dict"][name]), name
    assert plain["optimizer_states"] and plain["optimizer_states"][0]["state"]  # AdamW's moments, after 2 steps
    assert_same_values(compiled["optimizer_states"], plain["optimizer_states"], "optimizer_states")
    from lightning_par.models import GPT

    GPT.load_from_checkpoint(saved["compiled"])  # strict: the module's own names
    resumed_eager = fit(tmp_path, "gpt", layout, False, tag="-resume", max_steps=3, ckpt_path=saved["compiled"])
    resumed_compiled = fit(tmp_path, "gpt", layout, AOT, tag="-resume", max_steps=3, ckpt_path=saved["eager"])
    assert [r["global_step"] for r in resumed_eager] == [3] * LAYOUTS[layout][2]
    assert_equal_runs(resumed_eager, resumed_compiled, steps=1)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", ["pp2_1f1b", pytest.param("dp2_zero3", marks=pytest.mark.slow)])
def test_meta_build_with_weights_trains_compiled(tmp_path, layout):
    """A module built on the meta device with ``weights=``: compiled (lazily, after the weights are placed), the
    same run as eager."""
    from safetensors.torch import save_file

    from harness import Recorder, trainer_kwargs

    path = str(tmp_path / "w.safetensors")
    source = seeded(gpt)
    save_file({k: v.contiguous() for k, v in source.state_dict().items() if k != "lm_head.weight"}, path)  # tied
    cls, options, devices = LAYOUTS[layout]

    def run(compile):
        strategy = cls(compile=compile, weights=path, start_method="fork", timeout=120, **options)
        out = str(tmp_path / f"meta-{compile is not False}")
        trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=devices, max_steps=STEPS,
                                              callbacks=[Recorder(out)]))
        with trainer.init_module(empty_init=True):
            model = gpt()
        assert all(p.is_meta for p in model.parameters())
        trainer.fit(model, DataLoader(DATA.train_set, batch_size=8))
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(devices)]

    assert_equal_runs(run(False), run(AOT))


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", ["tp2", "dp2_zero3"])
def test_bf16_mixed_compiled_equals_eager(tmp_path, layout):
    """bf16-mixed on TP2 (autocast) and on ZeRO-3 (FSDP2's dtype policy: bf16 parameters gathered, fp32 gradient
    reduction): aot_eager traces under the same casts, the same bf16 kernels on the same values, so the runs agree
    as fp32 ones do (<= 1e-6)."""
    expected = fit(tmp_path, "gpt", layout, tag="-bf16", precision="bf16-mixed")
    got = fit(tmp_path, "gpt", layout, AOT, tag="-bf16", precision="bf16-mixed")
    assert_equal_runs(expected, got)
