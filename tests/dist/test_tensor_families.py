"""TensorParallelStrategy (tp=2) on model families written by others, as a user wraps them: Lightning's demo
Transformer (torch's nn.TransformerEncoderLayer / DecoderLayer), Hugging Face BertForMaskedLM and
T5ForConditionalGeneration built from tiny configs, and two attention modules as a user would write them.
Each trains equal to one process (fp32, 1e-5, several AdamW steps); what the plan shards, what it leaves
replicated and what the setup check found are asserted from the plan each run applied."""
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from harness import TIMEOUT_S, assert_close_records, fit_and_record, one_process_fit, seeded
from models import hf_model
from lightning_par.data import SyntheticCorpus
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.tensor.plan import build_plan

VOCAB, WIDTH, HEADS = 64, 32, 4
DATA = SyntheticCorpus(vocab_size=VOCAB, seq_len=16, train_sequences=32, val_sequences=8)
MATCHES = "sharded copy matches the whole one"


class DemoTransformer(pl.LightningModule):
    """Lightning's own demo model (``lightning.pytorch.demos.Transformer``) with its demo's loss."""

    def __init__(self):
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=VOCAB, ninp=WIDTH, nhead=HEADS, nhid=64, nlayers=2, dropout=0.0)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        return F.nll_loss(self.model(inputs, target), target.view(-1))

    def configure_optimizers(self):
        # eps 1e-5 rather than 1e-8: the key third of nn.MultiheadAttention's in_proj_bias has an exact gradient
        # of 0 (softmax ignores a shift of all of a query's scores), so its computed gradient is rounding noise
        # (measured: |g| <= 1.1e-8, differing by up to 7e-9 between one process and tp=2, as between any two
        # summation orders). Adam steps by lr * g / (|g| + eps): with eps 1e-8 that noise moves those biases by
        # ~lr = 1e-3 (seen, in a direction the noise picks); with eps 1e-5 by <= lr * 1e-3 = 1e-6 per step.
        # Both runs use the same AdamW; the real gradients here are >= 1e-5.
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-5)


class HFLM(pl.LightningModule):
    """A Hugging Face model called the usual way, with its own loss (``labels=``)."""

    def __init__(self, kind: str):
        super().__init__()
        if kind == "bert":
            self.model = hf_model("bert", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
                                  num_attention_heads=HEADS, max_position_embeddings=32)
        else:  # T5's own relative-attention buckets (32 up to distance 128)
            self.model = hf_model("t5", vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, num_heads=HEADS,
                                  relative_attention_num_buckets=32, relative_attention_max_distance=128)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return self.model(input_ids=inputs, labels=targets).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TemperedAttention(nn.Module):
    """Causal attention written out by hand (nanoGPT's slow path): a mask buffer applied with masked_fill and a
    learned per-head temperature that the module's own code multiplies in."""

    def __init__(self, d=WIDTH, heads=HEADS, block=16):
        super().__init__()
        self.heads = heads
        # no biases (as Llama): a key bias has an exact gradient of 0, which Adam would turn into noise-driven steps
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.temperature = nn.Parameter(torch.linspace(0.5, 1.5, heads).view(heads, 1, 1))
        self.register_buffer("causal", torch.tril(torch.ones(block, block, dtype=torch.bool)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * self.temperature / (C // self.heads) ** 0.5
        att = att.masked_fill(~self.causal[:T, :T], float("-inf")).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, T, C))


class WindowAttention(TemperedAttention):
    """Sliding-window attention over keys gathered with ``Tensor.unfold``, an op DTensor has no rule for."""

    def forward(self, x, window=4):
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        pad = lambda t: F.pad(t, (0, 0, window - 1, 0)).unfold(2, window, 1)  # noqa: E731  (B, H, T, hd, W)
        att = torch.einsum("bhtd,bhtdw->bhtw", q, pad(k)).softmax(-1) * self.temperature
        return self.o(torch.einsum("bhtw,bhtdw->bhtd", att, pad(v)).transpose(1, 2).reshape(B, T, C))


class ShortConv(nn.Module):
    """A causal depthwise convolution over the last few tokens, written with ``Tensor.unfold``."""

    def __init__(self, d=WIDTH, k=3):
        super().__init__()
        self.k, self.weight = k, nn.Parameter(torch.randn(k, d) / k)

    def forward(self, x):  # (B, T, C)
        return torch.einsum("btck,kc->btc", F.pad(x, (0, 0, self.k - 1, 0)).unfold(1, self.k, 1), self.weight)


class ConvMLP(nn.Module):
    """An MLP with a short convolution beside it (as in Hyena- / RWKV-style blocks)."""

    def __init__(self, d=WIDTH):
        super().__init__()
        self.fc, self.proj, self.conv = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), ShortConv(d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x))) + self.conv(x)


class UserLM(pl.LightningModule):
    def __init__(self, attention=TemperedAttention, shared_temperature=False, mlp=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(WIDTH), "attn": attention(),
                                                   **({"mlp": ConvMLP()} if mlp else {})}) for _ in range(2))
        if shared_temperature:  # one parameter every block's attention uses
            self.blocks[1]["attn"].temperature = self.blocks[0]["attn"].temperature
        self.head = nn.Linear(WIDTH, VOCAB)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        h = self.emb(inputs)
        for b in self.blocks:
            h = h + b["attn"](b["ln"](h))
            h = h + b["mlp"](h) if "mlp" in b else h
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class PlanRecorder(pl.Callback):
    """Rank 0 saves the plan its strategy applied (styles, islands, what was left replicated, the setup check)."""

    def __init__(self, path):
        self.path = path

    def on_fit_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            plan = trainer.strategy.plan
            torch.save({"styles": plan.styles, "islands": plan.islands, "replicated": plan.replicated,
                        "checked": plan.checked}, self.path)


def run_pair(tmp_path, factory, steps=3):
    ref = one_process_fit(factory, DATA.train_set, 4, max_steps=steps)
    plan_file = str(tmp_path / "plan.pt")
    got = fit_and_record(seeded(factory), DataLoader(DATA.train_set, batch_size=4), str(tmp_path / "tp"),
                         strategy=TensorParallelStrategy(tensor_parallel_size=2, start_method="fork", timeout=120),
                         devices=2, max_steps=steps, callbacks=[PlanRecorder(plan_file)])
    assert len(got) == 2 and len(ref["losses"]) == steps
    for rec in got:
        assert_close_records(ref, rec)
    return torch.load(plan_file, weights_only=False)


def sharded(plan, style):
    return {n for n, s in plan["styles"].items() if s == style}


@pytest.mark.timeout(TIMEOUT_S)
def test_lightning_demo_transformer(tmp_path):
    with pytest.warns(UserWarning, match=r"MultiheadAttention 'model\.transformer\.decoder\.layers\.1\.multihead_attn' "
                                         r"is left replicated"):
        build_plan(DemoTransformer(), 2)
    plan = run_pair(tmp_path, DemoTransformer)
    layers = [f"model.transformer.{s}.layers.{i}" for s in ("encoder", "decoder") for i in range(2)]
    assert sharded(plan, "colwise") == {f"{b}.linear1" for b in layers}
    assert sharded(plan, "rowwise") == {f"{b}.linear2" for b in layers}
    # the attention and the norms inside each layer run replicated, on plain tensors
    for b in layers:
        assert {plan["islands"][f"{b}.self_attn"], plan["islands"][f"{b}.norm1"], plan["islands"][f"{b}.norm2"]} == {b}
        assert plan["checked"][b] == MATCHES
    assert plan["islands"]["model.transformer.decoder.layers.0.multihead_attn"] == "model.transformer.decoder.layers.0"


@pytest.mark.timeout(TIMEOUT_S)
def test_hugging_face_bert_for_masked_lm(tmp_path):
    pytest.importorskip("transformers")
    plan = run_pair(tmp_path, lambda: HFLM("bert"))
    # Megatron's layout, found from dataflow: q, k, v -> attention.output.dense; intermediate -> output
    layers = [f"model.bert.encoder.layer.{i}" for i in range(2)]
    assert sharded(plan, "colwise") == {f"{b}.attention.self.{n}" for b in layers for n in ("query", "key", "value")} | \
        {f"{b}.intermediate.dense" for b in layers}
    assert sharded(plan, "rowwise") == {f"{b}.{n}.dense" for b in layers for n in ("attention.output", "output")}
    # each pair runs in the smallest module holding both of its sides; the norms there run replicated
    assert sharded(plan, "prepare") == set(layers) | {f"{b}.attention" for b in layers}
    assert plan["islands"]["model.bert.encoder.layer.0.attention.output.LayerNorm"] == "model.bert.encoder.layer.0.attention"
    assert plan["islands"]["model.bert.encoder.layer.1.output.LayerNorm"] == "model.bert.encoder.layer.1"
    assert all(plan["checked"][r] == MATCHES for r in sharded(plan, "prepare"))


@pytest.mark.timeout(TIMEOUT_S)
def test_hugging_face_t5_for_conditional_generation(tmp_path):
    pytest.importorskip("transformers")
    plan = run_pair(tmp_path, lambda: HFLM("t5"))
    attn = [f"model.{s}.block.{i}.layer.0.SelfAttention" for s in ("encoder", "decoder") for i in range(2)]
    attn += [f"model.decoder.block.{i}.layer.1.EncDecAttention" for i in range(2)]
    ffn = [f"model.encoder.block.{i}.layer.1.DenseReluDense" for i in range(2)]
    ffn += [f"model.decoder.block.{i}.layer.2.DenseReluDense" for i in range(2)]
    assert sharded(plan, "colwise") == {f"{a}.{n}" for a in attn for n in "qkv"} | {f"{f}.wi" for f in ffn}
    assert sharded(plan, "rowwise") == {f"{a}.o" for a in attn} | {f"{f}.wo" for f in ffn}
    assert all(plan["checked"][r] == MATCHES for r in attn + ffn)
    # the relative position bias (one per stack, in block 0) has every head: it is split like the scores it meets
    for stack in ("encoder", "decoder"):
        bias = f"model.{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"
        assert plan["islands"][bias] == bias.rpartition(".")[0]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_attention_using_its_own_parameter_and_mask_buffer(tmp_path, shared):
    # its own temperature becomes a replicated DTensor; one shared by both blocks stays plain and its gradient,
    # a DTensor from the regions' backward, is made plain again before the optimizer step
    plan = run_pair(tmp_path, lambda: UserLM(shared_temperature=shared))
    assert sharded(plan, "colwise") == {f"blocks.{i}.attn.{n}" for i in range(2) for n in "qkv"}
    assert plan["checked"]["blocks.0.attn"] == MATCHES


@pytest.mark.timeout(TIMEOUT_S)
def test_a_replicated_module_inside_a_region_runs_on_plain_tensors(tmp_path):
    # the convolution sits in the MLP's region but is not split: it runs on plain tensors, where Tensor.unfold
    # (which DTensor has no rule for) works
    plan = run_pair(tmp_path, lambda: UserLM(mlp=True))
    for i in range(2):
        assert plan["styles"][f"blocks.{i}.mlp.fc"] == "colwise" and plan["styles"][f"blocks.{i}.mlp.proj"] == "rowwise"
        assert plan["islands"][f"blocks.{i}.mlp.conv"] == f"blocks.{i}.mlp"
        assert plan["checked"][f"blocks.{i}.mlp"] == MATCHES


@pytest.mark.timeout(TIMEOUT_S)
def test_attention_with_an_op_dtensor_cannot_shard_is_left_replicated(tmp_path):
    plan = run_pair(tmp_path, lambda: UserLM(WindowAttention))
    assert not sharded(plan, "colwise") and not sharded(plan, "rowwise")
    for i in range(2):
        assert "aten.unfold" in plan["replicated"][f"blocks.{i}.attn"]


# -- the same rules without processes -----------------------------------------------------------------

def test_sequence_parallel_refuses_blocks_it_cannot_split():
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MultiheadAttention warnings
        with pytest.raises(ValueError, match=r"'model\.transformer\.encoder\.layers\.0' \(TransformerEncoderLayer\) "
                                             r"holds column-wise layers but sits directly in ModuleList"):
            build_plan(DemoTransformer(), 2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"'model\.bert\.encoder\.layer\.0' \(BertLayer\) holds column-wise layers"):
        build_plan(HFLM("bert"), 2, sequence_parallel=True)

    class Block(nn.Module):  # a per-token projection after the attention, inside the block
        def __init__(self):
            super().__init__()
            self.ln, self.attn, self.extra = nn.LayerNorm(WIDTH), TemperedAttention(), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return x + self.extra(self.attn(self.ln(x)))

    model = nn.ModuleDict({"blocks": nn.ModuleList([Block(), Block()])})
    assert build_plan(model, 2).styles["blocks.0.attn"] == "prepare" and "blocks.0.extra" not in build_plan(model, 2).styles
    with pytest.raises(ValueError, match=r"'blocks\.0\.extra' \(Linear\) sits in the block 'blocks\.0' beside its "
                                         r"attention / MLP but is neither one of them nor a norm.*sequence_parallel=False"):
        build_plan(model, 2, sequence_parallel=True)


def test_pairs_are_read_from_dataflow_where_a_block_can_be_run():
    pytest.importorskip("transformers")
    from lightning_par.tensor.plan import auto_plan
    from lightning_par.tensor.trace import traced_roles

    bert = HFLM("bert")
    # by shapes alone, BERT's square query, key, value look like a column pair with value as its row
    assert auto_plan(bert).styles["model.bert.encoder.layer.0.attention.self.value"] == "rowwise"
    roles = traced_roles(bert)
    assert set(roles) == {"model.bert.encoder.layer.0", "model.bert.encoder.layer.1"}
    assert roles["model.bert.encoder.layer.1"] == {
        **{f"model.bert.encoder.layer.1.attention.self.{n}": "col" for n in ("query", "key", "value")},
        "model.bert.encoder.layer.1.attention.output.dense": "row",
        "model.bert.encoder.layer.1.intermediate.dense": "col", "model.bert.encoder.layer.1.output.dense": "row"}
    # the MLM head after the stack is traced nowhere: it keeps the shape rule (no pair there)
    assert not any(n.startswith("model.cls") for n in build_plan(bert, 2).styles)
    # the region is BertAttention; the head count it splits is kept by its child, and is checked there
    with pytest.raises(ValueError, match=r"'model\.bert\.encoder\.layer\.0\.attention\.self' \(BertSelfAttention\) "
                                         r"has num_attention_heads=4, which is not divisible by tensor_parallel_size=8"):
        build_plan(bert, 8)


def test_attention_mask_placement_follows_the_heads():
    from types import SimpleNamespace as Spec

    from torch.distributed.tensor import Replicate, Shard

    from lightning_par.tensor.attention import _keyword_mask_options

    # (all-replicated offered, head-split offered) for a keyword mask beside 4 heads
    assert _keyword_mask_options(None, 4) == (True, True)
    assert _keyword_mask_options(Spec(shape=(2, 1, 16, 16), placements=(Replicate(),)), 4) == (True, True)  # broadcasts
    assert _keyword_mask_options(Spec(shape=(16, 16), placements=(Replicate(),)), 4) == (True, True)
    assert _keyword_mask_options(Spec(shape=(1, 4, 16, 16), placements=(Shard(1),)), 4) == (False, True)
    assert _keyword_mask_options(Spec(shape=(4, 16, 16), placements=(Shard(0),)), 4) == (False, True)
    # a head dim not split like the heads: the split option is not offered (a keyword is never redistributed)
    assert _keyword_mask_options(Spec(shape=(1, 4, 16, 16), placements=(Replicate(),)), 4) == (True, False)


def test_setup_check_leaves_a_failing_region_replicated_with_a_warning():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.tensor.probe import check_regions
    from lightning_par.tensor.rules import restore_rules

    # a one-rank process group is enough: DTensor dispatch (and its missing rule) is the same on one rank
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = UserLM(WindowAttention)
        plan = build_plan(model, 1)
        assert plan.styles["blocks.0.attn"] == "prepare" and plan.islands == {}
        with pytest.warns(UserWarning, match=r"'blocks\.0\.attn', 'blocks\.1\.attn' \(WindowAttention\) left replicated: "
                                             r"running it sharded on a copy at setup, the sharded module raised "
                                             r"NotImplementedError: Operator aten\.unfold"):
            check_regions(model, plan, mesh)
        assert not plan.sharded() and "blocks.0.attn" not in plan.styles
        good = UserLM()
        plan = check_regions(good, build_plan(good, 1), mesh)
        assert plan.checked == {"blocks.0.attn": MATCHES, "blocks.1.attn": MATCHES}
    finally:
        restore_rules()  # the strategy's teardown does it: DTensor's sharding tables are this process's
        dist.destroy_process_group()
