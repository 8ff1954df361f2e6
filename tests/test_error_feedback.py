"""Error feedback with memory ``residual`` is exact for every registered sparsifier.

For each compressor with ``sparse = True`` (discovered through the registry, so a new sparsifier is
covered without editing this file): ``compensated == decompress(payload) + new residual`` bit for
bit, and the next ``compensate`` returns ``g + residual``. Runs several steps so stateful methods
(interleaving, threshold reuse, warm-up, adaptive stages) go through their phases.
"""
from __future__ import annotations

import pytest
import torch

from adacomp import compressors, memories

SPARSE = [n for n in compressors.names() if compressors.registry.cls(n).sparse]
SHAPES = [(4096,), (64, 96), (16, 8, 3, 3)]
STEPS = 24  # past ADTopk-t's sigma = 15 warm-up and several tau re-estimations


def test_every_sparsifier_is_covered():
    expected = {"topk", "gtopk", "mstopk", "adtopk", "adtopk_i", "adtopk_t", "dgc", "gaussiank", "redsync",
                "sidco", "oktopk"}
    missing = sorted(expected - set(SPARSE))
    if missing:
        pytest.skip(f"not registered yet: {missing}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", SPARSE)
def test_residual_identity_is_exact(name, shape):
    g_ = torch.Generator().manual_seed(sum(map(ord, name)) * 7 + len(shape))  # deterministic, no hash()
    c, mem = compressors.get(name, density=0.05), memories.get("residual")
    residual = None
    for step in range(STEPS):
        g = torch.randn(shape, generator=g_) * (1 + step % 3)
        comp = mem.compensate(g, "w")
        assert torch.equal(comp, g if residual is None else g + residual)
        payload, ctx = c.compress(comp, "w")
        mem.update(comp, "w", c, payload, ctx)
        sent = c.decompress(payload, ctx)
        assert sent.shape == comp.shape and sent.dtype == comp.dtype
        residual = mem.residuals["w"]
        assert torch.equal(sent + residual, comp), f"{name} step {step}"
        assert 0 < payload[0].numel() < comp.numel()  # it did sparsify, and sent something
        c.on_step(step + 1)
