"""A seeded random Markov source whose entropy rate is known exactly, and the corpus sampled from it.

Each row of the transition matrix is ``softmax(sharpness × N(0, 1))`` over the vocabulary, drawn from
a seeded generator. Every sequence starts from the stationary distribution, so for every predicted
position the best possible expected loss is the entropy rate

    H = -Σ_i π_i Σ_j P_ij log P_ij        (nats/token; π the stationary distribution of P)

which a model can reach only by learning P exactly: the *loss floor* a run reports next to its loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class MarkovSource:
    vocab_size: int = 64
    sharpness: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size={self.vocab_size} must be at least 2.")
        if self.sharpness < 0:
            raise ValueError(f"sharpness={self.sharpness} must be >= 0 (0 gives uniform transitions).")

    @cached_property
    def transition(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        logits = self.sharpness * torch.randn(self.vocab_size, self.vocab_size, generator=g, dtype=torch.float64)
        return torch.softmax(logits, dim=-1)

    @cached_property
    def stationary(self) -> torch.Tensor:
        """π with π P = π, by power iteration (P has all entries > 0, so it converges)."""
        pi = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for _ in range(10_000):
            nxt = pi @ self.transition
            if torch.max(torch.abs(nxt - pi)) < 1e-15:
                return nxt
            pi = nxt
        return pi

    @cached_property
    def entropy_rate(self) -> float:
        """The loss floor in nats/token."""
        p = self.transition
        row_entropy = -(p * torch.log(p)).sum(dim=-1)
        return float(self.stationary @ row_entropy)

    def sample(self, num_sequences: int, length: int, seed: int) -> torch.Tensor:
        """``num_sequences`` independent chains of ``length`` tokens (int64), each started from π."""
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(num_sequences, length, dtype=torch.long)
        out[:, 0] = torch.multinomial(self.stationary.float(), num_sequences, replacement=True, generator=g)
        probs = self.transition.float()
        for t in range(1, length):
            out[:, t] = torch.multinomial(probs[out[:, t - 1]], 1, generator=g).squeeze(1)
        return out
