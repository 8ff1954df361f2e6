"""VGG-16 (Simonyan & Zisserman 2015, configuration D): 13 convolutions and three linear layers,
~138M parameters of which one tensor, the first classifier layer (512*7*7 x 4096), holds ~103M.
That single huge tensor is what stresses per-tensor compression and adaptive policies. The 7x7
adaptive pool keeps the classifier's size for any input resolution, so small images stay cheap."""
from __future__ import annotations

import torch
from torch import nn

from adacomp.models.synthetic import Synthetic, images

CONFIG_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """``classes`` outputs; ``image_size`` >= 32 (224 in the paper); ``hidden`` is the classifier width."""

    def __init__(self, classes: int = 1000, image_size: int = 224, hidden: int = 4096):
        super().__init__()
        if classes < 1 or image_size < 32 or hidden < 1:
            raise ValueError(f"classes, hidden must be >= 1 and image_size >= 32, got {classes}, {hidden}, {image_size}")
        self.classes, self.image_size = classes, image_size
        layers: list[nn.Module] = []
        c = 3
        for v in CONFIG_D:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                c = int(v)
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, hidden), nn.ReLU(inplace=True),
                                        nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))

    def synthetic_batch(self, batch: int, generator: torch.Generator) -> Synthetic:
        return images(batch, 3, self.image_size, self.classes, generator)
