"""The watchdog stays private and judges fairly, on 2 real processes (no launcher):

* its store listens on the master address only, and a client without the job's secret can
  neither hide a rank (a fake goodbye) nor touch its heartbeat keys;
* a freeze (SIGSTOP) shorter than ``timeout_s`` never ends the job;
* a rank that is alive but stuck (its heartbeat thread runs, its main thread does not reach the
  collective) is named as such;
* a store host that stops answering is reported as a lost connection, not as a stopped process.

This file is also the worker script (``python tests/test_watchdog_private.py MODE --marker M``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.test_rank_failure import _assert_no_orphans, _env

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 120


# ------------------------------------------------------------------------------------ the worker
def _guarded_allreduce(backend) -> None:
    import torch

    from adacomp.backends import watchdog
    with watchdog.guard(backend):
        backend.allreduce(torch.ones(4))


def _wait_ticks(wd, n: int) -> None:
    start = wd._beats
    while wd._beats < start + n:
        time.sleep(wd.interval_s / 4)


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("private", "freeze", "stuck", "lostconn"))
    p.add_argument("--marker", required=True)
    p.add_argument("--timeout", type=float, default=4.0)
    p.add_argument("--flag", default="")
    args = p.parse_args(argv)

    import torch
    torch.set_num_threads(1)
    import adacomp
    backend = adacomp.init(timeout_s=args.timeout)
    wd = backend.watchdog
    rank = backend.rank()
    pids = backend.allgather_object(os.getpid())
    for _ in range(2):
        _guarded_allreduce(backend)

    if args.mode == "private":
        report: dict[str, object] = {}
        if rank == 0:
            import datetime
            import socket

            from torch.distributed import TCPStore
            addr, port = wd.address
            report["address"] = [addr, port]
            listening = [ln.split() for ln in Path("/proc/net/tcp").read_text().splitlines()[1:]]
            report["listen"] = sorted(f[1] for f in listening if f[3] == "0A" and int(f[1].split(":")[1], 16) == port)
            try:
                socket.create_connection(("127.0.0.2", port), timeout=5).close()
                report["other_interface"] = "connected"
            except OSError as exc:
                report["other_interface"] = type(exc).__name__
            outsider = TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=5))
            outsider.set("bye/1", "1")                      # the old, unauthenticated key names
            outsider.set("hb/1", "999")
            outsider.set(wd._sign.key("bye/1"), "1.00000000000000000000000000000000")  # right key, no secret
        backend.barrier()
        _wait_ticks(wd, 3)
        report["bye_seen"] = sorted(wd._bye)
        _guarded_allreduce(backend)
        print("REPORT " + json.dumps(report), flush=True)
    elif args.mode == "freeze":
        if rank == 0:
            os.kill(pids[1], signal.SIGSTOP)
            time.sleep(0.75 * args.timeout)  # shorter than timeout_s
            os.kill(pids[1], signal.SIGCONT)
        for _ in range(3):
            _guarded_allreduce(backend)
        print(f"rank {rank} done, lost={wd.lost}", flush=True)
        adacomp.shutdown()
    elif args.mode == "stuck":
        if rank == 1:  # alive (the heartbeat thread runs) but never reaches the next collective
            while not os.path.exists(args.flag):
                time.sleep(0.1)
            return 0
        try:
            _guarded_allreduce(backend)
            print("no error", flush=True)
        except adacomp.CommunicationError as exc:
            print(f"ERROR {exc}", flush=True)
        Path(args.flag).write_text("done")
    elif args.mode == "lostconn":
        if rank == 1:
            os.kill(pids[0], signal.SIGSTOP)  # rank 0 (the store host) stops answering, its socket stays open
            _guarded_allreduce(backend)
            print("no error", flush=True)
        else:
            time.sleep(600)
    return 0


# --------------------------------------------------------------------------------------- helpers
def _run_pair(mode: str, *extra: str, env_extra: dict[str, str] | None = None,
              kill_after: int | None = None) -> list[tuple[int, str]]:
    """Both ranks without a launcher; if ``kill_after`` is a rank, the other is SIGKILLed once it ended."""
    from adacomp.tools.launch import free_port, worker_env
    marker = f"adacomp-wdpriv-{uuid.uuid4().hex[:8]}"
    port = free_port()
    procs = []
    for r in range(2):
        env = {k: v for k, v in {**_env(), **worker_env(r, 2, port)}.items() if k != "ADACOMP_JOB_TOKEN"}
        env.update(env_extra or {})
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), mode, "--marker", marker,
                                       *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs: list[tuple[int, str]] = [(0, "")] * 2
    try:
        order = [kill_after, 1 - kill_after] if kill_after is not None else [0, 1]
        for i, r in enumerate(order):
            if i == 1 and kill_after is not None:
                procs[r].kill()
            try:
                out, _ = procs[r].communicate(timeout=HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                procs[r].kill()
                out, _ = procs[r].communicate()
            outs[r] = (procs[r].returncode, out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        _assert_no_orphans(marker)
    return outs


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("token", ["drawn", "launcher"])
def test_store_is_bound_to_the_master_address_and_ignores_writers_without_the_secret(token: str) -> None:
    env = {"ADACOMP_JOB_TOKEN": uuid.uuid4().hex} if token == "launcher" else None
    outs = _run_pair("private", env_extra=env)
    assert [c for c, _ in outs] == [0, 0], outs
    reports = [json.loads(o.split("REPORT ", 1)[1].splitlines()[0]) for _, o in outs]
    addr, port = reports[0]["address"]
    assert addr == "127.0.0.1"
    assert reports[0]["listen"] == [f"0100007F:{port:04X}"], reports[0]  # 127.0.0.1 only, not 0.0.0.0
    assert reports[0]["other_interface"] == "ConnectionRefusedError", reports[0]
    assert reports[0]["bye_seen"] == [] and reports[1]["bye_seen"] == [], reports  # fake goodbyes ignored


def test_a_freeze_shorter_than_timeout_never_ends_the_job() -> None:
    outs = _run_pair("freeze")
    assert [c for c, _ in outs] == [0, 0], outs
    for r, (_, out) in enumerate(outs):
        assert f"rank {r} done, lost=None" in out, out


def test_a_live_but_stuck_rank_is_named(tmp_path) -> None:
    outs = _run_pair("stuck", "--timeout", "3", "--flag", str(tmp_path / "flag"))
    assert [c for c, _ in outs] == [0, 0], outs
    out = outs[0][1]
    assert "ERROR rank 1 (at call 2" in out and "alive (heartbeat fresh) but stuck" in out, out
    assert "is lost" not in out, out


def test_a_store_that_stops_answering_is_reported_as_a_lost_connection() -> None:
    outs = _run_pair("lostconn", kill_after=1)
    code, out = outs[1]
    assert code != 0, out
    assert "rank 0 is lost" in out and "lost its connection to rank 0's heartbeat store" in out, out
    assert "process stopped" not in out, out


def main() -> int:
    return worker(sys.argv[1:])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
