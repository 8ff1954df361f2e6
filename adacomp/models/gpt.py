"""A GPT-2-small-like decoder (Radford et al. 2019): 12 pre-norm blocks, width 768, 12 heads,
vocabulary 50257, context 1024, read-out tied to the token embedding. ~124M parameters in 148
tensors: the 38.6M-element embedding (its gradient gets both the input and the read-out part),
four weight matrices and eight vectors per block. Transformer gradients mix a few large matrices
with many tiny LayerNorm / bias vectors, which is what per-tensor policies must handle."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from adacomp.models.synthetic import Synthetic, tokens


class Block(nn.Module):
    """LayerNorm -> causal self-attention -> residual; LayerNorm -> 4x MLP (GELU) -> residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Small(nn.Module):
    """Defaults are GPT-2 small; shrink ``layers`` / ``width`` / ``vocab`` for quick tests.
    ``seq`` is the synthetic batch's sequence length (not the context: that is ``context``)."""

    def __init__(self, vocab: int = 50257, context: int = 1024, width: int = 768, layers: int = 12,
                 heads: int = 12, seq: int = 64):
        super().__init__()
        for name, v in (("vocab", vocab), ("context", context), ("layers", layers), ("heads", heads), ("seq", seq)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if width % heads or seq > context:
            raise ValueError(f"width ({width}) must be a multiple of heads ({heads}) and seq ({seq}) <= context ({context})")
        self.vocab, self.seq = vocab, seq
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx``: (batch, seq) int64 -> logits (batch, seq, vocab); the read-out reuses ``wte``."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)

    def synthetic_batch(self, batch: int, generator: torch.Generator) -> Synthetic:
        return tokens(batch, self.seq, self.vocab, generator)
