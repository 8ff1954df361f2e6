"""A character-level LSTM language model: the convergence suite's sequence task.

Embedding -> one LSTM layer -> linear read-out over the vocabulary, predicting the next character
at every position. Its gradients have the shapes compressors meet in recurrent models: two large
gate matrices (``weight_ih``: 4H x E, ``weight_hh``: 4H x H) plus an embedding and a read-out, so
low-rank methods get real matrices and sparsifiers get a mix of dense and sparse-ish gradients
(embedding rows of unseen characters are zero).
"""
from __future__ import annotations

import torch
from torch import nn


class CharLSTM(nn.Module):
    """``vocab`` symbols, ``embed``-wide embedding, ``hidden`` LSTM units (~100k parameters at defaults)."""

    def __init__(self, vocab: int = 96, embed: int = 32, hidden: int = 128, layers: int = 1):
        super().__init__()
        for name, v in (("vocab", vocab), ("embed", embed), ("hidden", hidden), ("layers", layers)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, seq) int64 -> logits (batch, seq, vocab)."""
        out, _ = self.lstm(self.embed(x))
        return self.head(out)
