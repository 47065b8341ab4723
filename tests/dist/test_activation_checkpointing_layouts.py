"""Activation checkpointing under every strategy on real gloo ranks (fork): with ``activation_checkpointing`` on,
every rank's losses, gradients and parameters equal the same layout's run without it (fp32, <= 1e-6: the same
arithmetic, recomputed), for the reference GPT with dropout 0.1 (the recompute draws the same masks), Hugging Face
Llama and T5 (two block stacks); a pipeline stage's blocks really run twice per micro-batch; a meta-built module
with ``weights=`` trains checkpointed; the Hydra app takes ``strategy.activation_checkpointing``."""
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, seeded
from models import CausalLM, corpus, deep_dropout_gpt, gpt_factory, hf_model
from lightning_par import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                           TensorParallelStrategy)
from lightning_par.pipeline.ghost import Ghost

DATA = corpus(train_sequences=32)
STEPS = 2
EXACT = dict(atol=1e-6, rtol=0.0)  # the same ops on the same values (recompute replays the forward): 0 or rounding



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


MODELS = {"gpt": deep_dropout_gpt, "llama": llama, "t5": LitT5}
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
    "pp2_dp2_zero3": (HybridParallelStrategy, {"pipeline_parallel_size": 2, "data_parallel_size": 2,
                                               "zero_stage": 3, "microbatches": 2}, 4),
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


def assert_equal_runs(expected: list[dict], got: list[dict], steps: int = STEPS) -> None:
    """Rank by rank: every loss, every gradient the rank holds, every parameter (<= 1e-6)."""
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(e["losses"]), **EXACT)
        assert len(g["grads"]) == len(e["grads"]) == steps
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
         ("gpt", "tp2", "selective"), ("gpt", "pp2_tp2", "full"), ("gpt", "pp2_dp2_zero3", "full"),
         ("llama", "pp2_1f1b", "full"),
         ("llama", "tp2", "full"), ("t5", "pp2_1f1b", "full"), ("t5", "tp2", "full")]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model,layout,ac", CASES, ids=[f"{m}-{l}-{a}" for m, l, a in CASES])
def test_checkpointed_run_equals_the_run_without(tmp_path, model, layout, ac):
    assert_equal_runs(without(tmp_path, model, layout), fit(tmp_path, model, layout, ac))


class CountBlocks(pl.Callback):
    """Per rank: how often each block this rank holds starts a forward in the first training step (a pre-hook:
    an early-stopped recompute never reaches a post-hook), to ``<out_dir>/calls<rank>.pt``."""

    def __init__(self, out_dir):
        self.out_dir, self.calls, self.handles = out_dir, {}, []

    def on_train_start(self, trainer, pl_module):
        for i, block in enumerate(pl_module.blocks):
            if not isinstance(block, Ghost):
                self.calls[i] = 0
                self.handles.append(block.register_forward_pre_hook(
                    lambda m, a, i=i: self.calls.__setitem__(i, self.calls[i] + 1)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            for h in self.handles:
                h.remove()
            torch.save(self.calls, os.path.join(self.out_dir, f"calls{trainer.global_rank}.pt"))


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("ac,twice", [(None, set()), ("full", set(range(6))), (2, {0, 2, 4})])
def test_a_stage_recomputes_its_blocks_counted_per_stack(tmp_path, ac, twice):
    """PP2, 6 blocks (3 per stage), 4 micro-batches: a checkpointed block starts 8 forwards in a step (4 and 4
    recomputed), another 4; with k = 2 the second stage recomputes blocks 4 (index % 2 == 0 in the stack), not 3
    and 5 (what counting per stage would pick)."""
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=4, balance="uniform",
                                        activation_checkpointing=ac, start_method="fork", timeout=120)
    fit_and_record(seeded(gpt_factory(n_layer=6)), DataLoader(DATA.train_set, batch_size=8), str(tmp_path),
                   strategy=strategy, devices=2, max_steps=1, callbacks=[CountBlocks(str(tmp_path))])
    calls = {**torch.load(tmp_path / "calls0.pt"), **torch.load(tmp_path / "calls1.pt")}
    assert calls == {i: 8 if i in twice else 4 for i in range(6)}


class SaveAtEnd(pl.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)  # every rank: the strategy gathers the stages


@pytest.mark.timeout(TIMEOUT_S)
def test_checkpoints_keep_the_names_and_resume_across_the_setting(tmp_path):
    """PP2: a checkpoint saved with checkpointing equals one saved without (names and values), loads into a plain
    module, and resuming it without checkpointing trains as resuming the other one with it."""
    def run(ac, out, **kw):
        strategy = PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=4, activation_checkpointing=ac,
                                            start_method="fork", timeout=120)
        return fit_and_record(seeded(deep_dropout_gpt), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / out),
                              strategy=strategy, devices=2, **kw)

    saved = {ac: str(tmp_path / f"{ac}.ckpt") for ac in (None, "full")}
    for ac, path in saved.items():
        run(ac, f"fit-{ac}", max_steps=2, callbacks=[SaveAtEnd(path)])
    plain, checkpointed = (torch.load(saved[ac], weights_only=True)["state_dict"] for ac in (None, "full"))
    assert list(checkpointed) == list(plain) == list(seeded(deep_dropout_gpt).state_dict())
    for name in plain:
        assert torch.equal(checkpointed[name], plain[name]), name
    from lightning_par.models import GPT

    GPT.load_from_checkpoint(saved["full"])  # strict: the module's own names
    resumed_without = run(None, "resume-without", max_steps=3, ckpt_path=saved["full"])
    resumed_with = run("full", "resume-with", max_steps=3, ckpt_path=saved[None])
    assert_equal_runs(resumed_without, resumed_with, steps=1)


@pytest.mark.timeout(TIMEOUT_S)
def test_meta_build_with_weights_trains_checkpointed(tmp_path):
    """PP2, a module built on the meta device with ``weights=``: checkpointed, the same run as without."""
    from safetensors.torch import save_file

    path = str(tmp_path / "w.safetensors")
    source = seeded(deep_dropout_gpt)
    save_file({k: v.contiguous() for k, v in source.state_dict().items() if k != "lm_head.weight"}, path)  # tied

    def run(ac):
        strategy = PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=4, activation_checkpointing=ac,
                                            weights=path, start_method="fork", timeout=120)
        from harness import Recorder, trainer_kwargs

        out = str(tmp_path / f"meta-{ac}")
        trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=2, max_steps=STEPS, callbacks=[Recorder(out)]))
        with trainer.init_module(empty_init=True):
            model = deep_dropout_gpt()
        assert all(p.is_meta for p in model.parameters())
        trainer.fit(model, DataLoader(DATA.train_set, batch_size=8))
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]

    assert_equal_runs(run(None), run("full"))


@pytest.mark.timeout(TIMEOUT_S)
def test_a_module_without_a_block_stack_is_refused_at_setup_naming_blocks(tmp_path):
    class Flat(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(16, 32)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0].float()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(Exception, match=r"activation_checkpointing='full'` recomputes the blocks of a repeated block "
                                        r"stack.*`blocks='...'` \(DataParallelStrategy's option"):
        fit_and_record(Flat(), DataLoader(DATA.train_set, batch_size=8), str(tmp_path), devices=2,
                       strategy=DataParallelStrategy(activation_checkpointing="full", start_method="fork",
                                                     timeout=120))


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.e2e  # launches the app's interpreter (pyproject's markers)
@pytest.mark.timeout(TIMEOUT_S)
def test_the_hydra_app_takes_the_setting(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    tiny = ["model.n_layer=2", "model.n_embd=16", "model.n_head=2", "data.seq_len=16", "data.batch_size=4",
            "data.train_sequences=32", "data.val_sequences=8", "trainer.max_steps=2", "trainer.devices=2",
            "strategy.start_method=fork", f"hydra.run.dir={tmp_path / 'run'}"]
    res = subprocess.run([sys.executable, "-m", "lightning_par.train", "strategy.activation_checkpointing=full",
                          *tiny], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S - 20)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    import yaml

    config = yaml.safe_load((tmp_path / "run" / ".hydra" / "config.yaml").read_text())
    assert config["strategy"]["activation_checkpointing"] == "full"
