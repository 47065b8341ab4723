"""The pipeline's setup trace on meta-built modules whose code needs values ([Note: tracing a meta-built module] in
lightning_par/pipeline/stand_ins.py): Hugging Face Llama with and without a cache object (``use_cache=False``
runs transformers' ``find_packed_sequence_indices``, which calls ``.all()`` on the position ids), Qwen2 with tied
embeddings from the file ``save_pretrained`` writes (no ``lm_head.weight``), Mixtral (MoE: ``nonzero()`` picks the
experts that received tokens), T5 (encoder-decoder) and a module of our own that branches on ``mask.any()``
between the embedding and the blocks; under PP2 and pp2 × tp2, each equal to one device that loaded the same
file (fp32, 1e-5), and no rank's trace holding more stand-in bytes at once than the rank holds when training."""
import glob
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, Recorder, trainer_kwargs
from models import CausalLM, hf_model
from lightning_par import HybridParallelStrategy, PipelineParallelStrategy
from lightning_par.pipeline.flow import trace_flow
from lightning_par.pipeline.stand_ins import StandIns
from lightning_par.materialize import meta_parameters
from test_meta_weights import DATA, Block, Share, fit_and_record_one, save_weights
from test_pipeline import assert_pipeline_matches

pytest.importorskip("transformers")


class LitHF(CausalLM):
    """A user's wrapper of a Hugging Face causal LM built from a config (tests/models.py's), with AdamW's eps at 1e-6:
    see LitLM in test_pipeline_families.py (T5's tiny gradient entries)."""

    lr, weight_decay, eps, call_kw = 1e-3, 0.01, 1e-6, {}  # also for a subclass that builds its own layers

    def __init__(self, model):
        super().__init__(model, eps=self.eps)


def llama(use_cache):
    return lambda: LitHF(hf_model("llama", num_hidden_layers=4, tie_word_embeddings=False, use_cache=use_cache))


def qwen2():
    return LitHF(hf_model("qwen2", num_hidden_layers=4, tie_word_embeddings=True, use_cache=False))


def mixtral():
    return LitHF(hf_model("mixtral", num_hidden_layers=4, use_cache=False))


class LitT5(LitHF):
    def __init__(self):
        super().__init__(hf_model("t5", vocab_size=32, use_cache=False))

    def loss(self, batch):
        src, tgt = batch
        return self.model(input_ids=src, labels=tgt).loss


class Branchy(LitHF):
    """Our own module whose code between the embedding and the blocks needs values of the batch: it masks the
    tokens equal to 0 only ``if mask.any():`` (per sample: the loss of a batch is still the mean of its samples')."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(4))  # under tp each block is a region itself
        self.head = nn.Linear(16, 32)

    def loss(self, batch):
        idx, targets = batch
        x = self.embed(idx)
        mask = idx == 0
        if mask.any():
            x = x.masked_fill(mask[..., None], 0.0)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


# name -> factory, how its file is written ("hf": save_pretrained, the file's names without the "model." prefix;
# "module": safetensors' save_model of the Hugging Face model, since transformers 5's save_pretrained writes MoE
# experts under the per-expert names of older checkpoints, which only from_pretrained maps to the 3-D tensors)
MODELS = {"llama_no_cache": (llama(False), "hf"), "llama_cache": (llama(True), "hf"), "qwen2_tied": (qwen2, "hf"),
          "mixtral": (mixtral, "module"), "t5": (LitT5, "hf"), "branchy": (Branchy, "state")}
LAYOUTS = {
    "pp2": (2, lambda **kw: PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, start_method="fork",
                                                     timeout=120, **kw)),
    "pp2_tp2": (4, lambda **kw: HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2,
                                                       data_parallel_size=1, microbatches=2, start_method="fork",
                                                       timeout=120, **kw)),
}


@pytest.fixture(scope="module")
def weights_and_reference(tmp_path_factory):
    """Per model, once: its weights file as a user has it, and one device's record after loading that file."""
    made = {}

    def get(model):
        if model not in made:
            factory, kind = MODELS[model]
            root = tmp_path_factory.mktemp(model)
            torch.manual_seed(1)
            source = factory()
            if kind == "hf":  # Hugging Face's own file: a tied model's holds one name of each tie
                source.model.save_pretrained(str(root / "hf"))
                path, prefix = str(root / "hf" / "model.safetensors"), "model."
            elif kind == "module":  # the module's own names (see MODELS), one name of each tie as Hugging Face's
                from safetensors.torch import save_model

                path, prefix = str(root / "model.safetensors"), "model."
                save_model(source.model, path)
            else:
                path, prefix = str(root / "weights.safetensors"), ""
                save_weights(source, path)
            from safetensors.torch import load_file

            torch.manual_seed(2)
            ref_module = factory()
            missing, unexpected = ref_module.load_state_dict({prefix + k: v for k, v in load_file(path).items()},
                                                             strict=False)
            assert not unexpected and (kind != "state" or not missing)
            if model in ("qwen2_tied", "t5"):
                assert "model.lm_head.weight" in missing  # the tie is restored from the module, not the file
            made[model] = path, prefix, os.path.getsize(path), fit_and_record_one(ref_module, str(root / "ref"))
        return made[model]
    return get


class TraceBytes(pl.Callback):
    """The most stand-in bytes this rank's setup trace held at once."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        stand_ins = trainer.strategy._engine.stand_ins
        torch.save(stand_ins.peak_bytes if stand_ins is not None else None,
                   os.path.join(self.out_dir, f"trace{trainer.global_rank}.pt"))


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_meta_built_modules_that_need_values_match_one_device(tmp_path, weights_and_reference, model, layout):
    path, prefix, file_bytes, ref = weights_and_reference(model)
    devices, strategy = LAYOUTS[layout]
    out = str(tmp_path / "par")
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy(weights=path, weights_prefix=prefix), devices=devices,
                                          max_steps=2, callbacks=[Recorder(out), Share(out), TraceBytes(out)]))
    with trainer.init_module(empty_init=True):
        module = MODELS[model][0]()
    assert all(p.is_meta for p in module.parameters())
    trainer.fit(module, DataLoader(DATA.train_set, batch_size=8))
    load = lambda pattern: [torch.load(f, weights_only=False)  # noqa: E731
                            for f in sorted(glob.glob(os.path.join(out, pattern)))]
    got, shares, peaks = load("rank*.pt"), load("share*.pt"), load("trace*.pt")
    assert len(got) == len(shares) == len(peaks) == devices
    assert_pipeline_matches(ref, got)
    for rank, (share, peak) in enumerate(zip(shares, peaks)):
        # the trace ran with stand-ins, never holding more at once than the rank's share, and read nothing
        assert 0 < peak <= share["held_bytes"], (rank, peak, share["held_bytes"])
        assert 0 < share["read"] <= share["held_bytes"] < file_bytes, (rank, share)


class Refuses(Branchy):
    """Code that needs a value computed from the weights: the trace's zero stand-ins cannot give it."""

    def loss(self, batch):
        x = self.embed(batch[0])
        if (x == 0).all():
            raise ValueError("the embedding is all zeros")
        return super().loss(batch)


def test_a_trace_that_needs_weights_names_the_line_and_the_workaround():
    with meta_parameters():
        module = Refuses()
    batch = (DATA.train_set[0][0][None], DATA.train_set[0][1][None])
    stand_ins = StandIns(torch.device("cpu"))
    with pytest.raises(RuntimeError) as info:
        trace_flow(module, "blocks", module.blocks, lambda: module.loss(batch), stand_ins)
    text = str(info.value)
    assert "it raised ValueError: the embedding is all zeros, at " in text
    assert f"{__file__}:" in text and "in `loss`: `raise ValueError(\"the embedding is all zeros\")`" in text
    assert "`trainer.init_module(empty_init=False)`" in text and "[Note: tracing a meta-built module]" in text
    assert stand_ins.live == 0 and stand_ins.peak_bytes == 32 * 16 * 4  # the embedding's, for one operation
