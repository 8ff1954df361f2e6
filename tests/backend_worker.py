"""Worker launched by tests/test_backend_mpi.py (mpirun) and tests/test_backend_horovod.py (horovodrun).

* ``backend_worker.py mpi|horovod`` checks every Backend method against values each rank can compute
  on its own; success prints ``BACKEND_OK rank=<r>`` once per rank.
* ``backend_worker.py reference mpi|horovod PORT MB[,MB..]``: adacomp vs DDP, prints ``REFERENCE_DIFF``.
* ``backend_worker.py timeout mpi|horovod``: a skipped collective must raise, printing ``TIMEOUT_OK``.
* ``backend_worker.py divisible mpi|horovod``: a few steps of topk on the divisible scheme
  (communicator ``alltoall``) with one offloaded layer; prints ``DIVISIBLE_DIGEST <hex>`` of the
  parameters (tests compare it with the same run on gloo).
* ``backend_worker.py local mpi|horovod``: Streaming DiLoCo (2 fragments, overlap, Top-k +
  residual, Nesterov outer steps) for 9 steps and a final ``outer_sync()``; prints
  ``LOCAL_DIGEST <hex>``.

Any mismatch raises (non-zero exit), so the launcher's exit status carries the verdict.
"""
from __future__ import annotations

import sys

import torch

from adacomp.backends import create


# Launcher variables of other launchers that would steer ``backend: auto`` away from the one tested.
FOREIGN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ADACOMP_BACKEND",
               "HOROVOD_RANK")


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 0.0) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.allclose(
            got.double(), want.double(), rtol=0, atol=atol):
        raise AssertionError(f"{what}: expected {want.dtype}{tuple(want.shape)} {want.flatten()[:8].tolist()}, "
                             f"got {got.dtype}{tuple(got.shape)} {got.flatten()[:8].tolist()}")


def check_allreduce(b, r: int, n: int) -> None:
    ranks_sum = n * (n - 1) / 2
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + r
    want = torch.arange(6, dtype=torch.float32).reshape(2, 3) * n + ranks_sum
    out = b.allreduce_async(t).wait()
    _close(out, want, "allreduce sum")
    _close(t, want, "allreduce result written in place")
    _close(b.allreduce(torch.full((5,), float(r + 1)), average=True),
           torch.full((5,), (n + 1) / 2), "allreduce average")
    _close(b.allreduce(torch.tensor([r, 10], dtype=torch.int64)),
           torch.tensor([int(ranks_sum), 10 * n], dtype=torch.int64), "allreduce int64")
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        x = torch.full((7,), 0.5 + r, dtype=dt)
        _close(b.allreduce(x, average=True), torch.full((7,), 0.5 + ranks_sum / n, dtype=dt), f"allreduce {dt}")
    # A tensor that requires grad (a parameter) is reduced through .detach(): same storage.
    p = torch.ones(3, requires_grad=True)
    b.allreduce(p.data)
    _close(p.detach(), torch.full((3,), float(n)), "allreduce of parameter data")


def check_outstanding(b, r: int, n: int) -> None:
    """Several collectives in flight at once, waited in creation order (the optimizer's pattern)."""
    ts = [torch.full((1000 * (i + 1),), float(r + i)) for i in range(4)]
    hs = [b.allreduce_async(t) for t in ts[:2]]
    hs.append(b.allgather_async(torch.full((r + 1,), float(r))))
    hs += [b.allreduce_async(t, average=True) for t in ts[2:]]
    _close(hs[0].wait(), torch.full((1000,), float(n * (n - 1) / 2)), "outstanding allreduce 0")
    _close(hs[1].wait(), torch.full((2000,), float(n * (n - 1) / 2 + n)), "outstanding allreduce 1")
    _close(hs[2].wait(), torch.cat([torch.full((k + 1,), float(k)) for k in range(n)]), "outstanding allgather")
    _close(hs[3].wait(), torch.full((3000,), (n - 1) / 2 + 2), "outstanding allreduce avg 2")
    _close(hs[4].wait(), torch.full((4000,), (n - 1) / 2 + 3), "outstanding allreduce avg 3")


def _rows(k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank k's contribution: k+1 rows of 3 columns, values that identify rank and row."""
    return (torch.arange((k + 1) * 3, dtype=torch.float32).reshape(k + 1, 3) + 100 * k).to(dtype)


def check_allgather(b, r: int, n: int) -> None:
    want = torch.cat([_rows(k) for k in range(n)])
    _close(b.allgather(_rows(r)), want, "allgather varying rows, sizes exchanged")
    _close(b.allgather(_rows(r), sizes=[k + 1 for k in range(n)]), want, "allgather varying rows, sizes given")
    _close(b.allgather(torch.full((2, 2), float(r))),
           torch.cat([torch.full((2, 2), float(k)) for k in range(n)]), "allgather equal rows")
    idx = torch.arange(r + 2, dtype=torch.int64) * (r + 1)
    _close(b.allgather(idx), torch.cat([torch.arange(k + 2, dtype=torch.int64) * (k + 1) for k in range(n)]),
           "allgather int64 1-D")
    # Rank 0 contributes nothing (a sparsifier that selected no element).
    empty_ok = torch.full((0 if r == 0 else r, 4), float(r))
    _close(b.allgather(empty_ok), torch.cat([torch.full((0 if k == 0 else k, 4), float(k)) for k in range(n)]),
           "allgather with an empty rank")
    for dt in (torch.float16, torch.bfloat16):
        _close(b.allgather(_rows(r, dt) / 7), torch.cat([_rows(k, dt) / 7 for k in range(n)]),
               f"allgather {dt} bit-exact")
    if b.allgather_sizes(r * 5 + 1) != [k * 5 + 1 for k in range(n)]:
        raise AssertionError("allgather_sizes")


def check_allgather_into(b, r: int, n: int) -> None:
    """``allgather_async(..., out=buf)``: the same result whether or not the backend gathers into the
    caller's buffer; gloo (equal rows) and MPI (any rows) do, so a communicator's reused receive
    buffer is really reused; a buffer too small or of another dtype is left alone."""
    into = b.name in ("torch", "mpi")
    equal = torch.full((2, 2), float(r) + 0.5)
    want = torch.cat([torch.full((2, 2), float(k) + 0.5) for k in range(n)])
    buf = torch.full((4 * n + 3,), float("nan"))
    got = b.allgather_async(equal, sizes=[2] * n, out=buf).wait()
    _close(got, want, "allgather into a buffer, equal rows")
    if into and got.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        raise AssertionError(f"{b.name}: equal rows were not gathered into the caller's buffer")
    vary = torch.cat([_rows(k) for k in range(n)])
    buf = torch.full((vary.numel() + 1,), float("nan"))
    got = b.allgather_async(_rows(r), sizes=[k + 1 for k in range(n)], out=buf).wait()
    _close(got, vary, "allgather into a buffer, varying rows")
    if b.name == "mpi" and got.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        raise AssertionError("mpi: varying rows were not gathered into the caller's buffer")
    for bad in (torch.empty(3), torch.empty(4 * n, dtype=torch.float64)):  # too small, another dtype
        got = b.allgather_async(equal, sizes=[2] * n, out=bad).wait()
        _close(got, want, f"allgather refusing a buffer of {bad.numel()} {bad.dtype}")
        if got.untyped_storage().data_ptr() == bad.untyped_storage().data_ptr():
            raise AssertionError(f"{b.name}: gathered into a buffer that cannot hold the result")


def check_broadcast(b, r: int, n: int) -> None:
    for root in range(n):
        t = torch.full((3, 4), float(r * 10 + 1))
        out = b.broadcast_async(t, root=root).wait()
        _close(out, torch.full((3, 4), float(root * 10 + 1)), f"broadcast root {root}")
        _close(t, torch.full((3, 4), float(root * 10 + 1)), f"broadcast root {root} in place")
    h = torch.tensor([1.0 / 3 + r], dtype=torch.bfloat16)
    _close(b.broadcast(h, root=n - 1), torch.tensor([1.0 / 3 + n - 1], dtype=torch.bfloat16), "broadcast bf16")


A2A_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.uint8,
              torch.float16, torch.bfloat16, torch.bool)


def a2a_plan(n: int, seed: int, silent: int | None = None) -> list[list[int]]:
    """plan[i][j] = rows rank i sends rank j, the same on every rank (owned, seeded generator);
    about a third of the blocks are empty, and rank ``silent`` sends nothing at all."""
    gen = torch.Generator().manual_seed(seed)
    plan = (torch.randint(0, 4, (n, n), generator=gen) * (torch.rand(n, n, generator=gen) > 0.33)).tolist()
    if silent is not None:
        plan[silent] = [0] * n
    return plan


def a2a_block(i: int, j: int, rows: int, cols: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The rows rank i sends rank j: values that name sender, receiver and row, cast to ``dtype``."""
    width = 1
    for c in cols:
        width *= c
    v = torch.arange(rows * width, dtype=torch.float64).reshape((rows, *cols)) + 37 * i + 11 * j
    if dtype == torch.bool:
        return v.remainder(2) == 1
    if dtype == torch.uint8:
        return v.remainder(251).to(dtype)
    return (v / 8).to(dtype) if dtype.is_floating_point else v.to(dtype)


def check_alltoall(b, r: int, n: int) -> None:
    """alltoall_async: seeded per-pair splits, with and without recv_splits, empty blocks, a rank
    sending nothing, a 0-row tensor, 1-D and n-D rows, every dtype, overlapping other collectives."""
    def exchange(plan: list[list[int]], cols: tuple[int, ...], dtype: torch.dtype, given: bool, what: str) -> None:
        send = torch.cat([a2a_block(r, j, plan[r][j], cols, dtype) for j in range(n)])
        want = torch.cat([a2a_block(i, r, plan[i][r], cols, dtype) for i in range(n)])
        recv = [plan[i][r] for i in range(n)] if given else None
        _close(b.alltoall(send, plan[r], recv_splits=recv), want, f"alltoall {what} {dtype} recv_splits={recv}")

    for k, dtype in enumerate(A2A_DTYPES):
        plan = a2a_plan(n, seed=100 + k, silent=k % n if k % 3 == 0 else None)
        exchange(plan, (3,) if k % 2 else (2, 3), dtype, given=bool(k % 2), what=f"plan {plan}")
    for given in (True, False):
        exchange(a2a_plan(n, seed=7), (), torch.float32, given, "1-D")
        exchange([[0] * n for _ in range(n)], (4,), torch.float32, given, "0-row tensors")
    plan = a2a_plan(n, seed=8)
    if b.alltoall_splits(plan[r]) != [plan[i][r] for i in range(n)]:
        raise AssertionError(f"alltoall_splits: expected {[plan[i][r] for i in range(n)]}")
    # In flight together with allreduce / allgather, waited in creation order; the second
    # alltoall exchanges its counts while the others are outstanding.
    p1, p2 = a2a_plan(n, seed=9), a2a_plan(n, seed=10)
    s1 = torch.cat([a2a_block(r, j, p1[r][j], (5,), torch.float32) for j in range(n)])
    s2 = torch.cat([a2a_block(r, j, p2[r][j], (), torch.int64) for j in range(n)])
    hs = [b.allreduce_async(torch.full((3000,), float(r))),
          b.alltoall_async(s1, p1[r], [p1[i][r] for i in range(n)]),
          b.allgather_async(torch.full((r + 1,), float(r))),
          b.alltoall_async(s2, p2[r])]
    _close(hs[0].wait(), torch.full((3000,), n * (n - 1) / 2), "allreduce beside alltoall")
    _close(hs[1].wait(), torch.cat([a2a_block(i, r, p1[i][r], (5,), torch.float32) for i in range(n)]),
           "alltoall beside allreduce")
    _close(hs[2].wait(), torch.cat([torch.full((k + 1,), float(k)) for k in range(n)]), "allgather beside alltoall")
    _close(hs[3].wait(), torch.cat([a2a_block(i, r, p2[i][r], (), torch.int64) for i in range(n)]),
           "alltoall with count exchange beside others")
    # Bad arguments fail on every rank before any collective, so no rank is left waiting.
    for splits, match in (([1] * (n + 1), "one row count per rank"), ([5] + [0] * (n - 1), "summing to")):
        try:
            b.alltoall(torch.zeros(4, 2), splits)
        except ValueError as exc:
            if match not in str(exc):
                raise AssertionError(f"alltoall ValueError should say {match!r}, got {exc}") from exc
        else:
            raise AssertionError(f"alltoall with splits={splits} for 4 rows did not raise ValueError")


def check_objects(b, r: int, n: int) -> None:
    obj = {"rank": r, "cfg": {"lr": 0.1 * (r + 1)}, "blob": b"x" * (r * 1000)}
    got = b.broadcast_object(obj if r == 1 else None, root=1)
    if got != {"rank": 1, "cfg": {"lr": 0.2}, "blob": b"x" * 1000}:
        raise AssertionError(f"broadcast_object: got {got!r:.80}")
    everyone = b.allgather_object(obj)
    if [o["rank"] for o in everyone] != list(range(n)) or [len(o["blob"]) for o in everyone] != [k * 1000 for k in range(n)]:
        raise AssertionError(f"allgather_object: got ranks {[o['rank'] for o in everyone]}")
    b.barrier()


def check_timeout(backend: str) -> int:
    """Rank 1 skips a collective; rank 0 must raise CommunicationError instead of hanging. The
    ranks then meet on a side channel the backend does not number (MPI p2p / a named Horovod op)."""
    from adacomp.backends import create
    from adacomp.errors import CommunicationError
    b = create(backend, timeout_s=1.0)
    if b.rank() == 0:
        try:
            b.allreduce(torch.ones(4))
        except CommunicationError as exc:
            print(f"TIMEOUT_OK {exc}", flush=True)
    if backend == "mpi":
        from mpi4py import MPI
        if b.rank() == 0:
            MPI.COMM_WORLD.send("done", dest=1)
        else:
            MPI.COMM_WORLD.recv(source=0)
    else:
        import horovod.torch as hvd
        hvd.broadcast_object("done", root_rank=0, name="test.timeout.done")
    return 0


def reference(backend: str, port: int, bucket_mbs: list[float]) -> int:
    """Issue 2's reference test in one launch: adacomp (on ``backend``, once per fusion bucket size)
    and PyTorch DDP (on a gloo group joined over tcp:// with the launcher's rank) train the same CNN
    on the same shards for 20 steps; final parameters must agree within 1e-6."""
    import torch.distributed as dist

    import adacomp
    from tests.reference import max_diff, train_adacomp, train_ddp
    b = adacomp.init(backend)
    if b.name != backend:
        raise AssertionError(f"adacomp.init({backend!r}) started {b.name!r}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=b.rank(), world_size=b.size())
    ddp = train_ddp(steps=20)
    dist.destroy_process_group()
    for bucket_mb in bucket_mbs:
        cfg = {"compressor": {"name": "none"}, "communicator": {"name": "allreduce"},
               "fusion": {"bucket_mb": bucket_mb}}
        diff = max_diff(train_adacomp(cfg, steps=20), ddp)
        print(f"REFERENCE_DIFF rank={b.rank()} backend={backend} bucket_mb={bucket_mb} max_abs_diff={diff:.3e}",
              flush=True)
        if not diff < 1e-6:
            raise AssertionError(f"adacomp on {backend} (bucket_mb={bucket_mb}) differs from DDP by "
                                 f"{diff:.3e}; expected < 1e-6")
    adacomp.shutdown()
    return 0


def divisible_digest() -> str:
    """Parameters after 4 steps of topk on ``alltoall`` (+ one layer on ``allgather``, offloaded)
    from one seed: identical bits on every backend, because every rank averages in rank order."""
    import adacomp
    from tests._dist import params_digest, train_random_steps
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40),
                                torch.nn.ReLU(), torch.nn.Linear(40, 10))
    cfg = {"compressor": {"name": "topk", "density": 0.1}, "memory": {"name": "residual"},
           "communicator": {"name": "alltoall"}, "fusion": {"bucket_mb": 0.004}, "min_numel": 100,
           "layers": [{"match": "2.weight", "communicator": {"name": "allgather"}, "offload": True},
                      {"match": "4.weight", "offload": True}]}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), config=cfg)
    train_random_steps(model, opt, 4, 24, 10, 100 + adacomp.rank(), batch=8)
    opt.remove_hooks()
    return params_digest(model)


def local_steps_digest() -> str:
    """Parameters after 9 local steps with staggered, overlapped fragment syncs and a closing
    ``outer_sync()``: identical bits on every rank and backend (averages are taken in rank order)."""
    import adacomp
    from tests._dist import params_digest, train_random_steps
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 10))
    cfg = {"compressor": {"name": "topk", "density": 0.1}, "memory": {"name": "residual"},
           "communicator": {"name": "allgather"}, "min_numel": 0,
           "local_steps": {"every": 4, "fragments": 2, "overlap_steps": 1}}
    opt = adacomp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), config=cfg)
    train_random_steps(model, opt, 9, 24, 10, 100 + adacomp.rank(), batch=8)
    opt.outer_sync()
    return params_digest(model)


DIGESTS = {"divisible": divisible_digest, "local": local_steps_digest}


def digest_run(which: str, backend: str) -> int:
    import adacomp
    adacomp.init(backend=backend)
    digest = DIGESTS[which]()
    everyone = adacomp.runtime.context.current().allgather_object(digest)
    if len(set(everyone)) != 1:
        raise AssertionError(f"ranks ended with different parameters: {everyone}")
    print(f"{which.upper()}_DIGEST rank={adacomp.rank()} {digest}", flush=True)
    adacomp.shutdown()
    return 0


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    if argv[0] in DIGESTS:
        return digest_run(argv[0], argv[1])
    if argv[0] == "timeout":
        return check_timeout(argv[1])
    if argv[0] == "reference":
        return reference(argv[1], int(argv[2]), [float(x) for x in argv[3].split(",")])
    b = create("auto")  # the launcher's environment must select the backend under test
    r, n = b.rank(), b.size()
    if n < 2:
        raise AssertionError(f"expected a multi-process launch, got size {n}")
    if b.name != argv[0] or not 0 <= b.local_rank() < n:
        raise AssertionError(f"backend 'auto' started {b.name!r} (expected {argv[0]!r}), local_rank {b.local_rank()}")
    for check in (check_allreduce, check_outstanding, check_allgather, check_allgather_into, check_alltoall,
                  check_broadcast, check_objects):
        check(b, r, n)
    b.barrier()
    b.shutdown()
    print(f"BACKEND_OK rank={r} size={n} local_rank={b.local_rank()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
