"""The setup check of expert parallelism ([Note: the setup check of an expert-parallel MoE layer]) through
Lightning's Trainer on two gloo ranks: an MoE layer whose experts module renormalizes its top-k routing weights
itself (the dispatch hands it one (token, expert) pair a row, so it would see one weight and set it to 1: a silently
different model) is refused at setup on every rank, naming the layer, and so is a dispatch that drops the routing
weights' gradient (monkeypatched); ``verify=False`` skips the check. That the
check passes on Mixtral under ep 2, which still equals data parallel, is test_experts_strategy.py's
test_ep2_matches_data_parallel (the check on by default; its plan log names the checked layers)."""
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from experts_models import HIDDEN, VOCAB
from harness import TIMEOUT_S, fit_and_record, seeded
from models import corpus
from lightning_par import HybridParallelStrategy

DATA = corpus(train_sequences=8, seq_len=8)


class RenormExperts(nn.Module):
    """Fused experts (tensors [E, ...], called as experts(hidden_states, top_k_index, top_k_weights)) that
    renormalize the top-k weights of each token themselves."""

    def __init__(self, experts: int = 4, inner: int = 16):
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.randn(experts, inner, HIDDEN) * 0.2)
        self.down = nn.Parameter(torch.randn(experts, HIDDEN, inner) * 0.2)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        weights = top_k_weights / top_k_weights.sum(-1, keepdim=True)
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.shape[1]):
            for e in range(self.num_experts):
                rows = torch.nonzero(top_k_index[:, k] == e).reshape(-1)
                if rows.numel():
                    y = F.silu(hidden_states[rows] @ self.up[e].T) @ self.down[e].T
                    out = out.index_add(0, rows, y * weights[rows, k, None])
        return out


class RenormMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, 4, bias=False)
        self.experts = RenormExperts()

    def forward(self, h):
        b, s, d = h.shape
        x = h.reshape(-1, d)
        weights, chosen = torch.topk(F.softmax(self.gate(x), dim=-1), 2, dim=-1)
        return self.experts(x, chosen, weights).reshape(b, s, d)


class RenormLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(norm=nn.LayerNorm(HIDDEN), moe=RenormMoE())) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def training_step(self, batch, batch_idx):
        idx = batch[0]
        h = self.embed(idx)
        for layer in self.layers:
            h = h + layer["moe"](layer["norm"](h))
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, **kw):
    kw = dict(expert_parallel_size=2) | kw
    return fit_and_record(seeded(RenormLM), DataLoader(DATA.train_set, batch_size=2), str(tmp_path),
                          strategy=HybridParallelStrategy(start_method="fork", timeout=120, **kw), devices=2,
                          max_steps=2)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kw,how,fix", [
    (dict(expert_parallel_size=2), r"expert_parallel_size=2", r"Train it with expert_parallel_size=1"),
    (dict(expert_parallel_size=1, tensor_parallel_size=2),  # the experts divided over tp alone
     r"expert_parallel_size=1, the experts divided over tensor_parallel_size=2",
     r"Train it with tensor_parallel_size=1"),
])
def test_an_moe_layer_the_dispatch_changes_is_refused_at_setup(tmp_path, kw, how, fix):
    """Every rank raises the same ValueError naming the layer (the first of its kind), the difference and the fix."""
    with pytest.raises(Exception, match=rf"expert parallel \({how}\): the setup check of 'layers\.0\.moe' "
                                        rf"\(RenormMoE\) failed: the rewritten block's output 0 differs .* {fix}.*"
                                        rf"verify=False"):
        _fit(tmp_path, **kw)


@pytest.mark.timeout(TIMEOUT_S)
def test_a_dispatch_that_drops_the_routing_weights_gradient_is_refused_at_setup(tmp_path, monkeypatch):
    """A dispatch bug of the kind that trains a different model silently: the routing weights sent without their
    gradient (the router learns nothing from the experts' output). The forward is right; the input gradient is not."""
    import lightning_par.experts.apply as apply
    from experts_models import MoEModule

    dispatch = apply.dispatch_fused
    monkeypatch.setattr(apply, "dispatch_fused", lambda m, f, h, i, w, **kw: dispatch(m, f, h, i, w.detach(), **kw))
    with pytest.raises(Exception, match=r"the setup check of 'model\.model\.layers\.0\.mlp' \(\w+\) failed: the "
                                        r"rewritten block's input gradient 0 differs"):
        fit_and_record(seeded(lambda: MoEModule("mixtral")), DataLoader(DATA.train_set, batch_size=2), str(tmp_path),
                       strategy=HybridParallelStrategy(start_method="fork", timeout=120, expert_parallel_size=2),
                       devices=2, max_steps=1)


@pytest.mark.timeout(TIMEOUT_S)
def test_verify_false_skips_the_check(tmp_path):
    """The user who knows their model: the same layer trains (here: differently from one device, unchecked)."""
    got = _fit(tmp_path, verify=False)
    assert len(got) == 2 and all(len(rec["losses"]) == 2 for rec in got)
