"""Run under ``horovodrun --gloo -np 2``: every function of adacomp's Horovod API next to
``horovod.torch``'s on the same inputs, in one launch (tests/test_hvd_api.py).

Round 1 puts adacomp on the torch backend (its own gloo group, so nothing is shared with Horovod
but the process), then ``adacomp.shutdown()`` and round 2 re-initialises adacomp on the Horovod
backend. Each check compares values (tensors: dtype, shape and values) or, for misuse, that
adacomp raises an instance of the builtin exception class Horovod raises. Prints
``HVD_API_OK <checks>`` per rank when everything matched, else the mismatches, and exits 1.
"""
from __future__ import annotations

import copy
import os
import socket
import sys
from typing import Any, Callable

import torch

try:
    import horovod.torch as hvd
except ImportError:  # the selfcheck mode runs without Horovod
    hvd = None

import adacomp

FAILURES: list[str] = []
CHECKS = [0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            return torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-7)
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def _builtin_base(exc: BaseException) -> type:
    return next(c for c in type(exc).__mro__ if c.__module__ == "builtins")


def check(label: str, ours: Callable[[], Any], theirs: Callable[[], Any]) -> None:
    """Run both; they must agree on the value, or both raise (ours an instance of the builtin
    exception class theirs raised)."""
    CHECKS[0] += 1
    results = []
    for fn in (ours, theirs):
        try:
            results.append(("ok", fn()))
        except Exception as exc:  # noqa: BLE001 - compared below
            results.append(("err", exc))
    (ka, a), (kb, b) = results
    if ka != kb:
        FAILURES.append(f"{label}: adacomp {ka} {a!r} vs horovod {kb} {b!r}")
    elif ka == "err" and not isinstance(a, _builtin_base(b)):
        FAILURES.append(f"{label}: adacomp raised {type(a).__name__}({a}) vs horovod {type(b).__name__}({b})")
    elif ka == "ok" and not same(a, b):
        FAILURES.append(f"{label}: adacomp {a!r} vs horovod {b!r}")


def both(label: str, call: Callable[[Any], Any]) -> None:
    """The same call spelt against each module: ``call(module)``."""
    check(label, lambda: call(adacomp), lambda: call(hvd))


def inputs(rank: int) -> dict[str, Callable[[], torch.Tensor]]:
    g = lambda s: torch.Generator().manual_seed(100 * s + rank)  # noqa: E731
    return {
        "f": lambda: torch.randn(5, 3, generator=g(1)),
        "i": lambda: torch.tensor([3, -3, 5, 7]) * (rank + 1),
        "h": lambda: torch.randn(6, generator=g(2)).half(),
        "rows": lambda: torch.randn(rank + 1, 2, generator=g(3)),
        "four": lambda: torch.arange(8.).reshape(4, 2) + 10 * rank,
        "five": lambda: torch.arange(10.).reshape(5, 2) * (rank + 1),
    }


def collectives(rank: int) -> None:
    x = inputs(rank)
    both("size/rank", lambda m: (m.size(), m.rank(), m.local_rank(), m.local_size(), m.cross_rank(),
                                 m.cross_size(), m.is_initialized()))
    both("built", lambda m: (bool(m.gloo_built()), m.nccl_built(), m.gloo_enabled(), m.ddl_built(), m.ccl_built()))
    both("mpi_threads_supported", lambda m: m.mpi_threads_supported())
    # allreduce and its knobs
    both("allreduce average", lambda m: m.allreduce(x["f"]()))
    both("allreduce average=False", lambda m: m.allreduce(x["f"](), average=False))
    for op in ("Sum", "Min", "Max", "Product", "Average"):
        both(f"allreduce op={op}", lambda m: m.allreduce(x["f"](), op=getattr(m, op)))
        both(f"allreduce op={op} scaled", lambda m: m.allreduce(x["f"](), op=getattr(m, op), prescale_factor=2.0,
                                                                postscale_factor=0.25))
    def differentiable(m: Any) -> Any:
        w = x["f"]().requires_grad_()
        (m.allreduce(w * w, op=m.Sum) * (x["f"]() + 1)).sum().backward()  # a contiguous upstream gradient
        return w.grad
    both("allreduce backward", differentiable)
    both("allreduce int average", lambda m: m.allreduce(x["i"]()))
    both("allreduce int prescale", lambda m: m.allreduce(x["i"](), op=m.Sum, prescale_factor=0.5))
    both("allreduce int max", lambda m: m.allreduce(x["i"](), op=m.Max))
    both("allreduce fp16", lambda m: m.allreduce(x["h"](), op=m.Sum))
    both("allreduce Compression.fp16", lambda m: m.allreduce(x["f"](), compression=m.Compression.fp16))
    both("allreduce Compression.none", lambda m: m.allreduce(x["f"](), compression=m.Compression.none))

    def in_place(m: Any) -> Any:
        t = x["f"]()
        out = m.allreduce_(t, op=m.Sum)
        return out, t, out.data_ptr() == t.data_ptr()
    both("allreduce_", in_place)

    def async_(m: Any) -> Any:
        t = x["f"]()
        h = m.allreduce_async(t)
        while not m.poll(h):
            pass
        return m.synchronize(h), t, m.synchronize(h)
    both("allreduce_async + poll + synchronize twice", async_)

    def async_inplace(m: Any) -> Any:
        t = x["i"]()
        h = m.allreduce_async_(t, op=m.Sum)
        return m.synchronize(h), t
    both("allreduce_async_", async_inplace)
    both("grouped_allreduce", lambda m: m.grouped_allreduce([x["f"](), x["f"]() * 2, x["i"]()], op=m.Sum))

    def grouped_inplace(m: Any) -> Any:
        ts = [x["f"](), x["f"]() + 1]
        return m.grouped_allreduce_(ts), ts
    both("grouped_allreduce_", grouped_inplace)
    # allgather / broadcast / alltoall / reducescatter
    both("allgather differing rows", lambda m: m.allgather(x["rows"]()))
    both("allgather int", lambda m: m.allgather(x["i"]()))
    both("allgather_async", lambda m: m.synchronize(m.allgather_async(x["four"]())))
    both("broadcast root 1", lambda m: m.broadcast(x["f"](), 1))

    def bcast_inplace(m: Any) -> Any:
        t = x["five"]()
        return m.broadcast_(t, root_rank=1), t
    both("broadcast_", bcast_inplace)
    both("broadcast_async", lambda m: m.synchronize(m.broadcast_async(x["i"](), 0)))
    both("alltoall splits list", lambda m: m.alltoall(x["five"](), splits=[2, 3] if rank == 0 else [4, 1]))
    both("alltoall splits tensor", lambda m: m.alltoall(x["four"](), splits=torch.tensor([1, 3], dtype=torch.int32)))
    both("alltoall no splits", lambda m: m.alltoall(x["four"]()))
    both("alltoall_async", lambda m: m.synchronize(m.alltoall_async(x["four"](), splits=[3, 1])))
    both("reducescatter average odd rows", lambda m: m.reducescatter(x["five"]()))
    both("reducescatter sum scaled", lambda m: m.reducescatter(x["four"](), op=m.Sum, prescale_factor=2.0,
                                                               postscale_factor=0.25))
    both("reducescatter int", lambda m: m.reducescatter(x["i"]()))
    both("reducescatter_async", lambda m: m.synchronize(m.reducescatter_async(x["four"]())))
    # objects and synchronisation points
    both("allgather_object", lambda m: m.allgather_object({"rank": rank, "v": [rank] * 3}))
    both("broadcast_object name=", lambda m: m.broadcast_object({"rank": rank}, 1, name="cfg"))
    both("broadcast_object positional process set", lambda m: m.broadcast_object(rank + 1, 1, "obj",
                                                                                 m.global_process_set))
    both("start_timeline without HOROVOD_TIMELINE=DYNAMIC", lambda m: m.start_timeline("/tmp/adacomp_tl.json"))
    both("barrier", lambda m: m.barrier())
    both("join", lambda m: m.join() in range(m.size()))
    # misuse: the same exception class
    both("misuse non-contiguous", lambda m: m.allreduce(torch.arange(6.).reshape(2, 3).t()))
    both("misuse op and average", lambda m: m.allreduce(x["f"](), average=True, op=m.Sum))
    both("misuse broadcast root", lambda m: m.broadcast(x["f"](), 5))
    both("misuse bool allreduce", lambda m: m.allreduce(torch.tensor([True, False])))
    both("misuse alltoall uneven", lambda m: m.alltoall(torch.arange(3.)))
    both("misuse allgather 0-d", lambda m: m.allgather(torch.tensor(1.0)))
    both("misuse reducescatter op=Min", lambda m: m.reducescatter(x["four"](), op=m.Min))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def models_and_optimizers(rank: int) -> None:
    torch.manual_seed(rank)  # different weights on every rank until broadcast
    base = Net()
    spellings = {"state_dict": lambda m: m.state_dict(), "named list": lambda m: list(m.named_parameters()),
                 "plain list": lambda m: list(m.parameters())}
    for label, spell in spellings.items():
        def run(mod: Any) -> Any:
            net = copy.deepcopy(base)
            mod.broadcast_parameters(spell(net), root_rank=1)
            return net.state_dict()
        both(f"broadcast_parameters {label}", run)

    def fresh_adam(mod: Any) -> Any:
        net = copy.deepcopy(base)
        opt = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=0.1)
        if rank == 1:
            opt.param_groups[0]["lr"] = 0.5
        mod.broadcast_optimizer_state(opt, root_rank=1)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()  # a fresh Adam must work on every rank after the broadcast
        return opt.state_dict(), net.state_dict(), [p.grad for p in net.parameters()]
    both("broadcast_optimizer_state fresh Adam", fresh_adam)

    def distributed(mod: Any, seed: int = 3, **kw: Any) -> Any:
        torch.manual_seed(seed)
        net = Net()
        opt = mod.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=net.named_parameters(), **kw)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            net(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
            opt.step()
        if mod is adacomp:
            opt.remove_hooks()
        return {k: v.float() for k, v in net.state_dict().items()}

    check("DistributedOptimizer compression=fp16 (3 steps)",
          lambda: _round(distributed(adacomp, compression=adacomp.Compression.fp16)),
          lambda: _round(distributed(hvd, compression=hvd.Compression.fp16)))
    check("DistributedOptimizer groups=2 (3 steps)", lambda: distributed(adacomp, groups=2),
          lambda: distributed(hvd, groups=2))
    def positional(mod: Any) -> Any:  # Horovod's order: (optimizer, named_parameters, compression, ...)
        torch.manual_seed(3)
        net = Net()
        opt = mod.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(),
                                       mod.Compression.fp16, 1)
        net(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
        opt.step()
        if mod is adacomp:
            opt.remove_hooks()
        return {k: v.float() for k, v in net.state_dict().items()}
    check("DistributedOptimizer positional compression", lambda: _round(positional(adacomp)),
          lambda: _round(positional(hvd)))

    def kept_grads_unused(mod: Any) -> Any:  # gradients zeroed in place, one layer never used
        torch.manual_seed(3)
        net, unused = Net(), torch.nn.Linear(2, 2)
        params = list(net.named_parameters()) + [("unused." + n, p) for n, p in unused.named_parameters()]
        opt = mod.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            net.zero_grad(set_to_none=False)
            net(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
            opt.step()
        if mod is adacomp:
            opt.remove_hooks()
        return {k: v.float() for k, v in net.state_dict().items()}
    check("DistributedOptimizer gradients kept between steps, an unused layer", lambda: kept_grads_unused(adacomp),
          lambda: kept_grads_unused(hvd))

    def step_without_skip(mod: Any) -> Any:
        import warnings
        net = Net()
        opt = mod.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
        net(torch.randn(4, 4)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.step()
        if mod is adacomp:
            opt.remove_hooks()
        horovods = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown.")
        return [str(w.message).startswith(horovods) for w in seen if "skip_synchronize" in str(w.message)]
    both("step() after synchronize() without skip_synchronize warns in Horovod's words", step_without_skip)
    # weights that differ per rank on purpose (no broadcast): Horovod trains on; adacomp warns and trains on
    check("DistributedOptimizer different initial weights (3 steps)", lambda: distributed(adacomp, seed=rank),
          lambda: distributed(hvd, seed=rank))


def selfcheck() -> int:
    """Without Horovod (torch backend via run_workers, MPI via mpirun): every result against one
    computed here from all ranks' inputs; then ``shutdown()`` and ``init()`` again. Returns checks."""
    n = 0
    for round_ in range(2):
        adacomp.init()
        rank, world = adacomp.rank(), adacomp.size()
        x = inputs(rank)
        every = [inputs(r) for r in range(world)]
        stack = lambda key: torch.stack([e[key]() for e in every])  # noqa: E731
        expect = {
            "avg": stack("f").sum(0) / world, "sum": stack("f").sum(0), "min": stack("f").amin(0),
            "max": stack("f").amax(0), "prod": stack("f").prod(0),
            "int_avg": (stack("i").sum(0).double() / world).trunc().long(),
            "scaled": stack("f").mul(2.0).sum(0) * 0.25 / world,
        }
        got = {
            "avg": adacomp.allreduce(x["f"]()), "sum": adacomp.allreduce(x["f"](), op=adacomp.Sum),
            "min": adacomp.allreduce(x["f"](), op=adacomp.Min), "max": adacomp.allreduce(x["f"](), op=adacomp.Max),
            "prod": adacomp.allreduce(x["f"](), op=adacomp.Product), "int_avg": adacomp.allreduce(x["i"]()),
            "scaled": adacomp.allreduce(x["f"](), prescale_factor=2.0, postscale_factor=0.25),
        }
        for key, want in expect.items():
            assert same(got[key], want), (key, got[key], want)
        t = x["f"]()
        h = adacomp.allreduce_async_(t, op=adacomp.Sum)
        while not adacomp.poll(h):
            pass
        assert adacomp.synchronize(h) is t and same(t, expect["sum"]) and adacomp.synchronize(h) is None
        assert same(adacomp.grouped_allreduce([x["f"](), x["i"]()]), [expect["avg"], expect["int_avg"]])
        assert same(adacomp.allgather(x["rows"]()), torch.cat([e["rows"]() for e in every]))
        assert same(adacomp.broadcast(x["five"](), world - 1), every[-1]["five"]())
        out, recv = adacomp.alltoall(x["four"](), splits=[4 - world + 1] + [1] * (world - 1))
        assert recv.dtype == torch.int32 and out.shape[0] == int(recv.sum())
        share = [5 // world + (1 if r < 5 % world else 0) for r in range(world)]  # first ranks: one row more
        lo = sum(share[:rank])
        assert same(adacomp.reducescatter(x["five"]()), (stack("five").sum(0) / world)[lo:lo + share[rank]])
        assert adacomp.allgather_object(rank) == list(range(world))
        assert adacomp.broadcast_object({"r": rank}, world - 1, name="obj") == {"r": world - 1}
        assert adacomp.local_size() == world and adacomp.cross_size() == 1 and adacomp.cross_rank() == 0
        assert adacomp.join() in range(world)
        adacomp.barrier()
        models_fresh_state(rank)
        n += 16
        adacomp.shutdown()
        assert not adacomp.is_initialized(), round_
    return n


def models_fresh_state(rank: int) -> None:
    """The three ``broadcast_parameters`` spellings, and a fresh Adam initialised on every rank."""
    torch.manual_seed(rank)
    base = Net()
    for spell in (lambda m: m.state_dict(), lambda m: list(m.named_parameters()), lambda m: list(m.parameters())):
        net = copy.deepcopy(base)
        adacomp.broadcast_parameters(spell(net), root_rank=0)
        everyone = adacomp.allgather_object({k: v for k, v in net.named_parameters()})
        assert all(same(e, everyone[0]) for e in everyone)
    opt = torch.optim.Adam(copy.deepcopy(base).parameters(), lr=0.1)
    adacomp.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()["state"]
    assert len(state) == len(opt.param_groups[0]["params"]) and all("exp_avg" in s for s in state.values())
    assert all(p.grad is not None and not p.grad.any() for p in opt.param_groups[0]["params"])


def sync_batch_norm(backend: str) -> None:
    """torch's SyncBatchNorm on the torch backend; on Horovod's, an error naming Horovod's own."""
    CHECKS[0] += 1
    if backend == "torch":
        bn = adacomp.SyncBatchNorm(4).eval()
        if not (isinstance(bn, torch.nn.SyncBatchNorm) and bn(torch.randn(3, 4)).shape == (3, 4)):
            FAILURES.append("SyncBatchNorm on the torch backend")
        return
    try:
        adacomp.SyncBatchNorm(4)
        FAILURES.append("SyncBatchNorm on the horovod backend did not refuse")
    except RuntimeError as exc:
        if "horovod.torch.SyncBatchNorm" not in str(exc):
            FAILURES.append(f"SyncBatchNorm error does not name the alternative: {exc}")


def _round(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp16 transport: Horovod averages in half precision, adacomp in the gradient's own dtype after
    the half-precision sum, so agreement is to half precision."""
    return {k: (v * 256).round() / 256 for k, v in state.items()}


def main() -> int:
    if sys.argv[1:] == ["selfcheck"]:
        print(f"HVD_SELFCHECK_OK {selfcheck()}", flush=True)
        return 0
    rank = horovod_world()
    for backend in ("torch", "horovod"):
        adacomp.init(backend)
        assert adacomp.backend().name == backend, adacomp.backend()
        collectives(rank)
        models_and_optimizers(rank)
        sync_batch_norm(backend)
        adacomp.shutdown()
        assert not adacomp.is_initialized()
    return report("HVD_API_OK", rank)


def horovod_world() -> int:
    """Under horovodrun: start Horovod and give adacomp's torch backend the env:// rendezvous of
    a fresh port (agreed through Horovod), so both can run side by side. Returns the rank."""
    hvd.init()
    rank = hvd.rank()
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, 0, name="port")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(hvd.size()), LOCAL_RANK=str(hvd.local_rank()))
    return rank


def report(marker: str, rank: int) -> int:
    """Print ``marker`` and the number of checks when all matched (exit 0), else the mismatches (1)."""
    if FAILURES:
        print(f"rank {rank}: {len(FAILURES)} of {CHECKS[0]} checks differ:\n  " + "\n  ".join(FAILURES), flush=True)
        return 1
    print(f"{marker} {CHECKS[0]} checks on rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
