"""A 2-layer word-level LSTM language model (the "medium" PTB setup of Zaremba et al. 2014: 650
units, 10k words): ~19.8M parameters in 10 tensors, two 6.5M-element embedding / read-out matrices
and the LSTM gate matrices. Few, large, dense gradients: the opposite profile of a transformer."""
from __future__ import annotations

import torch

from adacomp.models.charlstm import CharLSTM
from adacomp.models.synthetic import Synthetic, tokens


class LSTMLM(CharLSTM):
    """The same embedding -> LSTM -> read-out network as :class:`CharLSTM`, at PTB "medium" size;
    ``seq`` is the synthetic batch's length."""

    def __init__(self, vocab: int = 10000, embed: int = 650, hidden: int = 650, layers: int = 2, seq: int = 35):
        if seq < 1:
            raise ValueError(f"seq must be >= 1, got {seq}")
        super().__init__(vocab, embed, hidden, layers)
        self.vocab, self.seq = vocab, seq

    def synthetic_batch(self, batch: int, generator: torch.Generator) -> Synthetic:
        return tokens(batch, self.seq, self.vocab, generator)
