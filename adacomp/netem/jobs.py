"""Run one benchmark's workers on emulated hosts: the drive / trampoline pair that every netem
experiment (``adacomp bench netem_experiment``, ``adacomp bench time_to_accuracy``) needs.

The driver (root) brings the hosts up, starts ``hosts`` local workers through the launcher, each
of which first runs the benchmark with ``--in-host``: that trampoline re-executes the real worker
inside its own network namespace, so gloo's traffic crosses the capped link. The hosts are torn
down however the run ends.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, Sequence

from adacomp.netem import hosts as netem


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the benchmark's own arguments, the command after ``--``: what the trampoline runs in its host)."""
    if "--" not in argv:
        return argv, []
    return argv[:argv.index("--")], argv[argv.index("--") + 1:]


def add_role_arguments(ap: argparse.ArgumentParser) -> None:
    """The hidden options :func:`run_on_hosts` starts the benchmark with (``--hosts`` and ``--prefix``
    are the benchmark's own)."""
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-host", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master-addr", help=argparse.SUPPRESS)
    ap.add_argument("--ranks-per-host", type=int, default=1, help=argparse.SUPPRESS)


def run_role(args: argparse.Namespace, rest: list[str], worker: Callable[[], object], drive: Callable[[], int]) -> int:
    """This process's part: the trampoline into its host (``--in-host``), a worker (``--worker``),
    or the driver that brings the hosts up and starts the workers."""
    if args.in_host:
        return exec_in_host(args.hosts, args.master_addr, args.prefix, rest, args.ranks_per_host)
    if args.worker:
        worker()
        return 0
    return drive()


def exec_in_host(hosts: int, master_addr: str, prefix: str, command: list[str], ranks_per_host: int = 1) -> int:
    """Trampoline for rank ``RANK``: replace this process with ``command`` inside host
    ``RANK mod hosts`` (one rank per host), or ``RANK // ranks_per_host`` (consecutive ranks share a
    host: they talk over its loopback, uncapped), pointed at rank 0's emulated address."""
    rank = int(os.environ["RANK"])
    env = dict(os.environ, MASTER_ADDR=master_addr, **netem.worker_env(prefix))
    host = rank // ranks_per_host if ranks_per_host > 1 else rank % hosts
    os.execvpe("ip", netem.wrap_command(host, command, prefix), env)
    return 1  # not reached


def run_on_hosts(command: Sequence[str], hosts: int, bandwidth: str, prefix: str, worker_argv: list[str],
                 prepare: Callable[[], object] | None = None, ranks_per_host: int = 1) -> int:
    """Start ``command --worker worker_argv`` on ``hosts`` emulated hosts at ``bandwidth``,
    ``ranks_per_host`` ranks on each
    (``command``: how to start the benchmark, e.g. ``python -m adacomp.bench.NAME``).

    Without root nothing is measured: the reason is printed and 0 returned (``make results`` goes
    on). ``prepare`` runs after the root check and before any host exists (e.g. fail early on
    missing data rather than in four workers)."""
    from adacomp.tools.launch import run_local
    name = command[-1].rsplit(".", 1)[-1]
    try:
        netem.require_root()
    except netem.NetemError as exc:
        print(f"{name}: skipped, nothing measured: {exc}")
        return 0
    if prepare is not None:
        prepare()
    netem.down(prefix)  # leftovers of a crashed run with this script's own prefix
    try:
        print(f"netem up: {hosts} hosts (prefix {prefix}) at {bandwidth}", flush=True)
        netem.up(hosts, bandwidth, prefix)
        cmd = [*command, "--in-host", "--hosts", str(hosts), "--prefix", prefix, "--ranks-per-host",
               str(ranks_per_host), "--master-addr", netem.host_address(0, prefix), "--", *command, "--worker",
               *worker_argv]
        return run_local(cmd, hosts * ranks_per_host)
    finally:
        removed = netem.down(prefix)
        print(f"netem down: removed {len(removed)} objects", flush=True)
