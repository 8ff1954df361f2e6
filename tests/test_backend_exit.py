"""A script on adacomp's torch backend that ends without shutdown() must exit cleanly: gloo's worker
threads release their last finished collective while the interpreter is still alive (see
``adacomp.backends.torch_dist._let_gloo_workers_settle``). Without that, about one in four such
two-rank runs aborted after all their work ("terminate called without an active exception")."""
from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

from tests._dist import run_launcher
from tests.test_examples import _env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from adacomp.backends.torch_dist import TorchBackend, _let_gloo_workers_settle, gloo_worker_states
    be = TorchBackend()
    for _ in range(3):
        t = torch.ones(1000) * be.rank()
        dist.all_reduce(t)
    if "--settle" in sys.argv:  # what the exit handler does, here where we can look afterwards
        _let_gloo_workers_settle()
        print(f"SETTLED rank={be.rank()} states={''.join(sorted(gloo_worker_states()))}", flush=True)
    print(f"EXIT_DONE rank={be.rank()} sum={float(t[0])}", flush=True)
""")


def test_script_without_shutdown_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "exit_without_shutdown.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "adacomp.tools.cli", "run", "-np", "2", "--", sys.executable, str(script)]
    for attempt in range(4):
        proc = run_launcher(cmd, str(ROOT), _env(), timeout=120, merge_stderr=True)
        out = proc.stdout
        assert proc.returncode == 0 and "terminate called" not in out, f"run {attempt}: rc {proc.returncode}\n{out[-3000:]}"
        assert out.count("EXIT_DONE") == 2 and out.count("sum=1.0") == 2, out[-3000:]


def test_settling_leaves_no_gloo_worker_runnable(tmp_path: Path) -> None:
    """Right after a collective a gloo worker is often still runnable (finishing its work item);
    after the exit handler's pause none is."""
    script = tmp_path / "settle.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "adacomp.tools.cli", "run", "-np", "2", "--", sys.executable, str(script), "--settle"]
    proc = run_launcher(cmd, str(ROOT), _env(), timeout=120, merge_stderr=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    states = re.findall(r"SETTLED rank=\d states=(\w*)", proc.stdout)
    # both ranks see their gloo workers (gloo's default: 2 per group), and none of them runnable
    assert len(states) == 2 and all(len(s) >= 2 and "R" not in s for s in states), proc.stdout[-3000:]
