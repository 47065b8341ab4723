"""One checkpoint format for every layout: a checkpoint saved under any of {one device (plain Lightning),
dp2 zero 1, dp2 zero 3, pp2 1F1B, pp2 interleaved, tp2, pp2 × tp2} resumes under three others and the run continues as
the uninterrupted one-device run does (fp32, 1e-5: losses and parameters after two more AdamW steps with a
scheduled learning rate). The 1F1B pipeline splits the four blocks 3 + 1, the interleaved one 1 + 1 + 1 + 1. Each layout saves once (at the end of epoch 0; the runs stop with max_epochs, see
DESIGN.md "Learned in round 2"), in one of the two forms (one file / a DCP directory), and the three layouts
after it in LAYOUTS resume it, so every layout is reached three times; a DCP directory is converted to a file
with the command line tool for one of its resumes (and for one device, which only reads files).

The models know nothing of lightning_par: the reference GPT and a Hugging Face Llama built from a config.
"""
from __future__ import annotations

import glob
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, reference_loader, seeded, trainer_kwargs
from models import CausalLM, corpus, deep_warm_gpt
from lightning_par import DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_par.checkpoint import cli as checkpoint_cli
from lightning_par.models import GPT

DATA = corpus(train_sequences=16)
BATCH = 8  # global batch: 2 steps per epoch




class LlamaLM(CausalLM):
    """A Hugging Face Llama (from a config) trained with AdamW, two parameter groups and a warmup schedule."""

    def __init__(self):
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                       attn_implementation="sdpa")
        super().__init__(transformers.LlamaForCausalLM(cfg), attr="net", call={"use_cache": False})

    def configure_optimizers(self):
        norms = [p for n, p in self.named_parameters() if p.dim() < 2]
        weights = [p for n, p in self.named_parameters() if p.dim() >= 2]
        # [lr 1e-3: Adam turns a gradient near its eps into a near-full step, so the reduction-order noise of
        #  tensor parallelism (~1e-8) in such a gradient moved one o_proj weight by 2e-5 at lr 3e-3 in two steps]
        opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": norms, "weight_decay": 0.0}],
                                lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


MODELS = {"gpt": (deep_warm_gpt, GPT), "llama": (LlamaLM, LlamaLM)}

# name: (strategy factory taking save_distributed_checkpoint and keywords, devices, per-rank batch)
LAYOUTS = {
    "single": (None, 1, BATCH),
    "dp2_zero1": (lambda d, **kw: DataParallelStrategy(zero_stage=1, start_method="fork", timeout=120,
                                                       save_distributed_checkpoint=d, **kw), 2, BATCH // 2),
    "dp2_zero3": (lambda d, **kw: DataParallelStrategy(zero_stage=3, start_method="fork", timeout=120,
                                                       save_distributed_checkpoint=d, **kw), 2, BATCH // 2),
    "pp2_1f1b": (lambda d, **kw: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, schedule="1f1b",
                                                          balance=[3, 1], start_method="fork", timeout=120,
                                                          save_distributed_checkpoint=d, **kw), 2, BATCH),
    "pp2_interleaved": (lambda d, **kw: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2,
                                                                 schedule="interleaved_1f1b", stages_per_rank=2,
                                                                 start_method="fork", timeout=120,
                                                                 save_distributed_checkpoint=d, **kw), 2, BATCH),
    "tp2": (lambda d, **kw: TensorParallelStrategy(tensor_parallel_size=2, start_method="fork", timeout=120,
                                                   save_distributed_checkpoint=d, **kw), 2, BATCH),
    "pp2xtp2": (lambda d, **kw: HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2,
                                                       data_parallel_size=1, microbatches=2, start_method="fork",
                                                       timeout=120, save_distributed_checkpoint=d, **kw), 4, BATCH),
}
NAMES = list(LAYOUTS)
SAVES_DCP = {"dp2_zero1", "pp2_1f1b", "tp2", "pp2xtp2"}  # the others save one file (one device: plain Lightning's)


def resumers(layout: str) -> list[str]:
    i = NAMES.index(layout)
    return [NAMES[(i + k) % len(NAMES)] for k in (1, 2, 3)]


def test_every_layout_is_saved_and_reached_three_times():
    reached = [r for name in NAMES for r in resumers(name)]
    assert all(reached.count(name) == 3 for name in NAMES) and all(name not in resumers(name) for name in NAMES)


def run(layout, model, out, *, epochs, ckpt_path=None, save_dir=None, validate=False, dcp=None, **strategy_kw):
    factory, devices, batch = LAYOUTS[layout]
    dcp = layout in SAVES_DCP if dcp is None else dcp
    loader = reference_loader(DATA.train_set, batch) if layout == "single" else DataLoader(DATA.train_set, batch)
    callbacks = [ModelCheckpoint(dirpath=save_dir, save_top_k=-1, every_n_epochs=1)] if save_dir else []
    extra = dict(limit_val_batches=None, val_loader=DataLoader(DATA.val_set, batch_size=4)) if validate else {}
    return fit_and_record(seeded(MODELS[model][0]), loader, str(out), strategy=factory(dcp, **strategy_kw)
                          if factory else "auto", devices=devices, max_steps=-1, max_epochs=epochs,
                          callbacks=callbacks, enable_checkpointing=bool(save_dir), ckpt_path=ckpt_path, **extra)


def convert(src, dst, *extra):
    """lightning-par-checkpoint convert, in this process (tests/dist/test_checkpoint_cli.py runs the command)."""
    assert checkpoint_cli.main(["convert", str(src), str(dst), *extra]) == 0


_REFERENCE: dict = {}


def reference(model, tmp_path_factory):
    """The uninterrupted one-device run (2 epochs = 4 steps) and its checkpoint at the end of epoch 0 (validated
    at each epoch end like the runs that save, so that their loops' progress is the same)."""
    if model not in _REFERENCE:
        out = tmp_path_factory.mktemp(f"ref_{model}")
        rec = run("single", model, out / "run", epochs=2, save_dir=str(out / "ckpt"), validate=True)[0]
        _REFERENCE[model] = rec, torch.load(out / "ckpt" / "epoch=0-step=2.ckpt", weights_only=True)
    return _REFERENCE[model]


def assert_continues(ref: dict, layout: str, recs: list[dict]) -> None:
    """The resumed run's two steps are the uninterrupted run's third and fourth."""
    assert all(r["global_step"] == 4 for r in recs)
    if layout.startswith("dp"):  # rank-local losses of equal halves: their mean is the global batch's
        losses = torch.tensor([r["losses"] for r in recs]).mean(0)
    else:
        losses = torch.tensor(recs[0]["losses"])
    torch.testing.assert_close(losses, torch.tensor(ref["losses"][2:]), atol=1e-5, rtol=1e-5)
    covered = set()
    for rec in recs:  # a pipeline stage's copies of other stages' parameters are stale: compare what it trains
        trained = rec["grads"][-1].keys()
        covered |= trained
        for name in trained:
            torch.testing.assert_close(rec["params"][name], ref["params"][name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{layout} {name}: {m}")
    assert covered == set(ref["params"]), set(ref["params"]) ^ covered


@pytest.mark.timeout(4 * TIMEOUT_S)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("saved", NAMES)
def test_save_under_one_layout_resume_under_three_others(tmp_path, tmp_path_factory, saved, model):
    if model == "llama":
        pytest.importorskip("transformers")
    ref, ref_ckpt = reference(model, tmp_path_factory)
    recs = run(saved, model, tmp_path / "save", epochs=1, save_dir=str(tmp_path / "ckpt"), validate=True)
    path = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert path.exists() and not glob.glob(str(tmp_path / "ckpt" / ".*"))  # no hidden temporary left
    if saved in SAVES_DCP:
        assert path.is_dir() and glob.glob(str(path / "*.distcp"))
        as_file = tmp_path / "converted.ckpt"
        convert(path, as_file)
        # the converted file on one device, plain Lightning: the sharded run's validation loss
        module = MODELS[model][1].load_from_checkpoint(str(as_file), map_location="cpu")
        val = pl.Trainer(**trainer_kwargs(limit_val_batches=None)).validate(
            module, DataLoader(DATA.val_set, batch_size=4), verbose=False)[0]["val_loss"]
        assert val == pytest.approx(recs[0]["metrics"]["val_loss"], abs=1e-5)
        if model == "llama":  # the directory's weights under Hugging Face's names: from_pretrained takes them
            hf_dir = tmp_path / "hf"
            hf_dir.mkdir()
            convert(path, hf_dir / "model.safetensors", "--strip-prefix", "net.")
            module.net.config.save_pretrained(hf_dir)
            hf = type(module.net).from_pretrained(str(hf_dir))
            for name, tensor in module.net.state_dict().items():
                torch.testing.assert_close(hf.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
        sources = [as_file, path, path]
    else:
        assert path.is_file()
        as_file, sources = path, [path, path, path]
    # the file is plain Lightning's one-device checkpoint: same keys, same optimizer numbering and values
    raw = torch.load(as_file, weights_only=True)
    assert set(raw) - {"lightning_par"} == set(ref_ckpt) - {"lightning_par"}
    for key in ("epoch", "global_step", "lr_schedulers"):
        assert raw[key] == ref_ckpt[key], key
    val_progress = "epoch_loop.val_loop.batch_progress"  # data parallel: each rank validated half the batches
    loops, ref_loops = (dict(c["loops"], fit_loop={k: v for k, v in c["loops"]["fit_loop"].items()
                                                   if not (saved.startswith("dp") and k == val_progress)})
                        for c in (raw, ref_ckpt))
    assert loops == ref_loops
    torch.testing.assert_close(raw["state_dict"], ref_ckpt["state_dict"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(raw["optimizer_states"], ref_ckpt["optimizer_states"], atol=1e-5, rtol=1e-5)

    for layout, source in zip(resumers(saved), sources):
        if layout == "single":
            source = as_file  # plain Lightning reads files only
        resumed = run(layout, model, tmp_path / f"resume_{layout}", epochs=2, ckpt_path=str(source))
        assert_continues(ref, layout, resumed)


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("saved,dcp,resumed", [("pp2_1f1b", True, "tp2"), ("dp2_zero3", False, "pp2_interleaved")])
def test_async_save_completes_under_its_final_name_and_resumes(tmp_path, tmp_path_factory, saved, dcp, resumed):
    """`async_save=True`: the state is staged (one copy) and written in the background while training goes on;
    the checkpoint appears under its name only once complete, and resumes like a synchronous one."""
    ref, _ = reference("gpt", tmp_path_factory)
    run(saved, "gpt", tmp_path / "save", epochs=2, save_dir=str(tmp_path / "ckpt"), dcp=dcp, async_save=True)
    saves = sorted(os.listdir(tmp_path / "ckpt"))
    assert saves == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]  # both complete, no hidden temporary left
    path = tmp_path / "ckpt" / saves[0]
    assert path.is_dir() == dcp
    assert_continues(ref, resumed, run(resumed, "gpt", tmp_path / "resumed", epochs=2, ckpt_path=str(path),
                                       async_save=True))


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_another_models_checkpoint_is_refused_with_the_path_and_the_keys(tmp_path):
    """Another model's file resumed under a pipeline stops before training with an error naming the checkpoint
    and the keys (truncated files and directories: tests/unit/test_checkpoint_format.py)."""
    run("single", "gpt", tmp_path / "one", epochs=1, save_dir=str(tmp_path / "ckpt"))
    path = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    loader = DataLoader(DATA.train_set, BATCH)
    wider = GPT(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=24)
    trainer = pl.Trainer(**trainer_kwargs(strategy=LAYOUTS["pp2_1f1b"][0](False), devices=2, max_epochs=2))
    with pytest.raises(Exception, match=r"(?s)The checkpoint .*epoch=0-step=2\.ckpt does not fit GPT: .*mis-shaped: "
                                        r"tok_emb\.weight: checkpoint \(32, 16\), module \(32, 24\)"):
        trainer.fit(wider, loader, ckpt_path=str(path))
