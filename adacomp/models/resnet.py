"""ResNet-50 (He et al. 2016, the bottleneck variant with [3, 4, 6, 3] blocks): ~25.6M parameters
in 161 tensors, mostly 3x3 / 1x1 convolutions plus batch-norm vectors; the standard CNN workload
of the compression papers. Written here so the package needs no torchvision."""
from __future__ import annotations

import torch
from torch import nn

from adacomp.models.synthetic import Synthetic, images


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand x4, plus a projected shortcut when shapes change."""

    expansion = 4

    def __init__(self, inp: int, width: int, stride: int = 1):
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(inp, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = (nn.Sequential(nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
                           if stride != 1 or inp != out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        return torch.relu(self.bn3(self.conv3(h)) + self.downsample(x))


class ResNet50(nn.Module):
    """``classes`` outputs; any ``image_size`` >= 32 works (adaptive pooling), 224 is the paper's."""

    def __init__(self, classes: int = 1000, image_size: int = 224, blocks: tuple[int, ...] = (3, 4, 6, 3)):
        super().__init__()
        if classes < 1 or image_size < 32:
            raise ValueError(f"classes must be >= 1 and image_size >= 32, got {classes}, {image_size}")
        self.classes, self.image_size = classes, image_size
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, inp = [], 64
        for i, n in enumerate(blocks):
            width = 64 * 2 ** i
            for j in range(n):
                layers.append(Bottleneck(inp, width, stride=2 if (j == 0 and i > 0) else 1))
                inp = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(inp, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layers(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    def synthetic_batch(self, batch: int, generator: torch.Generator) -> Synthetic:
        return images(batch, 3, self.image_size, self.classes, generator)
