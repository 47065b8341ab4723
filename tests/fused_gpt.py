"""A GPT written nanoGPT's way, with fused projections, for the tensor-parallel tests: q, k and v come from
one ``c_attn = nn.Linear(C, 3C)``, split with the global width (``layout="split"``) or viewed as
``(B, T, 3, heads, head_dim)`` (``layout="view"``); the MLP's gate and up come from one
``nn.Linear(C, 2·hidden)`` cut with ``chunk``. It knows nothing of lightning_par."""
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class FusedAttention(nn.Module):
    def __init__(self, n_embd, n_head, layout):
        super().__init__()
        self.n_embd, self.n_head, self.layout = n_embd, n_head, layout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        if self.layout == "split":
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        else:
            q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GatedMLP(nn.Module):
    def __init__(self, n_embd, hidden):
        super().__init__()
        self.gate_up = nn.Linear(n_embd, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, layout):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = FusedAttention(n_embd, n_head, layout)
        self.mlp = GatedMLP(n_embd, 2 * n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class FusedGPT(pl.LightningModule):
    def __init__(self, vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16, layout="split"):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, layout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = F.cross_entropy(self(idx).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        idx, targets = batch
        self.log("val_loss", F.cross_entropy(self(idx).flatten(0, 1), targets.flatten()))

    def configure_optimizers(self):
        # SGD, not Adam: the key bias's true gradient is zero (softmax ignores a per-query constant), so its
        # float round-off differs between layouts, and Adam's update g/sqrt(v) would blow that noise up to
        # lr-sized parameter differences; SGD's update is linear in the (1e-5-equal) gradients
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
