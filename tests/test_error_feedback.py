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
        comp = mem.compensate(g.clone(), "w")  # compensate adds into the gradient it is given
        assert torch.equal(comp, g if residual is None else g + residual)
        payload, ctx = c.compress(comp, "w")
        mem.update(comp, "w", c, payload, ctx)
        sent = c.decompress(payload, ctx)
        assert sent.shape == comp.shape and sent.dtype == comp.dtype
        residual = mem.residuals["w"]
        assert torch.equal(sent + residual, comp), f"{name} step {step}"
        assert 0 < payload[0].numel() < comp.numel()  # it did sparsify, and sent something
        c.on_step(step + 1)


def test_residual_memory_allocates_nothing_per_step_and_snapshots_stay_valid():
    """Error feedback adds into the gradient it is given and writes the new residual into the
    buffer of the round before (two per tensor): no model-size allocation per step. A snapshot
    (references) taken before a round still holds that round's starting residual afterwards, so a
    rolled-back round restores it bitwise; after a restore no buffer is shared."""
    gen = torch.Generator().manual_seed(3)
    c, mem = compressors.get("topk", density=0.1), memories.get("residual")
    seen = set()
    snaps = []
    for step in range(6):
        g = torch.randn(64, 32, generator=gen)
        comp = mem.compensate(g, "w")
        assert comp.data_ptr() == g.data_ptr()
        snaps.append((mem.snapshot(), {k: v.clone() for k, v in mem.residuals.items()}))
        payload, ctx = c.compress(comp, "w")
        mem.update(comp, "w", c, payload, ctx)
        # bitwise what decompress-and-subtract gives
        assert torch.equal(mem.residuals["w"], comp - c.decompress(payload, ctx))
        seen.add(mem.residuals["w"].data_ptr())
    assert len(seen) == 2  # two buffers, alternating
    snap, copy = snaps[-1]
    assert all(torch.equal(snap.stored[k], copy[k]) for k in copy)  # the last round did not touch its start
    mem.restore(snap)
    assert all(torch.equal(mem.residuals[k], copy[k]) for k in copy)
    g = torch.randn(64, 32, generator=gen)
    comp = mem.compensate(g, "w")
    payload, ctx = c.compress(comp, "w")
    mem.update(comp, "w", c, payload, ctx)
    assert torch.equal(snap.stored["w"], copy["w"])  # the restored residual was read, never written


@pytest.mark.parametrize("name", ["topk", "gaussiank", "dgc", "redsync", "sidco", "adtopk", "mstopk", "oktopk"])
def test_sparse_residual_is_bitwise_decompress_and_subtract(name):
    """Sparsifiers' residual zeroes the sent coordinates; it must equal g - decompress(payload)."""
    gen = torch.Generator().manual_seed(5)
    c = compressors.get(name, density=0.05)
    for shape in [(4096,), (128, 96), (8, 16, 3, 3)]:
        g = torch.randn(shape, generator=gen)
        g.view(-1)[:7] = -0.0
        payload, ctx = c.compress(g, "w")
        out = torch.empty_like(g)
        c.residual(g, payload, ctx, out)
        ref = g - c.decompress(payload, ctx)
        assert torch.equal(out, ref) and torch.equal(out.signbit(), ref.signbit())
