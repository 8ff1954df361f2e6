"""adacomp.tensors: flat views without a dispatch where the tensor is flat already, and the
in-place residual's copy left out where it would copy a tensor onto itself."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adacomp import compressors
from adacomp.compressors.sparse import sparse_residual
from adacomp.tensors import Dispatch, flat_of, flat_view, same_elements


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("skip", [True, False])
def test_flat_views_are_reshapes_elements(skip: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Dispatch, "skip_no_ops", skip)
    one, two = torch.arange(12.0), torch.arange(12.0).view(3, 4)
    strided = torch.arange(24.0)[::2]
    for t in (one, two, strided, two.t()):  # two.t(): reshape copies, the helper too
        pairs = [(flat_of(t), t.reshape(-1))] + ([(flat_view(t), t.view(-1))] if t.is_contiguous() else [])
        for got, want in pairs:
            assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)
            aliases = want.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            assert (got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()) == aliases
    assert (flat_of(one) is one) == skip and (flat_view(one) is one) == skip
    with pytest.raises(RuntimeError):
        flat_view(two.t())  # no view of a transposed matrix: view's error, not a silent copy
    with _Ops() as ops:
        flat_of(one), flat_view(strided), flat_of(two)
    assert ops.count["view"] == (1 if skip else 3)


def test_same_elements_only_for_the_very_same_elements() -> None:
    t = torch.arange(16.0)
    assert same_elements(t[2:10], t.view(-1)[2:10])
    assert not same_elements(t[2:10], t[2:9]) and not same_elements(t[2:10], t[3:11])
    assert not same_elements(t[:8], t.view(2, 8)[0].view(8, 1).view(8)[:8].clone())
    assert not same_elements(t[::2], t[:8]) and not same_elements(t.view(torch.int32), t)
    assert not same_elements(t.view(4, 4), t)


@pytest.mark.parametrize("in_place", [True, False])
def test_sparse_residual_in_place_copies_nothing_and_keeps_the_bits(in_place: bool) -> None:
    g = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([0, 7, 100, 4095])
    want = g.clone().index_fill_(0, idx, 0)
    tensor = g.clone()
    out = tensor.view(-1)[0:4096] if in_place else torch.empty_like(g)
    with _Ops() as ops:
        got = sparse_residual(tensor, idx, out)
    assert torch.equal(got, want) and got.data_ptr() == out.data_ptr()
    assert ops.count["copy_"] == (0 if in_place else 1)


def test_a_flat_tensors_compression_makes_no_view_of_it() -> None:
    """Top-k's compress of a 1-D tensor (a part of the divisible scheme, a flattened bucket) adds
    no view op of its own; the payload is the same either way."""
    comp = compressors.get("topk", density=0.05)
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    payloads = []
    for skip in (True, False):
        Dispatch.skip_no_ops = skip
        try:
            with _Ops() as ops:
                payload, _ = comp.compress(t, "w")
        finally:
            Dispatch.skip_no_ops = True
        payloads.append(payload)
        if skip:
            assert ops.count["view"] == 0, dict(ops.count)
    assert all(torch.equal(a, b) for a, b in zip(*payloads))
