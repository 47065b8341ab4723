"""Pipeline parallelism on model families that hand blocks more than the hidden state or read their blocks:
Hugging Face T5 (the first block's relative position bias travels to every later block), Lightning's demo
``Transformer`` (``nn.TransformerEncoder`` reads ``self.layers[0].self_attn``), HF GPT-2 and BERT; each
against one process on the same global batches (fp32, 1e-5, several AdamW steps). And what the setup trace
refuses ([Note: block flow] in lightning_par/pipeline/flow.py), each with its message."""
import os
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, fit_and_record, free_port, one_process_fit, seeded, trainer_kwargs, start_ranks
from models import CausalLM, hf_model
from lightning_par.data import SyntheticCorpus
from lightning_par.pipeline import p2p
from lightning_par.pipeline.discovery import find_blocks
from lightning_par.pipeline.flow import trace_flow
from lightning_par.pipeline.stage import Ghost, shadow_of
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy
from test_pipeline import assert_pipeline_matches

DATA = SyntheticCorpus(vocab_size=64, seq_len=16, train_sequences=48, val_sequences=16)
STEPS = 3


class LitLM(pl.LightningModule):
    """A user's wrapper: ``build()`` makes the model, ``loss(batch)`` its training loss; AdamW."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        # eps 1e-6 rather than 1e-8: Adam's first step moves a parameter by lr * g / (|g| + eps), and T5 has
        # gradient entries of ~1e-8 (cancellations, float32 rounding of a 3e-2 scale), where that ratio is one
        # of rounding noise over rounding noise; with eps = 1e-8 a different summation order (stages summing a
        # shared parameter's gradient) moves such an entry by 3e-5 in one step. Not a tolerance: every
        # comparison stays at 1e-5.
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-6)


class LitT5(LitLM):
    def __init__(self, layers=2):
        super().__init__()
        self.model = hf_model("t5", num_layers=layers)

    def loss(self, batch):
        src, tgt = batch
        return self.model(input_ids=src, labels=tgt).loss


class LitDemoTransformer(LitLM):
    """Lightning's own demo model (``LightningTransformer``'s network and loss), tiny and without dropout."""

    def __init__(self, layers=2):
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=layers, dropout=0.0)

    def loss(self, batch):
        inputs, target = batch
        return F.nll_loss(self.model(inputs, target), target.view(-1))


class LitGPT2(CausalLM):
    def __init__(self):
        super().__init__(hf_model("gpt2"), eps=1e-6, sync_dist=False)  # eps: see LitLM


class LitBert(LitLM):
    def __init__(self):
        super().__init__()
        self.model = hf_model("bert")

    def loss(self, batch):
        idx, targets = batch
        return self.model(input_ids=idx, labels=targets).loss


def compare(tmp_path, factory, stages=2, steps=STEPS, **strategy_kw):
    """Fit ``factory()`` on one process and on ``stages`` pipeline ranks for ``steps`` steps; assert they match;
    return every rank's record (the largest loss difference is printed for the record)."""
    ref = one_process_fit(factory, DATA.train_set, 8, max_steps=steps)
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "pp"),
                         strategy=PipelineParallelStrategy(pipeline_parallel_size=stages, start_method="fork",
                                                           timeout=120, **strategy_kw),
                         devices=stages, max_steps=steps)
    assert len(got) == stages and len(ref["losses"]) == steps
    assert_pipeline_matches(ref, got)
    diff = max(abs(a - b) for rec in got for a, b in zip(rec["losses"], ref["losses"]))
    print(f"{factory().__class__.__name__} {strategy_kw}: max |loss diff| = {diff:.2e}")
    return got


T5_BIAS = "model.{}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"

# [Note: T5's third step]
# The tiny T5's gradient jumps with its parameters (ReLU kinks, a hard bucketed position bias): measured with the
# decoder split over two stages, the two runs' gradients agree to 5e-8 at steps 0 and 1 and their parameters
# after two steps to 2.6e-6 (Adam's response to rounding: [Note: Adam's response to rounding] in
# tests/harness.py), yet step 2's gradients differ by up to 1.7e-3 while its loss agrees to 1e-7. The
# difference is the model's, not the pipeline's: the one-process gradient at the pipeline's own parameters after
# two steps equals the pipeline's step-2 gradient to 1.7e-8, and with the learning rate 0 (equal parameters at
# every step) all six steps' gradients agree to 5e-8. Comparing a third step would compare where rounding
# happened to land, so the T5 cases compare two.


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("layers,stages,kw", [
    (2, 2, dict(microbatches=2)),  # encoder.block split 1 | 1, the decoder whole on the last stage
    (4, 2, dict(microbatches=2, schedule="interleaved_1f1b", stages_per_rank=2, balance="uniform")),
    (2, 2, dict(microbatches=2, blocks="model.decoder.block")),  # the decoder split; both its biases travel
    # one decoder block per stage, the encoder on all four; the middle stages split their backward
    (4, 4, dict(microbatches=4, blocks="model.decoder.block", schedule="zero_bubble", balance="uniform")),
], ids=["encoder-1f1b", "encoder-interleaved", "decoder-1f1b", "decoder-zero_bubble-4"])
def test_t5_position_bias_travels_with_the_hidden_state(tmp_path, layers, stages, kw):
    pytest.importorskip("transformers")
    # two steps: see [Note: T5's third step]
    got = compare(tmp_path, lambda: LitT5(layers), stages, steps=2, **kw)
    stack = "decoder" if "blocks" in kw else "encoder"
    # the bias table lives with block 0 on the first stage; its gradient comes back from the later stages too
    assert T5_BIAS.format(stack) in got[0]["grads"][0]
    assert not any(T5_BIAS.format(stack) in rec["grads"][0] for rec in got[1:])
    assert any(n.startswith(f"model.{stack}.block.{layers - 1}.") for n in got[-1]["grads"][0])


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("blocks", [None, "model.transformer.decoder.layers"])
def test_lightning_demo_transformer(tmp_path, blocks):
    """Stages whose layer 0 is a ghost run ``nn.TransformerEncoder.forward`` (it reads the first layer's
    attention); validation (no grad, eval mode: the fast-path checks) matches too."""
    settings = dict(max_steps=STEPS, val_check_interval=STEPS, limit_val_batches=2)
    val = DataLoader(DATA.val_set, batch_size=8)
    ref = one_process_fit(LitDemoTransformer, DATA.train_set, 8, val_loader=val, **settings)
    got = fit_and_record(seeded(LitDemoTransformer), DataLoader(DATA.train_set, batch_size=8), str(tmp_path / "pp"),
                         strategy=PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, blocks=blocks,
                                                           start_method="fork", timeout=120),
                         devices=2, val_loader=val, **settings)
    assert_pipeline_matches(ref, got)
    assert "val_loss" in ref["metrics"]
    for rec in got:
        assert rec["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], abs=1e-5)
    diff = max(abs(a - b) for rec in got for a, b in zip(rec["losses"], ref["losses"]))
    print(f"demo Transformer blocks={blocks}: max |loss diff| = {diff:.2e}")


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("factory", [LitGPT2, LitBert], ids=["gpt2", "bert"])
def test_hugging_face_gpt2_and_bert(tmp_path, factory):
    pytest.importorskip("transformers")
    compare(tmp_path, factory, microbatches=2)


# -- what the setup trace finds and refuses -------------------------------------------------------------
class PassBlock(nn.Module):
    """Returns (hidden, extra): ``extra`` is what it computed from its input, or what it was given."""

    def __init__(self, keep=True):
        super().__init__()
        self.lin, self.keep = nn.Linear(4, 4), keep

    def forward(self, x, extra=None):
        y = self.lin(x)
        return y, (y * 2 if extra is None else extra) if self.keep else None


class Net(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.layers = nn.ModuleList([PassBlock(keep=how != "skip" or i == 0) for i in range(3)])
        self.how = how

    def forward(self, x):
        h, extra = self.layers[0](x)
        first = extra
        for layer in self.layers[1:]:
            h, extra = layer(h, first if self.how == "skip" else extra)
        if self.how == "twice":
            for layer in self.layers:
                h, _ = layer(h)
        return h.sum()


def trace(net):
    path, container = find_blocks(net)
    return trace_flow(net, path, container, lambda: net(torch.randn(2, 4)))


def test_a_block_output_later_blocks_take_is_carried():
    flow = trace(Net("pass"))
    assert flow.arity == (2, 2, 2) and flow.carried == (1,) and flow.warnings == ()


def test_a_value_that_skips_a_block_is_refused():
    with pytest.raises(ValueError, match=r"Block `layers.2` takes `extra` = output 1 of block `layers.0`, which "
                                         r"block `layers.1` does not return"):
        trace(Net("skip"))


def test_blocks_called_twice_are_refused():
    with pytest.raises(ValueError, match=r"called the blocks of `layers` in the order \[0, 1, 2, 0, 1, 2\]"):
        trace(Net("twice"))


def test_a_stage_ending_in_a_block_the_step_never_calls_is_refused():
    flow = trace(Net("pass"))
    flow.check_stages("layers", [(0, 2), (2, 3)])  # every block runs
    sliced = type(flow)(arity=(2, 2))  # a step that runs `layers[:2]` of 4
    sliced.check_stages("layers", [(0, 2), (2, 4)])
    with pytest.raises(ValueError, match=r"calls only the first 2 blocks of `layers` \(of 4\), but pipeline stage 0 "
                                         r"would end at block 2, which never runs"):
        sliced.check_stages("layers", [(0, 3), (3, 4)])


class State:
    """Not a tensor: cannot cross a stage boundary."""


class StateBlock(PassBlock):
    def forward(self, x, state=None):
        return self.lin(x), state or State()


def test_a_carried_value_that_is_not_a_tensor_is_refused():
    net = nn.Sequential()
    net.layers = nn.ModuleList([StateBlock() for _ in range(2)])

    def step():
        x, s = torch.randn(2, 4), None
        for layer in net.layers:
            x, s = layer(x, s)

    with pytest.raises(ValueError, match=r"Block `layers.1` takes `state` = output 1 of block `layers.0` \(a State\); "
                                         r"only tensors can travel"):
        trace_flow(net, "layers", net.layers, step)


def test_the_trace_leaves_buffers_as_they_were():
    net = nn.Sequential()
    net.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2)])
    before = {k: v.clone() for k, v in net.state_dict().items()}
    flow = trace_flow(net, "layers", net.layers, lambda: net.layers[1](net.layers[0](torch.randn(8, 4))))
    assert flow.arity == (0, 0) and flow.carried == ()
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # batch-norm statistics untouched


def test_a_step_that_fails_in_the_trace_says_so():
    net = Net("pass")

    def step():
        raise KeyError("no such column")

    with pytest.raises(RuntimeError, match=r"Pipeline setup runs the step once .* blocks of `layers` .* raised "
                                           r"KeyError: 'no such column'"):
        trace_flow(net, "layers", net.layers, step)


def test_t5_reports_its_second_stack():
    pytest.importorskip("transformers")
    lm = seeded(LitT5)
    src, tgt = DATA.train_set[0]
    path, container = find_blocks(lm)
    flow = trace_flow(lm, path, container, lambda: lm.loss((src[None], tgt[None])))
    assert path == "model.encoder.block" and flow.carried == (1,) and flow.arity == (3, 3)
    assert len(flow.warnings) == 1
    assert "`model.decoder.block` (2 × T5Block) is a second block stack" in flow.warnings[0]
    assert "runs whole on the last stage" in flow.warnings[0] and "blocks='model.decoder.block'" in flow.warnings[0]


def test_a_ghost_answers_from_a_meta_shadow_and_holds_nothing():
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    ghost = Ghost(None, 0, shadow_of(layer))
    assert ghost.self_attn.batch_first and ghost.norm_first is False
    assert ghost.self_attn.in_proj_weight.shape == (24, 8) and ghost.self_attn.in_proj_weight.is_meta
    assert ghost.self_attn.in_proj_weight.requires_grad
    assert list(ghost.parameters()) == [] and ghost.state_dict() == {} and list(ghost.children()) == []
    assert not layer.self_attn.in_proj_weight.is_meta  # the block itself is untouched
    ghost.eval()
    assert not ghost.training and not ghost.self_attn.training
    with pytest.raises(AttributeError, match="block 0 of the pipelined stack lives on another pipeline stage"):
        ghost.no_such_thing


class LitSkipNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net("skip")

    def training_step(self, batch, batch_idx):
        return self.net(batch[0].float()[:, :4])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.timeout(TIMEOUT_S)
def test_the_strategy_refuses_at_setup():
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, start_method="fork", timeout=60)
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=2, max_steps=1))
    with pytest.raises(ProcessRaisedException, match=r"ValueError: Block `net.layers.2` takes `extra` = output 1"):
        trainer.fit(seeded(LitSkipNet), DataLoader(DATA.train_set, batch_size=8))


# -- bundles: the hidden state and the carried outputs in one frame, gradients back in one message --------
BUNDLES = [  # equal likes (the posted frame fits), a smaller batch and a None (refill), a bool of 3 bytes
    [torch.arange(24.0).view(2, 3, 4), torch.ones(1, 2, 3, 3)],
    [torch.arange(24.0).view(2, 3, 4) + 1, torch.ones(1, 2, 3, 3) * 2],
    [torch.arange(12.0).view(1, 3, 4), None],
    [torch.tensor([True, False, True]), torch.arange(6, dtype=torch.float64).view(2, 3)],
]


def _bundle_worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    works, got = [], []
    if rank == 0:
        last = None
        for i, bundle in enumerate(BUNDLES):
            p2p.send_bundle(bundle, 1, works, tag=i, posted_like=last)
            last = tuple(p2p.like_of(t) for t in bundle)
        floats = [t for t in BUNDLES[0] if t is not None]
        got = p2p.recv_grads(floats, 1, tag=99)
    else:
        posted = None  # the first bundle's headers travel alone, the others into a posted frame
        for i in range(len(BUNDLES)):
            got.append(p2p.recv_bundle(0, torch.device("cpu"), 2, tag=i, posted=posted))
            if i + 1 < len(BUNDLES):
                like = tuple(p2p.like_of(t) for t in got[-1])
                posted = p2p.post_recv_bundle(0, torch.device("cpu"), 2, tag=i + 1, like=like)
        p2p.send_grads([t * 10 for t in got[0]], 0, works, tag=99)
    p2p.wait_all(works)
    copies = [[None if t is None else t.clone() for t in b] if isinstance(b, list) else b.clone() for b in got]
    torch.save(copies, os.path.join(out_dir, f"got{rank}.pt"))  # views of one frame, saved apart
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_bundles_deliver_every_entry_and_their_gradients(tmp_path):
    port = free_port()
    start_ranks(_bundle_worker, (port, str(tmp_path)), 2)
    received = torch.load(tmp_path / "got1.pt")
    assert len(received) == len(BUNDLES)
    for sent, got in zip(BUNDLES, received):
        for a, b in zip(sent, got):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
    grads = torch.load(tmp_path / "got0.pt")
    assert [torch.equal(g, t * 10) for g, t in zip(grads, BUNDLES[0])] == [True, True]
