"""Models for the built-in job, tests and benchmarks.

Small ones (``cnn``, ``mlp``, ``charlstm``) for the built-in job and fast tests; the zoo
(``resnet50``, ``vgg16``, ``gpt2_small``, ``lstm_lm``: realistic tensor counts and sizes, no
torchvision) for benchmarks and policy stress tests, each with ``synthetic_batch`` (see
:func:`adacomp.models.synthetic.synthetic_batch`).
"""
from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two conv layers and two linear layers for 8x8 digits (~40k parameters)."""

    def __init__(self, channels: int = 16, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc1 = nn.Linear(2 * channels * 16, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class FashionCNN(nn.Module):
    """conv 5x5 (32) - pool - conv 5x5 (64) - pool - fc 128 - fc 10 for 28x28 images (~0.45M
    parameters): ``adacomp bench time_to_accuracy``'s Fashion-MNIST model."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class MLP(nn.Module):
    """A plain MLP; ``width`` and ``depth`` scale it for benchmarks (e.g. ~10M parameters).
    ``hidden`` gives each hidden layer's width instead (e.g. ``(2048, 2048, 1024)``)."""

    def __init__(self, inputs: int = 64, width: int = 256, depth: int = 2, classes: int = 10,
                 hidden: tuple[int, ...] | None = None):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        d = inputs
        for w in (hidden if hidden is not None else (width,) * depth):
            layers += [nn.Linear(d, w), nn.ReLU()]
            d = w
        layers.append(nn.Linear(d, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


from adacomp.models.charlstm import CharLSTM  # noqa: E402 - defined after the small models above
from adacomp.models.gpt import GPT2Small  # noqa: E402
from adacomp.models.lstm_lm import LSTMLM  # noqa: E402
from adacomp.models.resnet import ResNet50  # noqa: E402
from adacomp.models.synthetic import Synthetic, synthetic_batch  # noqa: E402,F401 - re-exported
from adacomp.models.vgg import VGG16  # noqa: E402

ZOO: dict[str, type[nn.Module]] = {"resnet50": ResNet50, "vgg16": VGG16, "gpt2_small": GPT2Small, "lstm_lm": LSTMLM}
MODELS: dict[str, type[nn.Module]] = {"cnn": DigitsCNN, "mlp": MLP, "charlstm": CharLSTM, **ZOO}


def build(name: str, **kwargs: int) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid choices: {', '.join(sorted(MODELS))}")
    return MODELS[name](**kwargs)
