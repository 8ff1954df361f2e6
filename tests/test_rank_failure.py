"""A rank dies (SIGKILL) mid-training: every other worker exits within about ``timeout_s`` with an
error naming the lost rank, under no launcher at all, ``adacomp run``, torchrun and mpirun, and
no process of the job is left behind.

This file is also the worker script (``python tests/test_rank_failure.py --marker ...``), so the
marker in every worker's command line lets the test find orphans in /proc.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests._dist import run_launcher

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 6.0        # the job's timeout_s: short so the tests are quick
HANG_GUARD_S = 150     # only so that a broken build fails instead of hanging CI


# ------------------------------------------------------------------------------------ the worker
def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--marker", required=True)
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--die-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--timeout", type=float, default=TIMEOUT_S)
    p.add_argument("--late-rank", type=int, default=-1, help="this rank works on alone after the last step")
    p.add_argument("--late-s", type=float, default=0.0)
    p.add_argument("--quit-rank", type=int, default=-1, help="this rank leaves the loop early and exits cleanly")
    p.add_argument("--quit-step", type=int, default=3)
    p.add_argument("--save-dir", default="", help="every step ends with a checkpoint set there; --die-rank dies "
                   "just before its save at --die-step")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    import adacomp
    from adacomp.backends import watchdog
    from adacomp.models import DigitsCNN

    torch.set_num_threads(1)
    cfg = {"compressor": {"name": "topk", "density": 0.05}, "communicator": {"name": "allgather"},
           "timeout_s": args.timeout}
    backend = adacomp.init(config=cfg)
    watchdog.start(backend, args.timeout)
    rank = adacomp.rank()
    torch.manual_seed(0)
    model = DigitsCNN()
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                       config=cfg)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        if rank == args.quit_rank and step == args.quit_step:
            print(f"rank {rank} ran out of data at step {step}", flush=True)
            break  # uneven data without join(): the others go on into collectives this rank skips
        x = torch.randn(16, 1, 8, 8, generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), torch.arange(16) % 10).backward()  # buckets start sending here
        if rank == args.die_rank and step == args.die_step and not args.save_dir:
            print(f"self-kill (SIGKILL) at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        with watchdog.guard(backend):
            opt.step()
        if args.save_dir:
            if rank == args.die_rank and step == args.die_step:
                print(f"self-kill (SIGKILL) before the save of step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            from adacomp.runtime import checkpoint
            checkpoint.save_set(args.save_dir, model, opt, step=step)
        if step % 20 == 0:
            print(f"rank {rank}: step {step}", flush=True)
    if rank == args.late_rank:  # no collectives from here on: the others exit meanwhile
        time.sleep(args.late_s)
        print(f"late rank {rank} done", flush=True)
    return 0  # no explicit watchdog.stop / shutdown: the exit hook must say goodbye


# ------------------------------------------------------------------------------------- helpers
def _worker_cmd(marker: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--marker", marker]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "ADACOMP_BACKEND"):
        env.pop(k, None)
    return env


def _with_marker(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if marker.encode() in cmd and "Z" not in state.split(":", 1)[-1][:3]:
            pids.append(int(d.name))
    return pids


def _assert_no_orphans(marker: str) -> None:
    """Processes with the marker may take a moment to be reaped after the launcher returned."""
    for _ in range(100):
        left = _with_marker(marker)
        if not left:
            return
        time.sleep(0.1)
    for pid in left:  # do not leak them into other tests
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"orphan worker processes left: {left}")


def _collect(procs: list, marker: str) -> list[str]:
    """Outputs of every worker; kills stragglers after the hang guard and checks nothing is left."""
    try:
        return [p.communicate(timeout=HANG_GUARD_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        _assert_no_orphans(marker)


def _run_launcher(cmd: list[str], marker: str) -> tuple[int, str]:
    try:
        res = run_launcher(cmd, str(ROOT), _env(), HANG_GUARD_S, merge_stderr=True)
    finally:
        _assert_no_orphans(marker)
    if res.timed_out:
        raise AssertionError(f"job did not end after a rank died:\n{res.stdout}")
    return res.returncode, res.stdout


# -------------------------------------------------------------------------------------- tests
def _renamed_parameters() -> str:
    """Rank 1 names its parameters differently; shapes (and the config) are identical."""
    import torch

    import adacomp
    from adacomp.models import DigitsCNN
    adacomp.init()
    torch.manual_seed(0)
    model = DigitsCNN()
    prefix = "module." if adacomp.rank() == 1 else ""  # e.g. one rank wrapped the model in DataParallel
    named = [(prefix + n, p) for n, p in model.named_parameters()]
    try:
        adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named)
    except adacomp.CommunicationError as exc:
        return str(exc)
    return "no error"


def test_different_parameter_names_with_same_shapes_fail_at_init_naming_ranks_and_names() -> None:
    from tests._dist import run_workers
    for msg in run_workers(_renamed_parameters, 2):
        assert "ranks [1]" in msg and "parameter names" in msg, msg
        assert "conv1.weight" in msg and "module.conv1.weight" in msg, msg  # what differs, both spellings


@pytest.mark.parametrize("dead", [1, 0], ids=["rank1", "rank0-store-host"])
def test_survivor_names_the_lost_rank_without_a_launcher(dead: int) -> None:
    """No launcher stops the survivor: the watchdog alone must end it, naming the dead rank (rank 0
    also hosts the heartbeat store, so its death is seen as the store going silent)."""
    from adacomp.tools.launch import free_port, worker_env
    marker = f"adacomp-rankfail-{uuid.uuid4().hex[:8]}"
    port = free_port()
    procs = []
    for r in range(2):
        env = {**_env(), **worker_env(r, 2, port)}
        procs.append(subprocess.Popen(_worker_cmd(marker) + ["--die-rank", str(dead)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = _collect(procs, marker)
    alive = 1 - dead
    assert procs[dead].returncode == -signal.SIGKILL, outs[dead]
    assert procs[alive].returncode != 0, outs[alive]
    assert f"rank {dead} is lost" in outs[alive], outs[alive]


def _two_workers(marker: str, extra: list[str]) -> tuple[list, list[str]]:
    from adacomp.tools.launch import free_port, worker_env
    port = free_port()
    procs = [subprocess.Popen(_worker_cmd(marker) + extra, cwd=ROOT, env={**_env(), **worker_env(r, 2, port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    return procs, _collect(procs, marker)


@pytest.mark.parametrize("dead", [1, 0], ids=["rank1", "rank0-store-host"])
def test_a_killed_rank_on_this_host_is_known_dead_without_waiting_out_timeout(dead: int) -> None:
    """timeout_s 60 (the default), no launcher: a rank on this host killed with SIGKILL is seen as
    gone (its process no longer exists) after a few heartbeats, not after the freeze tolerance; the
    survivor names it and why, so the job ends in seconds as under torchrun."""
    marker = f"adacomp-rankfail-{uuid.uuid4().hex[:8]}"
    procs, outs = _two_workers(marker, ["--die-rank", str(dead), "--timeout", "60"])
    alive = 1 - dead
    assert procs[dead].returncode == -signal.SIGKILL, outs[dead]
    assert procs[alive].returncode != 0, outs[alive]
    assert f"rank {dead} is lost (its process (pid" in outs[alive] and "exited without saying goodbye" in outs[alive], \
        outs[alive][-3000:]


def test_a_rank_killed_before_a_checkpoint_set_is_named_by_the_save(tmp_path) -> None:
    """save_set's collectives are guarded as a step's: the survivor names the lost rank (not gloo's
    'Connection reset by peer'), and the last complete set stays the one that loads."""
    marker = f"adacomp-rankfail-{uuid.uuid4().hex[:8]}"
    procs, outs = _two_workers(marker, ["--save-dir", str(tmp_path), "--steps", "6"])
    assert procs[1].returncode == -signal.SIGKILL, outs[1]
    assert procs[0].returncode != 0 and "rank 1 is lost" in outs[0], outs[0][-3000:]
    assert "step-0000000002" in (tmp_path / "latest").read_text()


def test_a_rank_that_runs_out_of_data_without_join_is_named() -> None:
    """Uneven data, no join(): rank 1 leaves its loop and exits cleanly; rank 0's next collective
    fails with a message naming rank 1 as finished and pointing at join(), not gloo's bare
    "Connection closed by peer" after the freeze tolerance."""
    marker = f"adacomp-rankfail-{uuid.uuid4().hex[:8]}"
    procs, outs = _two_workers(marker, ["--die-rank", "-1", "--steps", "20", "--quit-rank", "1", "--timeout", "60"])
    assert procs[1].returncode == 0 and "rank 1 ran out of data" in outs[1], outs[1]
    assert procs[0].returncode != 0, outs[0]
    assert "rank 1 finished and left the job" in outs[0] and "opt.join()" in outs[0], outs[0][-3000:]


@pytest.mark.parametrize("late", [0, 1], ids=["rank0-works-on", "rank1-works-on"])
def test_a_rank_that_finishes_early_is_not_taken_for_dead(late: int) -> None:
    """After the last collective one rank works on alone for longer than the heartbeat limit while
    the others exit normally (rank 0 hosts the store): nobody may be declared lost."""
    from adacomp.tools.launch import free_port, worker_env
    marker = f"adacomp-rankfail-{uuid.uuid4().hex[:8]}"
    port = free_port()
    timeout = 2.0  # heartbeat limit 1.2 s; the late rank works 4 s alone
    procs = [subprocess.Popen(_worker_cmd(marker) + ["--die-rank", "-1", "--steps", "3", "--timeout", str(timeout),
                                                     "--late-rank", str(late), "--late-s", "4"],
                              cwd=ROOT, env={**_env(), **worker_env(r, 2, port)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = _collect(procs, marker)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert f"late rank {late} done" in outs[late] and "is lost" not in "".join(outs), outs


def test_adacomp_run_stops_everyone_and_names_the_rank() -> None:
    marker = f"adacomp-rankfail-{uuid.uuid4().hex[:8]}"
    code, out = _run_launcher([sys.executable, "-m", "adacomp.tools.cli", "run", "-np", "3", "--grace", "2", "--",
                               *_worker_cmd(marker)], marker)
    assert code != 0, out
    assert "rank 1 exited with code -9" in out, out


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_torchrun_stops_everyone_and_names_the_rank() -> None:
    from adacomp.tools.launch import free_port
    marker = f"adacomp-rankfail-{uuid.uuid4().hex[:8]}"
    code, out = _run_launcher(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
                               "--monitor_interval", "0.5", *_worker_cmd(marker)[1:]], marker)
    assert code != 0, out
    # torchrun's summary: "Root Cause (first observed failure): ... rank : 1 (local_rank: 1) ... exitcode : -9"
    root = out.split("Root Cause", 1)[-1]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root) and "-9" in root, out


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_mpirun_stops_everyone_and_names_the_rank() -> None:
    pytest.importorskip("mpi4py")
    marker = f"adacomp-rankfail-{uuid.uuid4().hex[:8]}"
    code, out = _run_launcher(["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2",
                               *_worker_cmd(marker)], marker)
    assert code != 0, out
    assert re.search(r"process rank 1 with PID \d+ .*exited on\s+signal 9", out, re.S), out


if __name__ == "__main__":
    raise SystemExit(worker(sys.argv[1:]))
