"""Minimal ResNet-50, VGG-16, GPT-2-small-like and 2-layer LSTM LM for timing one backward pass
(the denominator of the cost table). Only the shapes and the FLOPs matter here; the package's model
zoo (adacomp.models) is used instead when it provides the model."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.down(x))


def resnet50() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(_Bottleneck(cin, width, stride if b == 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    return nn.Sequential(*layers)


def vgg16() -> nn.Module:
    layers: list[nn.Module] = []
    cin = 3
    for c in (64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0):
        if c:
            layers += [nn.Conv2d(cin, c, 3, padding=1), nn.ReLU(inplace=True)]
            cin = c
        else:
            layers.append(nn.MaxPool2d(2))
    layers += [nn.Flatten(), nn.Linear(25088, 4096), nn.ReLU(inplace=True), nn.Linear(4096, 4096),
               nn.ReLU(inplace=True), nn.Linear(4096, 1000)]
    return nn.Sequential(*layers)


class _GPT2(nn.Module):
    def __init__(self, vocab: int = 50257, d: int = 768, layers: int = 12, heads: int = 12, ctx: int = 1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.h = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        return self.ln_f(self.h(x, mask=mask, is_causal=True)) @ self.wte.weight.t()  # tied embeddings


class _LSTMLM(nn.Module):
    def __init__(self, vocab: int = 10000, h: int = 650):
        super().__init__()
        self.encoder, self.rnn = nn.Embedding(vocab, h), nn.LSTM(h, h, 2, batch_first=True)
        self.decoder = nn.Linear(h, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.rnn(self.encoder(idx))[0])


# name -> (model factory, batch factory, description of the batch)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], str]] = {
    "resnet50": (resnet50, lambda: torch.randn(8, 3, 224, 224), "8 x 3 x 224 x 224"),
    "vgg16": (vgg16, lambda: torch.randn(4, 3, 224, 224), "4 x 3 x 224 x 224"),
    "gpt2_small": (_GPT2, lambda: torch.randint(0, 50257, (4, 128)), "4 x 128 tokens"),
    "lstm_lm": (_LSTMLM, lambda: torch.randint(0, 10000, (20, 35)), "20 x 35 tokens"),
}


def backward_seconds(name: str, repeats: int = 2) -> tuple[float, int, str]:
    """Fastest of ``repeats`` backward passes (after one warm-up), the parameter count, the batch."""
    import time
    make, batch, desc = MODELS[name]
    torch.manual_seed(0)
    model, x = make(), batch()
    best = float("inf")
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        t0 = time.perf_counter()
        loss.backward()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best, sum(p.numel() for p in model.parameters()), desc
