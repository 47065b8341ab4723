"""DataParallelStrategy's ZeRO stages on 2 real gloo ranks (fork start): stages 1, 2 and 3 against stage 0
(DDP) and against one process with the same global batch, on the reference GPT and on a tiny Hugging Face
Llama built from a config; consolidated checkpoints, clipping, accumulation, bf16-mixed and memory under
stage 3.

Stage 0 and the one-process reference are fitted once per model (module-scoped fixture); every fit runs
STEPS AdamW steps with a validation pass (``val_loss`` logged with ``sync_dist=True``) after step 3.
"""
import json
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from harness import (TIMEOUT_S, U_BF16, assert_close_records, assert_ranks_close, bf16_bound, fit_and_record,
                     fit_two_ranks, one_process_fit, reference_loader, seeded, trainer_kwargs)
from models import ManualGPT, causal_lm, corpus, warm_gpt
from lightning_par import DataParallelStrategy
from lightning_par.dp.fsdp import local_training_bytes
from lightning_par.models import GPT

PER_RANK = 4
STEPS = 4
FP32 = dict(atol=1e-5, rtol=1e-5)
EXACT = dict(atol=0.0, rtol=0.0)




LlamaLM = causal_lm("llama", attn_implementation="sdpa", lr=3e-3, weight_decay=0.1, call={"use_cache": False})


MODELS = {"gpt": warm_gpt, "llama": LlamaLM}


def zero(stage, **kw):
    return DataParallelStrategy(start_method="fork", zero_stage=stage, timeout=120, **kw)


class Bytes(Callback):
    """Writes ``local_training_bytes`` (parameters, gradients, optimizer state of this rank) at the end of the
    last training batch, gradients still present, to ``<dir>/bytes<rank>.json``."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == trainer.max_steps:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, f"bytes{trainer.global_rank}.json"), "w") as f:
                json.dump(local_training_bytes(pl_module, trainer.optimizers), f)


def read_bytes(out_dir, ranks=2):
    out = []
    for r in range(ranks):
        with open(os.path.join(out_dir, f"bytes{r}.json")) as f:
            out.append(json.load(f))
    return out


def fit_counting_bytes(tmp, name, strategy, *, max_steps=STEPS, callbacks=(), **kw):
    """:func:`harness.fit_two_ranks`, each rank also writing the bytes it sent and held (:class:`Bytes`)."""
    return fit_two_ranks(tmp, name, strategy, max_steps=max_steps, callbacks=[Bytes(str(tmp / name)), *callbacks],
                         **kw)


def assert_matches_one_process(ref, records, **tol):
    assert len(records) == 2
    mean_losses = torch.tensor([r["losses"] for r in records]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref["losses"]), **tol)
    for rec in records:
        assert_close_records(ref, rec, losses=False, **tol)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Per model: stage 0 (DDP, 2 ranks) and one process on the same global batches."""
    cache = {}

    def get(model):
        if model not in cache:
            tmp = tmp_path_factory.mktemp(f"base-{model}")
            data = corpus()
            ref = fit_and_record(seeded(MODELS[model]), reference_loader(data.train_set, 2 * PER_RANK),
                                 str(tmp / "ref"), max_steps=STEPS)[0]
            ddp = fit_counting_bytes(tmp, "zero0", zero(0), model=MODELS[model])
            cache[model] = {"ref": ref, "zero0": ddp, "zero0_bytes": read_bytes(str(tmp / "zero0"))}
        return cache[model]

    return get


# -- every stage against stage 0 and one process -----------------------------------------------------

@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_zero0_and_one_process(tmp_path, base, model, stage):
    if model == "llama":
        pytest.importorskip("transformers")
    b = base(model)
    module = seeded(MODELS[model])
    got = fit_counting_bytes(tmp_path, f"zero{stage}", zero(stage), module=module)
    assert_ranks_close(b["zero0"], got, **FP32)      # rank-local losses, grads, params, metrics
    assert_matches_one_process(b["ref"], got, **FP32)
    assert {"train_loss", "val_loss"} <= got[0]["metrics"].keys()
    # The caller's module (in this process: fork start) receives the trained weights, whole.
    torch.testing.assert_close(dict(module.named_parameters()), got[0]["params"], **EXACT)
    # Per rank, parameters + gradients + optimizer state: stage 3 (and 2, whose parameters are whole only
    # inside forward/backward) hold at most 1/N of stage 0's, + 5% (Adam's per-parameter step counters and
    # FSDP's padding of a dim 0 that N does not divide). Stage 1 shards the optimizer state only.
    full = b["zero0_bytes"][0]
    for rank, used in enumerate(read_bytes(str(tmp_path / f"zero{stage}"))):
        if stage >= 2:
            assert sum(used.values()) <= 1.05 * sum(full.values()) / 2, (rank, used, full)
        else:
            assert used["params"] == full["params"] and used["grads"] == full["grads"], (used, full)
            assert used["optimizer"] <= 0.6 * full["optimizer"], (used, full)


# -- communication ----------------------------------------------------------------------------------

class StepBytes(Callback):
    """Counts every collective of training batch ``batch`` from its start to the end of its backward (the
    optimizer step has none; the Recorder gathers gradients after that) with
    :func:`lightning_par.comm.count_comm`, and writes the wire bytes with the parameter bytes of the whole model
    and of its root unit to ``<dir>/comm<rank>.json``."""

    def __init__(self, out_dir, batch=2):
        self.out_dir, self.batch, self.mode = out_dir, batch, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_par.comm import CommCounter, count_comm

        if batch_idx == self.batch:
            self.counter = CommCounter()
            self.mode = count_comm(self.counter)
            self.mode.__enter__()

    def on_after_backward(self, trainer, pl_module):
        from lightning_par.pipeline.discovery import find_blocks

        if self.mode is None:
            return
        self.mode.__exit__(None, None, None)
        self.mode = None
        in_blocks = {id(p) for p in find_blocks(pl_module)[1].parameters()}
        size = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731  (global shapes)
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"comm{trainer.global_rank}.json"), "w") as f:
            json.dump({"wire": self.counter.wire_bytes, "calls": dict(self.counter.calls),
                       "params": size(pl_module.parameters()),
                       "root": size(p for p in pl_module.parameters() if id(p) not in in_blocks)}, f)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("stage", [2, 3])
def test_bytes_per_step_equal_fsdp_formula(tmp_path, model, stage):
    # GPT's training_step calls self(...) (the root unit is entered twice, nested); the Llama wrapper calls
    # self.model(...) (only the strategy enters the root): both must gather every unit exactly as FSDP's
    # formula says ([Note: running a step through the root unit]). Per rank, N = 2 ranks, P parameter bytes:
    # stage 3 gathers every unit in forward, every unit but the root again in backward, and reduce-scatters
    # every gradient: (N-1)/N (P + (P - P_root) + P); stage 2 gathers once: (N-1)/N 2P.
    if model == "llama":
        pytest.importorskip("transformers")
    fit_counting_bytes(tmp_path, "run", zero(stage), model=MODELS[model], validate=False,
                  callbacks=[StepBytes(str(tmp_path / "run"))])
    for r in range(2):
        with open(tmp_path / "run" / f"comm{r}.json") as f:
            got = json.load(f)
        p, root = got["params"], got["root"]
        formula = 0.5 * ((3 * p - root) if stage == 3 else 2 * p)
        assert got["wire"] == formula, got
        assert set(got["calls"]) <= {"all_gather", "all_gather[bwd]", "reduce_scatter", "reduce_scatter[bwd]"}, got


# -- consolidated checkpoints ------------------------------------------------------------------------

def checkpointed(tmp, name, strategy, data, steps=4):
    """Fit ``steps`` steps (2 ranks, or one process for ``strategy=None``) and save a checkpoint after the last."""
    ckpt = ModelCheckpoint(dirpath=str(tmp / name), filename="last", every_n_train_steps=steps,
                           save_on_train_epoch_end=False)
    if strategy is None:
        fit_and_record(seeded(warm_gpt), reference_loader(data.train_set, 2 * PER_RANK), str(tmp / f"{name}-rec"),
                       max_steps=steps, enable_checkpointing=True, callbacks=[ckpt])
    else:
        fit_counting_bytes(tmp, f"{name}-rec", strategy, max_steps=steps, data=data, validate=False,
                      enable_checkpointing=True, callbacks=[ckpt])
    return str(tmp / name / "last.ckpt")


def assert_resumed(full, resumed, start, **tol):
    assert len(full) == len(resumed)
    for f, r in zip(full, resumed):
        assert r["global_step"] == len(f["grads"]) and len(r["grads"]) == len(f["grads"]) - start
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(f["losses"][start:]), **tol)
        for step, grads in enumerate(r["grads"]):
            assert grads.keys() == f["grads"][start + step].keys()
            for n, grad in grads.items():
                torch.testing.assert_close(grad, f["grads"][start + step][n], **tol)
        torch.testing.assert_close(r["params"], f["params"], **tol)


@pytest.mark.timeout(TIMEOUT_S)
def test_zero3_checkpoint_is_consolidated_and_resumes(tmp_path):
    # One global batch per epoch: Lightning restarts a non-stateful loader at its epoch start after a mid-epoch
    # checkpoint, so with one batch per epoch the resumed run sees exactly the uninterrupted run's batches.
    data = corpus(train_sequences=2 * PER_RANK)
    full = fit_counting_bytes(tmp_path, "full", zero(3), max_steps=8, data=data, validate=False)
    path = checkpointed(tmp_path, "zero3", zero(3), data)

    ckpt = torch.load(path, weights_only=True)                      # plain content
    module = seeded(warm_gpt)
    expected = module.state_dict()
    assert ckpt["state_dict"].keys() == expected.keys()             # the module's own names, every tensor whole
    for k, v in expected.items():
        assert ckpt["state_dict"][k].shape == v.shape, k
    groups = module.configure_optimizers()["optimizer"].param_groups   # (lr_decay_steps given: needs no trainer)
    params = [p for g in groups for p in g["params"]]
    opt_state = ckpt["optimizer_states"][0]                          # torch's positional layout, every parameter
    assert sorted(opt_state["state"]) == list(range(len(params)))
    assert [len(g["params"]) for g in opt_state["param_groups"]] == [len(g["params"]) for g in groups]
    for i, p in enumerate(params):
        assert opt_state["state"][i]["exp_avg"].shape == p.shape, i

    # Resumed under stage 3 it continues the uninterrupted run bit for bit; under stage 0 (DDP) to fp32 rounding.
    assert_resumed(full, fit_counting_bytes(tmp_path, "resumed3", zero(3), max_steps=8, data=data, validate=False,
                                       ckpt_path=path), 4, **EXACT)
    assert_resumed(full, fit_counting_bytes(tmp_path, "resumed0", zero(0), max_steps=8, data=data, validate=False,
                                       ckpt_path=path), 4, **FP32)
    # On one device: load_from_checkpoint, and a plain run resumes it.
    loaded = GPT.load_from_checkpoint(path)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, ckpt["state_dict"][k], **EXACT)
    single = fit_and_record(seeded(warm_gpt), reference_loader(data.train_set, 2 * PER_RANK),
                            str(tmp_path / "single"), max_steps=8, ckpt_path=path)[0]
    assert single["global_step"] == 8
    torch.testing.assert_close(single["params"], full[0]["params"], **FP32)


@pytest.mark.timeout(TIMEOUT_S)
def test_zero0_checkpoint_equals_zero3_checkpoint_and_one_device_checkpoint_resumes_under_zero3(tmp_path):
    data = corpus(train_sequences=2 * PER_RANK)
    c0 = torch.load(checkpointed(tmp_path, "zero0", zero(0), data), weights_only=True)
    c3 = torch.load(checkpointed(tmp_path, "zero3", zero(3), data), weights_only=True)
    torch.testing.assert_close(c3["state_dict"], c0["state_dict"], **FP32)
    o0, o3 = c0["optimizer_states"][0], c3["optimizer_states"][0]
    assert o3["param_groups"] == o0["param_groups"]                  # hyper-parameters and positional ids
    assert o3["state"].keys() == o0["state"].keys()
    for i in o0["state"]:
        torch.testing.assert_close(o3["state"][i], o0["state"][i], **FP32)   # step, exp_avg, exp_avg_sq
    # A checkpoint written by a plain one-device run resumes under stage 3.
    full = fit_counting_bytes(tmp_path, "full", zero(3), max_steps=8, data=data, validate=False)
    single = checkpointed(tmp_path, "single", None, data)
    assert_resumed(full, fit_counting_bytes(tmp_path, "from_single", zero(3), max_steps=8, data=data, validate=False,
                                       ckpt_path=single), 4, **FP32)


# -- clipping and accumulation -----------------------------------------------------------------------

CLIP = 0.05


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_zero3_clipping_and_accumulation_equal_one_process(tmp_path, algorithm):
    data = corpus()
    clip = dict(gradient_clip_val=CLIP if algorithm == "norm" else CLIP / 20, gradient_clip_algorithm=algorithm)
    # Optimizer step j: each rank takes its loader batches 2j and 2j+1 of 2 samples; together these are the
    # one-process step-j batch of 8 of the same sampler (see harness.reference_loader).
    ref = one_process_fit(warm_gpt, data.train_set, 8, max_steps=3, **clip)
    got = fit_counting_bytes(tmp_path, "z3", zero(3), max_steps=3, per_rank=2, accumulate_grad_batches=2, data=data,
                        validate=False, **clip)
    # The loss a callback sees under accumulation is divided by k: a step's loss is the sum over its k
    # micro-batches of the mean over ranks.
    per_micro = torch.tensor([r["losses"] for r in got]).mean(0)
    torch.testing.assert_close(per_micro.view(-1, 2).sum(1), torch.tensor(ref["losses"]), **FP32)
    for rec in got:
        assert_close_records(ref, rec, losses=False, **FP32)   # grads (recorded before clipping) and params
    # The clip was active at every step: a norm clip computed on a rank's shard alone would have changed
    # the parameters (the global norm is over both shards).
    for grads in ref["grads"]:
        flat = torch.cat([g.flatten() for g in grads.values()])
        assert (flat.norm() > 2 * CLIP) if algorithm == "norm" else (flat.abs().max() > 2 * CLIP / 20)


# -- bf16-mixed ------------------------------------------------------------------------------------

# [Note: the bf16-mixed tolerance] is in tests/harness.py (bf16_bound).


class GatheredDtype(Callback):
    """Writes the dtype the first block's weights have *during* forward, and the dtypes of the parameters and
    gradients the optimizer steps, to ``<dir>/dtype<rank>.json``."""

    def __init__(self, out_dir):
        self.out_dir, self.seen = out_dir, None

    def on_train_start(self, trainer, pl_module):
        from lightning_par.pipeline.discovery import find_blocks

        block = find_blocks(pl_module)[1][0]
        hook = lambda module, args: setattr(self, "seen", str(next(module.parameters()).dtype))  # noqa: E731
        self.handle = block.register_forward_pre_hook(hook)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.handle.remove()
        os.makedirs(self.out_dir, exist_ok=True)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        with open(os.path.join(self.out_dir, f"dtype{trainer.global_rank}.json"), "w") as f:
            json.dump({"forward": self.seen, "params": sorted({str(p.dtype) for p in params}),
                       "grads": sorted({str(p.grad.dtype) for p in params})}, f)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_zero3_bf16_mixed_matches_zero0_to_bf16_precision(tmp_path, model):
    if model == "llama":
        pytest.importorskip("transformers")
    runs = {s: fit_counting_bytes(tmp_path, f"zero{s}", zero(s), model=MODELS[model], precision="bf16-mixed",
                             validate=False, callbacks=[GatheredDtype(str(tmp_path / f"zero{s}"))]) for s in (0, 3)}
    for stage, forward in ((0, "torch.float32"), (3, "torch.bfloat16")):   # stage 3 gathers bf16 weights
        for r in range(2):
            with open(tmp_path / f"zero{stage}" / f"dtype{r}.json") as f:
                assert json.load(f) == {"forward": forward, "params": ["torch.float32"], "grads": ["torch.float32"]}
    for z0, z3 in zip(runs[0], runs[3]):
        assert len(z3["grads"]) == STEPS
        for step, (g0, g3) in enumerate(zip(z0["grads"], z3["grads"])):
            assert g3.keys() == g0.keys()
            a = torch.cat([g3[n].flatten() for n in g0])
            b = torch.cat([g0[n].flatten() for n in g0])
            rel = float((a - b).norm() / b.norm())
            assert rel <= bf16_bound(model, step), f"step {step}: gradients differ by {rel:.3g} ({rel / U_BF16:.1f} u)"


# -- evaluation alone, manual optimization ---------------------------------------------------------

@pytest.mark.timeout(TIMEOUT_S)
def test_zero3_validate_and_test_alone_equal_zero0(tmp_path):
    data = corpus()
    loader = DataLoader(data.val_set, batch_size=PER_RANK)
    results = {}
    for stage in (0, 3):
        trainer = pl.Trainer(**trainer_kwargs(strategy=zero(stage), devices=2, limit_val_batches=2))
        results[stage] = (trainer.validate(seeded(warm_gpt), loader), trainer.test(seeded(warm_gpt), loader))
    assert results[3] == results[0] and results[3][0][0]["val_loss"] > 0 and results[3][1][0]["test_loss"] > 0


@pytest.mark.timeout(TIMEOUT_S)
def test_zero3_manual_optimization_equals_one_process(tmp_path):
    data = corpus()
    manual = lambda: ManualGPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16,  # noqa: E731
                               warmup_steps=2, lr_decay_steps=10)
    ref = one_process_fit(manual, data.train_set, 2 * PER_RANK, max_steps=3)
    got = fit_counting_bytes(tmp_path, "z3", zero(3), model=manual, max_steps=3, data=data, validate=False)
    assert_matches_one_process(ref, got, **FP32)


@pytest.mark.timeout(TIMEOUT_S)
def test_zero3_linear_lr_scaling_equals_one_process_with_scaled_lr(tmp_path):
    data = corpus()
    lr = 3e-3
    # Two ranks of 4: global batch 8 = 2 x one device's batch, factor 2 (see test_data_parallel's version).
    ref = fit_and_record(seeded(lambda: warm_gpt(lr=2 * lr)), reference_loader(data.train_set, 8),
                         str(tmp_path / "ref"), max_steps=3)[0]
    got = fit_counting_bytes(tmp_path, "scaled", zero(3, lr_scaling="linear"), model=lambda: warm_gpt(lr=lr), max_steps=3,
                        data=data, validate=False)
    assert_matches_one_process(ref, got, **FP32)


@pytest.mark.timeout(TIMEOUT_S)
def test_zero3_on_one_device_equals_a_plain_run(tmp_path):
    data = corpus()
    # one process iterates the user's loader as it is, as plain Lightning does ([Note: one process keeps the
    # user's loader] in lightning_par/topology.py): the reference is plain Lightning on the same loader
    ref = fit_and_record(seeded(warm_gpt), DataLoader(data.train_set, batch_size=PER_RANK), str(tmp_path / "ref"),
                         max_steps=3)[0]
    got = fit_and_record(seeded(warm_gpt), DataLoader(data.train_set, batch_size=PER_RANK), str(tmp_path / "z3"),
                         strategy=zero(3), devices=1, max_steps=3)
    assert len(got) == 1
    assert_close_records(ref, got[0], **FP32)
