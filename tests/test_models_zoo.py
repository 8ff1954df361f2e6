"""The model zoo: full-size tensor counts and sizes (built on the meta device: no memory), and a
forward / backward on each model's synthetic batch at a reduced size."""
from __future__ import annotations

import pytest
import torch

from adacomp.models import ZOO, build, synthetic_batch

# name -> (tensors, parameters in millions, largest tensor in millions) at the default size
FULL = {"resnet50": (161, 25.557, 2.359), "vgg16": (32, 138.358, 102.760),
        "gpt2_small": (148, 124.440, 38.597), "lstm_lm": (11, 19.780, 6.5)}
SMALL = {"resnet50": {"image_size": 32, "classes": 10}, "vgg16": {"image_size": 32, "hidden": 64, "classes": 10},
         "gpt2_small": {"vocab": 100, "width": 64, "heads": 4, "layers": 2, "seq": 8, "context": 16},
         "lstm_lm": {"vocab": 100, "embed": 16, "hidden": 16, "seq": 8}}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_full_size_shapes(name):
    with torch.device("meta"):
        model = build(name)
    sizes = [p.numel() for p in model.parameters()]
    tensors, total, largest = FULL[name]
    assert (len(sizes), round(sum(sizes) / 1e6, 3), round(max(sizes) / 1e6, 3)) == (tensors, total, largest)


def test_gpt2_read_out_is_tied_to_the_embedding():
    model = build("gpt2_small", **SMALL["gpt2_small"])
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and not any("head" in n for n in names)
    synthetic_batch(model, 2).loss(model).backward()
    assert model.wte.weight.grad is not None and model.wte.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(ZOO))
def test_synthetic_batch_trains(name):
    torch.manual_seed(0)
    model = build(name, **SMALL[name])
    data = synthetic_batch(model, 4, seed=1)
    assert torch.equal(synthetic_batch(model, 4, seed=1).inputs, data.inputs)  # deterministic per seed
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = float(data.loss(model).detach())
    for _ in range(5):
        opt.zero_grad()
        data.loss(model).backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
    assert float(data.loss(model).detach()) < first


def test_errors_name_the_choices():
    with pytest.raises(ValueError, match="valid choices: .*gpt2_small"):
        build("gpt3")
    with pytest.raises(TypeError, match="synthetic_batch"):
        synthetic_batch(build("cnn"), 2)
    with pytest.raises(ValueError, match="seq"):
        build("gpt2_small", seq=2048)
