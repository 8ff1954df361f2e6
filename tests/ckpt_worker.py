"""Worker script for the checkpoint fault tests (run under ``adacomp run`` or torchrun):

* ``preempt``: trains until a pre-emption signal reaches any rank, then all ranks write one set
  and exit with ``PREEMPTED_EXIT_CODE``.
* ``elastic``: trains ``--steps`` steps with a set every ``--every`` steps, resuming from the last
  set; in restart attempt ``c < --kills`` rank ``--kill-rank`` SIGKILLs itself just after the set
  of step ``(c + 1) * every`` (plus one more step), so torchrun restarts the group.
* ``write-faults``: a set, then a save that fills the (small tmpfs) disk on rank 1 only, then a
  save into a read-only remount; prints one JSON line per outcome.

The ``--marker`` argument only lets tests find the processes in /proc.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

CFG = {"compressor": {"name": "topk", "density": 0.05}, "memory": {"name": "residual"},
       "communicator": {"name": "allgather"}, "min_numel": 512, "timeout_s": 30}


def _build():
    import adacomp
    from adacomp.models import DigitsCNN
    torch.manual_seed(0)
    model = DigitsCNN()
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       model.named_parameters(), config=CFG)
    adacomp.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def _digest(model, opt) -> str:
    from tests.test_checkpoint_resume import flatten
    h = hashlib.sha256()
    for k, v in [*flatten(model.state_dict(), "model"), *flatten(opt.state_dict(), "opt")]:
        h.update(k.encode())
        h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor)
                 else repr(v).encode())
    return h.hexdigest()


def preempt(args: argparse.Namespace) -> int:
    import adacomp
    from adacomp.runtime import checkpoint
    from tests.test_checkpoint_resume import train_steps
    adacomp.init(config=CFG)
    rank = adacomp.rank()
    model, opt = _build()
    with checkpoint.Preemption(args.signals.split(",")) as pre:
        extra = checkpoint.load_set(args.dir, model, opt)
        step = int(extra["step"]) if extra else 0
        print(f"rank {rank} pid {os.getpid()} starts at step {step}", flush=True)
        while step < args.steps:
            train_steps(model, opt, step, 1, rank)
            step += 1
            print(f"rank {rank} step {step}", flush=True)
            time.sleep(0.05)
            if pre.should_stop():
                checkpoint.save_set(args.dir, model, opt, step=step)
                got = pre.received.name if pre.received else "none (another rank's)"
                print(f"rank {rank} preempted after step {step}, signal {got}", flush=True)
                adacomp.shutdown()
                return checkpoint.PREEMPTED_EXIT_CODE
    adacomp.shutdown()
    return 0


def elastic(args: argparse.Namespace) -> int:
    import adacomp
    from adacomp.runtime import checkpoint
    from tests.test_checkpoint_resume import train_steps
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    adacomp.init(config=CFG)
    rank = adacomp.rank()
    model, opt = _build()
    extra = checkpoint.load_set(args.dir, model, opt)
    step = int(extra["step"]) if extra else 0
    if rank == 0:
        with open(Path(args.out) / "attempts.txt", "a") as fh:
            fh.write(f"{attempt} {step}\n")
    kill_at = (attempt + 1) * args.every + 1 if attempt < args.kills else -1
    while step < args.steps:
        train_steps(model, opt, step, 1, rank)
        step += 1
        if step % args.every == 0:
            checkpoint.save_set(args.dir, model, opt, step=step)
        if rank == args.kill_rank and step == kill_at:
            print(f"attempt {attempt}: rank {rank} SIGKILLs itself after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    (Path(args.out) / f"final.rank{rank}.txt").write_text(_digest(model, opt))
    adacomp.shutdown()
    return 0


def write_faults(args: argparse.Namespace) -> int:
    import adacomp
    from adacomp.runtime import checkpoint
    adacomp.init(config=CFG)
    rank = adacomp.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       config=CFG)

    def attempt(what: str, step: int, **extra: object) -> None:
        try:
            checkpoint.save_set(args.dir, model, opt, step=step, **extra)
            outcome = "ok"
        except OSError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"rank": rank, "what": what, "outcome": outcome}), flush=True)

    attempt("first", 1)
    big = torch.zeros(1 << 20) if rank == 1 else torch.zeros(1)  # 4 MiB on rank 1: the disk is full
    attempt("full", 2, blob=big)
    opt.backend.barrier()
    if rank == 0:
        subprocess.run(["mount", "-o", "remount,ro", args.mount], check=True)
    opt.backend.barrier()
    attempt("readonly", 3)
    extra = checkpoint.load_set(args.dir, model, opt)
    print(json.dumps({"rank": rank, "what": "load", "outcome": extra["step"]}), flush=True)
    adacomp.shutdown()
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("preempt", "elastic", "write-faults"))
    p.add_argument("--dir", required=True)
    p.add_argument("--out", default=".")
    p.add_argument("--marker", default="")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--kills", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--signals", default="SIGTERM,SIGUSR1")
    p.add_argument("--mount", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    return {"preempt": preempt, "elastic": elastic, "write-faults": write_faults}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
