"""Backend.alltoall_async: real gloo processes (world 2 and 3) plus single-process argument checks
and the shaping wrapper's cost. MPI and Horovod run the same ``check_alltoall`` from
tests/backend_worker.py under mpirun / horovodrun (tests/test_backend_mpi.py, test_backend_horovod.py).
"""
from __future__ import annotations

import pytest
import torch

from adacomp.backends.base import Backend, LocalBackend
from adacomp.backends.forwarding import ForwardingBackend
from adacomp.backends.shaped import ShapedBackend
from adacomp.policies.timeline import alltoall as timeline_alltoall
from tests._dist import run_workers
from tests.backend_worker import a2a_block, a2a_plan, check_alltoall


def _gloo_alltoall() -> dict:
    from adacomp.backends.torch_dist import TorchBackend
    b = TorchBackend(timeout_s=60)
    r, n = b.rank(), b.size()
    check_alltoall(b, r, n)
    # More seeded plans, each rank deriving what every other rank sends; through the shaping
    # wrapper too (results must be unchanged, only time is added).
    shaped = ShapedBackend(b, alpha=1e-4, cost="table1")
    for seed in range(20, 26):
        plan = a2a_plan(n, seed, silent=seed % n if seed % 2 else None)
        send = torch.cat([a2a_block(r, j, plan[r][j], (2,), torch.float32) for j in range(n)])
        want = torch.cat([a2a_block(i, r, plan[i][r], (2,), torch.float32) for i in range(n)])
        for backend in (b, shaped):
            got = backend.alltoall_async(send, plan[r], None if seed % 3 else [plan[i][r] for i in range(n)]).wait()
            if not torch.equal(got, want):
                raise AssertionError(f"seed {seed} on {type(backend).__name__}: expected {want.tolist()}, "
                                     f"got {got.tolist()}")
    return {"rank": r, "shaped_collectives": shaped.collectives}


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_alltoall(world: int) -> None:
    """Seeded random splits, recv_splits given and exchanged, empty blocks, a silent rank, 0-row
    tensors, 1-D / n-D rows, nine dtypes, in flight beside allreduce and allgather."""
    results = run_workers(_gloo_alltoall, world, timeout=180)
    assert [res["rank"] for res in results] == list(range(world))
    assert all(res["shaped_collectives"] == 6 for res in results)


# ------------------------------------------------------------------ single process
def test_local_backend_is_identity_and_counts_round_trip() -> None:
    b = LocalBackend()
    x = torch.arange(12.0).reshape(4, 3)
    assert b.alltoall(x, [4]) is x
    assert b.alltoall(x, [4], recv_splits=[4]) is x
    assert b.alltoall(torch.empty(0, 3), [0]).shape == (0, 3)
    assert b.alltoall_splits([7]) == [7]
    assert ForwardingBackend(b).alltoall(x, [4]) is x


@pytest.mark.parametrize("tensor, splits, recv, match", [
    (torch.zeros(4, 2), [2, 2], None, "one row count per rank \\(1 entries\\), got 2"),
    (torch.zeros(4, 2), [3], None, "summing to tensor.shape\\[0\\]=4, got \\[3\\]"),
    (torch.zeros(4, 2), [-1], None, "row counts >= 0"),
    (torch.zeros(4, 2), ["a"], None, "list of 1 row counts"),
    (torch.tensor(1.0), [1], None, "0-d tensor"),
    (torch.zeros(4, 2), [4], [3], "receives what it sends, expected \\[4\\]"),
    (torch.zeros(4, 2), [4], [4, 0], "recv_splits: expected one row count per rank"),
])
def test_bad_arguments_say_expected_and_got(tensor, splits, recv, match) -> None:
    with pytest.raises(ValueError, match=match):
        LocalBackend().alltoall_async(tensor, splits, recv)


def test_alltoall_is_part_of_the_interface() -> None:
    """Abstract, not a silent default: a transport without alltoall cannot be instantiated."""
    assert "alltoall_async" in Backend.__abstractmethods__
    for cls in (LocalBackend, ForwardingBackend, ShapedBackend):
        assert not cls.__abstractmethods__, cls


class _World(LocalBackend):
    """Reports a world of ``n`` so cost formulas can be checked; runs no collective."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


@pytest.mark.parametrize("n", [2, 3, 8])
def test_shaped_alltoall_cost(n: int) -> None:
    """table1: pairwise exchange (N-1) alpha + (N-1)/N M beta, the model ByteComp's timeline uses;
    flat: alpha + M beta like every other collective."""
    table1 = ShapedBackend(_World(n), alpha=1e-3, beta=1e-6, cost="table1")
    assert table1.delay("alltoall", 4096) == pytest.approx((n - 1) * 1e-3 + (n - 1) / n * 4096 * 1e-6)
    assert table1.delay("alltoall", 4096) == pytest.approx(timeline_alltoall(4096, n, 1e-3, 1e-6))
    flat = ShapedBackend(_World(n), alpha=1e-3, beta=1e-6)
    assert flat.delay("alltoall", 4096) == pytest.approx(1e-3 + 4096 * 1e-6)


def test_shaped_charges_alltoall_on_a_fake_clock() -> None:
    from tests.test_shaped import _fake
    b, clock = _fake(alpha=0.01, beta=1e-6)
    x = torch.zeros(250)  # 1000 bytes -> 0.011 s
    h = b.alltoall_async(x, [250])
    assert h.wait() is x
    assert clock.now == pytest.approx(0.011)
    assert b.alltoall_splits([250]) == [250]  # the count exchange is a (small) alltoall too
    assert b.collectives == 2
    assert b.added_s == pytest.approx(0.011 + 0.01 + 8 * 1e-6)
