"""adacomp.ddp.hook: the same compression behind DDP's communication hook, on 2 gloo ranks."""
from __future__ import annotations

import os
import re
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._dist import free_port, run_workers
from tests.parity import COMPRESSED, NONE, Run, equal, init, max_rel, rank

ROOT = Path(__file__).resolve().parents[1]
STEPS = 50
METHODS = {"none": NONE, **COMPRESSED}


def _hook_run(cfg: dict, steps: int, delays: bool = False) -> dict:
    import adacomp
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    run = Run(None)  # builds the model and a DDP wrapper with the default hook ...
    model = DDP(run.base, bucket_cap_mb=0.004)  # ... replaced by a multi-bucket one with our hook
    state, hook = adacomp.ddp.hook(cfg, named_parameters=run.base.named_parameters())
    model.register_comm_hook(state, hook)
    if delays:  # random per-rank delays inside backward: buckets become ready at different times
        rng = random.Random(rank())
        for m in (run.base.fc1, run.base.fc2, run.base.fc3):
            m.register_full_backward_hook(lambda *a, r=rng: time.sleep(r.random() * 0.01))
    opt = torch.optim.SGD(run.base.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    from tests.parity import batch
    import torch.nn.functional as F
    for s in range(steps):
        opt.zero_grad()
        x, y = batch(rank(), s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return run.params()


def _same_worker() -> dict:
    init()
    out = {"none_vs_ddp": equal(_hook_run(NONE, STEPS), Run(None).train(range(STEPS)).params())}
    for name, cfg in METHODS.items():
        out[name] = max_rel(_hook_run(cfg, STEPS), Run(cfg).train(range(STEPS)).params())
    return out


def test_hook_equals_distributed_optimizer_and_plain_ddp() -> None:
    for r, res in enumerate(run_workers(_same_worker, 2, timeout=900)):
        assert res["none_vs_ddp"], r
        for name in METHODS:
            assert res[name] <= 1e-6, (r, name, res[name])


def _delays_worker() -> int:
    init()
    for _ in range(20):
        for name in ("powersgd", "acpsgd", "topk"):
            _hook_run(COMPRESSED[name], 3, delays=True)
    return 20


def test_twenty_repetitions_with_random_delays_never_mismatch() -> None:
    assert run_workers(_delays_worker, 2, timeout=900) == [20, 20]


def _state_worker() -> bool:
    """Hook state round-trips: 3 steps, save, 3 more == 6 straight."""
    init()
    import adacomp
    from torch.nn.parallel import DistributedDataParallel as DDP
    cfg = COMPRESSED["powersgd"]
    full = _hook_run(cfg, 6)
    torch.manual_seed(0)
    run = Run(None)
    model = DDP(run.base, bucket_cap_mb=0.004)
    state, hook = adacomp.ddp.hook(cfg, named_parameters=run.base.named_parameters())
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(run.base.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    from tests.parity import batch
    import torch.nn.functional as F

    def train(steps: range) -> None:
        for s in steps:
            opt.zero_grad()
            x, y = batch(rank(), s)
            F.cross_entropy(model(x), y).backward()
            opt.step()
    train(range(3))
    saved = {"hook": state.state_dict(), "opt": opt.state_dict(), "model": run.base.state_dict()}
    import copy
    saved = copy.deepcopy(saved)
    torch.manual_seed(0)
    run2 = Run(None)
    run2.base.load_state_dict(saved["model"])
    model2 = DDP(run2.base, bucket_cap_mb=0.004)
    state2, hook2 = adacomp.ddp.hook(cfg, named_parameters=run2.base.named_parameters())
    state2.load_state_dict(saved["hook"])
    model2.register_comm_hook(state2, hook2)
    opt2 = torch.optim.SGD(run2.base.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    opt2.load_state_dict(saved["opt"])
    model, opt = model2, opt2
    train(range(3, 6))
    return equal(full, run2.params())


def test_hook_state_checkpoint_resumes_bitwise() -> None:
    assert run_workers(_state_worker, 2, timeout=600) == [True, True]


def test_policies_and_offload_are_refused_clearly() -> None:
    import adacomp
    with pytest.raises(adacomp.ConfigError, match="policy"):
        adacomp.ddp.hook({"policy": {"name": "flexible"}, "compressor": {"name": "topk"},
                          "communicator": {"name": "allgather"}})


@pytest.mark.parametrize("script", ["lightning_ddp_hook.py", "accelerate_ddp_hook.py"])
def test_framework_examples_train_through_the_hook(script: str) -> None:
    pytest.importorskip("lightning" if script.startswith("lightning") else "accelerate")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for method in ("topk", "powersgd"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), str(ROOT / "examples" / script), "--method", method]
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        found = re.search(rf"trained with adacomp {method} hook: final loss [\d.]+, (\d+) compressed steps", res.stdout)
        assert found and int(found.group(1)) > 0, res.stdout[-2000:]
