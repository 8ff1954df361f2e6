"""Run a function in N real processes joined by torch.distributed (gloo on localhost).

Each worker gets the env:// variables a launcher would set, so ``adacomp.init()`` / the torch backend
connect for real. Results come back per rank; a worker's exception fails the test with its
traceback; a hang fails after ``timeout`` seconds and every worker is killed.
"""
from __future__ import annotations

import faulthandler
import os
import queue
import signal
import subprocess
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, q: Any, args: tuple, env: dict) -> None:
    # a crash in native code (a signal) prints every thread's Python stack to stderr, which pytest
    # shows with the test: the rank that died is otherwise only known as its peers' "connection reset"
    faulthandler.enable(all_threads=True)
    # the caller's environment as it is now (a forkserver child starts from the server's)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    import torch
    torch.set_num_threads(1)
    try:
        # Serialise to bytes: a tensor sent through the queue is shared memory that dies with this
        # process, and the parent may unpickle it only after we exited.
        import io
        buf = io.BytesIO()
        torch.save(fn(*args), buf)
        q.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


_CONTEXT: Any = None
PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.distributed.fsdp"]
"""What the workers' server imports once: torch, and what a first optimizer (torch._dynamo) and
adacomp's DDP check (FSDP) import of it, ~4 s a worker on a 2-core machine."""


def _context() -> Any:
    """Workers fork from a server that imported torch once (a spawned worker spent ~3 s of its
    start importing it, hundreds of times a run). The server imports nothing of adacomp or the
    tests, and each worker takes the caller's current environment, so what a worker sees is what a
    spawned one saw, torch's import-time state aside."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def run_workers(fn: Callable, world: int, *args: Any, timeout: float = 180.0,
                env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` processes; return the per-rank results in rank order.

    The rendezvous port is free when chosen but may be taken by another process before rank 0
    binds it (parallel jobs on one machine): that start, and only that, is retried on a new port."""
    for attempt in range(3):
        try:
            return _run_workers_once(fn, world, args, timeout, env)
        except AssertionError as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_workers_once(fn: Callable, world: int, args: tuple, timeout: float,
                      env: dict[str, str] | None) -> list[Any]:
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    full_env = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q, args, full_env), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    killed: set[int] = set()
    try:
        for _ in range(world):
            try:
                rank, ok, value = q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"workers did not finish within {timeout}s; got ranks {sorted(results)}")
            if ok:
                import io

                import torch
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
        for r, p in enumerate(procs):
            if p.is_alive():
                killed.add(r)
                p.kill()
                p.join()
    if errors:
        errors += _signal_deaths(procs, killed)
        raise AssertionError("worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


def _signal_deaths(procs: list[Any], killed: set[int]) -> list[str]:
    """Name the ranks a signal ended (a crash in native code), not by us: their peers only see a reset."""
    out = []
    for r, p in enumerate(procs):
        code = p.exitcode
        if r not in killed and code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            out.append(f"rank {r}: died from signal {name} (its Python stack, from faulthandler, is in the "
                       "captured stderr)")
    return out


def run_launcher(cmd: list[str], cwd: str, env: dict[str, str], timeout: float,
                 merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """Run a launcher (mpirun / horovodrun / torchrun / adacomp run) in its own session; on timeout
    kill the whole process group so no orphaned rank keeps a core busy. ``timed_out`` on the
    result says whether that happened."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    err = err or ""
    if timed_out:
        err += f"\n[test] {cmd[0]} killed after {timeout}s"
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    result.timed_out = timed_out  # type: ignore[attr-defined]
    return result


def train_random_steps(model, opt, steps: int, inputs: int, classes: int, seed: int, batch: int = 16) -> None:
    """A few optimizer steps on random data from an owned generator (distinct per ``seed``)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(batch, inputs, generator=gen), torch.randint(0, classes, (batch,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def params_digest(model) -> str:
    """A short hash of every parameter's name and bits (equal digests: bitwise-equal models)."""
    import hashlib
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]
