"""Tiny mixture-of-experts models for the expert-parallel tests: Hugging Face families built from configs (no
downloads; fused 3-D experts through transformers' experts interface) and a hand-written per-expert
``nn.ModuleList`` MoE (the layout of older transformers and most hand-written code). None knows of lightning_par."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, SEQ = 64, 32, 8


def mixtral(layers: int = 2, experts: int = 4, top_k: int = 2):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                        num_experts_per_tok=top_k, max_position_embeddings=64, router_aux_loss_coef=0.02,
                        output_router_logits=True, tie_word_embeddings=False)
    return MixtralForCausalLM(cfg)


def qwen2_moe(layers: int = 2, experts: int = 4, top_k: int = 2):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=experts, num_experts_per_tok=top_k,
                         max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.02,
                         norm_topk_prob=False, tie_word_embeddings=False)
    return Qwen2MoeForCausalLM(cfg)


def deepseek_v3(layers: int = 2, experts: int = 4, top_k: int = 2):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=16,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                           n_routed_experts=experts, num_experts_per_tok=top_k, n_shared_experts=1, n_group=2,
                           topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
                           tie_word_embeddings=False)
    return DeepseekV3ForCausalLM(cfg)


FAMILIES = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "deepseek_v3": deepseek_v3}


class ListExpert(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListMoE(nn.Module):
    """Older Mixtral's loop: every expert called, possibly on no token."""

    def __init__(self, hidden: int = HIDDEN, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k, self.num_experts = top_k, experts
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(ListExpert(hidden, 16) for _ in range(experts))

    def forward(self, h):
        b, s, d = h.shape
        h = h.reshape(-1, d)
        logits = self.gate(h)
        weights, chosen = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        mask = F.one_hot(chosen, self.experts.__len__()).permute(2, 1, 0)
        for i in range(self.num_experts):
            idx, top = torch.where(mask[i])
            y = self.experts[i](h[top]) * weights[top, idx, None]
            out = out.index_add(0, top, y)
        return out.reshape(b, s, d), logits


class ListMoELM(nn.Module):
    """Embedding, two residual MoE layers, head; returns (logits, aux) with a load-balancing term."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(ListMoE(experts=experts) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        h = self.embed(idx)
        aux = 0.0
        for layer in self.layers:
            y, logits = layer(h)
            h = h + y
            probs = F.softmax(logits, -1)
            aux = aux + (probs.mean(0) ** 2).sum() * probs.shape[-1]
        return self.head(self.norm(h)), aux


class ListBlock(nn.Module):
    """A residual layer around :class:`ListMoE` returning the hidden state alone (a pipeline's block)."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.moe = ListMoE(experts=experts)

    def forward(self, h):
        return h + self.moe(h)[0]


class ListBlocksLM(nn.Module):
    """Embedding, two :class:`ListBlock` layers, head; no auxiliary loss (its router logits stay in the block)."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(ListBlock(experts) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def lm_loss(model, idx):
    """Next-token loss (+ the router's auxiliary loss the model computes) of any model above."""
    if isinstance(model, ListBlocksLM):
        return F.cross_entropy(model(idx)[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
    if isinstance(model, ListMoELM):
        logits, aux = model(idx)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1)) + 0.01 * aux
    out = model(input_ids=idx, labels=idx)
    return out.loss


import lightning.pytorch as pl  # noqa: E402


class MoEModule(pl.LightningModule):
    """How a user wraps an MoE LM: nothing here knows of parallelism. The loss is the model's own (next-token
    cross-entropy plus the router's auxiliary loss it computes); AdamW, or plain SGD where a gradient off by a
    constant factor must show."""

    def __init__(self, family: str = "mixtral", optimizer: str = "adamw", aux: bool = True, **kw):
        super().__init__()
        self.model = FACTORIES[family](**kw)
        self.optimizer = optimizer
        if not aux:  # no router loss: what it sees depends on how the tokens are split (context parallelism)
            self.model.config.output_router_logits = False

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model, batch[0])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


FACTORIES = {**FAMILIES, "list": ListMoELM, "list_blocks": ListBlocksLM}
