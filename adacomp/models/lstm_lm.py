"""A 2-layer word-level LSTM language model (the "medium" PTB setup of Zaremba et al. 2014: 650
units, 10k words): ~19.8M parameters in 10 tensors, two 6.5M-element embedding / read-out matrices
and the LSTM gate matrices. Few, large, dense gradients: the opposite profile of a transformer."""
from __future__ import annotations

import torch
from torch import nn

from adacomp.models.synthetic import Synthetic, tokens


class LSTMLM(nn.Module):
    """Embedding -> ``layers``-layer LSTM -> linear read-out; ``seq`` is the synthetic batch's length."""

    def __init__(self, vocab: int = 10000, embed: int = 650, hidden: int = 650, layers: int = 2, seq: int = 35):
        super().__init__()
        for name, v in (("vocab", vocab), ("embed", embed), ("hidden", hidden), ("layers", layers), ("seq", seq)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.vocab, self.seq = vocab, seq
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, seq) int64 -> logits (batch, seq, vocab)."""
        out, _ = self.lstm(self.embed(x))
        return self.head(out)

    def synthetic_batch(self, batch: int, generator: torch.Generator) -> Synthetic:
        return tokens(batch, self.seq, self.vocab, generator)
