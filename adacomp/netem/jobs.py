"""Run one script's workers on emulated hosts: the drive / trampoline pair that every netem
experiment (``scripts/netem_experiment.py``, ``scripts/time_to_accuracy.py``) needs.

The driver (root) brings the hosts up, starts ``hosts`` local workers through the launcher, each
of which first runs the script with ``--in-host``: that trampoline re-executes the real worker
inside its own network namespace, so gloo's traffic crosses the capped link. The hosts are torn
down however the run ends.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

from adacomp.netem import hosts as netem


def exec_in_host(hosts: int, master_addr: str, prefix: str, command: list[str]) -> int:
    """Trampoline for rank ``RANK``: replace this process with ``command`` inside host
    ``RANK mod hosts``, pointed at rank 0's emulated address."""
    rank = int(os.environ["RANK"])
    env = dict(os.environ, MASTER_ADDR=master_addr, **netem.worker_env(prefix))
    os.execvpe("ip", netem.wrap_command(rank % hosts, command, prefix), env)
    return 1  # not reached


def run_on_hosts(script: str, hosts: int, bandwidth: str, prefix: str, worker_argv: list[str],
                 prepare: Callable[[], object] | None = None) -> int:
    """Start ``script --worker worker_argv`` on ``hosts`` emulated hosts at ``bandwidth``.

    Without root nothing is measured: the reason is printed and 0 returned (``make results`` goes
    on). ``prepare`` runs after the root check and before any host exists (e.g. fail early on
    missing data rather than in four workers)."""
    from adacomp.runtime.launch import run_local
    name = os.path.splitext(os.path.basename(script))[0]
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
        me = os.path.relpath(script)
        cmd = [sys.executable, me, "--in-host", "--hosts", str(hosts), "--prefix", prefix,
               "--master-addr", netem.host_address(0, prefix), "--", sys.executable, me, "--worker", *worker_argv]
        return run_local(cmd, hosts)
    finally:
        removed = netem.down(prefix)
        print(f"netem down: removed {len(removed)} objects", flush=True)
