"""Adaptive policies' decision steps on realistic models (issue 21): rank 0's decision time and
the longest time any other rank waited inside one collective, on the zoo's GPT-2-small-like
transformer and VGG-16 (synthetic batches, CPU, gloo).

    adacomp bench policy_decisions                      # spawns 2 workers
    adacomp bench policy_decisions --models vgg16 --policies bytecomp --no-write

Each arm builds a fresh model and DistributedOptimizer (Top-k 1%), runs until the policy has
decided and applied its decision, plus one step. Waits come from each policy's
:class:`adacomp.policies.rendezvous.Rendezvous` (seconds inside one collective call). The table
replaces the section between the markers in docs/results/adaptive.md under the current directory
(``--out``; the rest of the file is kept).
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import torch

from adacomp.bench.common import RESULTS, bench_command, machine, worker_or_spawn
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench policy_decisions"  # spawns --np workers itself, or under any launcher

BEGIN, END = "<!-- policy-decisions: begin -->", "<!-- policy-decisions: end -->"
NOTE = "Before issue 21, bytecomp timed every candidate size 100 times on rank 0 before broadcasting (one Top-k of VGG-16's 103M-element layer takes about 1 s here, so minutes), and lgreco / moo broadcast only after deciding: rank 1 sat in one `broadcast_object` for the whole decision (lgreco: 36 s on GPT-2 in this run, close to the 60 s timeout; its first version here also held the GIL for 9 s in a 38M-element `.tolist()`, now gone). bytecomp now profiles a few sizes (at most 4M elements, extrapolated beyond) within 2 s per rank, split across the ranks; its decision stays under 0.2 s for GPT-2's 148 tensors. lgreco's decision used to sort every layer (36 s on GPT-2 before its exact fast Top-k errors and pruned DP, docs/algorithms_adaptive.md) and moo evaluated t_sync per individual (4.9 s); both now decide in about 1 s, and however long a decision takes, progress rounds keep every wait in one collective to about 2 s at most. With gloo on loopback, communication is nearly free, so bytecomp compresses few or no tensors here."

# policy -> (config, steps to run: the decision happens in the last but one)
POLICIES: dict[str, tuple[dict[str, Any], int]] = {
    "bytecomp": ({"name": "bytecomp", "profile_steps": 3}, 4),
    "lgreco": ({"name": "lgreco", "warmup": 2, "period": 1000}, 3),
    "moo": ({"name": "moo", "c_high": 0.1, "c_low": 0.01, "factor": 10.0, "explore_steps": 1}, 4),
    "flexible": ({"name": "flexible"}, 2),
}


def arm(model_name: str, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """One (model, policy) run on this rank."""
    import adacomp
    from adacomp.models import build, synthetic_batch
    kw = {"image_size": args.image_size} if model_name in ("vgg16", "resnet50") else {"seq": args.seq}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build(model_name, **kw)
    data = synthetic_batch(model, args.batch, seed=adacomp.rank())
    pcfg, steps = POLICIES[policy]
    cfg = {"compressor": {"name": "topk", "density": 0.01}, "communicator": {"name": "allgather"},
           "fusion": {"fuse_before_compress": False}, "policy": pcfg}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                       named_parameters=model.named_parameters(), config=cfg)
    def step() -> None:
        opt.zero_grad()
        data.loss(model).backward()
        opt.step()

    times = time_steps(step, steps)
    pol: Any = opt.policy  # the policy's own attributes (plan, density, ...)
    rv = pol.rendezvous
    out = {"model": model_name, "policy": policy, "tensors": len(list(model.parameters())),
           "decision_s": rv.decision_s, "max_wait_s": rv.max_wait_s, "rounds": rv.rounds,
           "waits": [(w, round(s, 3)) for w, s in rv.waits], "step_s": times,
           "decision_step_extra_s": getattr(pol, "overhead_s", None),
           "profile_s": getattr(pol, "profile_s", None)}
    if policy == "bytecomp":
        out["outcome"] = f"{sum(o != 'none' for o in pol.plan.values())}/{len(pol.plan)} tensors compressed"
    elif policy == "lgreco":
        out["outcome"] = f"{len(pol.assignment)} layers assigned"
    elif policy == "moo":
        out["outcome"] = f"density {pol.density:.3g}"
    else:
        out["outcome"] = f"{len(pol.choice)} buckets: {','.join(sorted(set(pol.choice.values())))}"
    opt.remove_hooks()
    del opt, model
    return out


def worker(args: argparse.Namespace) -> None:
    import adacomp
    be = adacomp.init()
    torch.set_num_threads(args.threads)
    rows = []
    for model_name in args.models:
        for policy in args.policies:
            mine = arm(model_name, policy, args)
            gc.collect()  # the previous arm's model and optimizer state must go before the next one
            every = be.allgather_object(mine)
            if be.rank() == 0:
                r0, r1 = every[0], every[1]
                rows.append({**r0, "rank1_max_wait_s": r1["max_wait_s"], "rank1_rounds": r1["rounds"]})
                print(f"{model_name} {policy}: decision {r0['decision_s']:.3f} s, rank-1 max wait "
                      f"{r1['max_wait_s']:.3f} s ({r1['rounds']} progress rounds), decision step +"
                      f"{r0['decision_step_extra_s'] or 0:.2f} s, {r0['outcome']}; rank-1 waits {r1['waits']}", flush=True)
    if be.rank() == 0 and not args.no_write:
        write(rows, args)
    be.barrier()
    adacomp.shutdown()


def write(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    cmd = args.command
    lines = [BEGIN, "## Decision steps on GPT-2-small-like and VGG-16 (issue 21)", "",
             f"Command: `{cmd.strip()}` (2 gloo processes on one machine; {machine()}; "
             f"{args.threads} torch thread per rank; batch {args.batch}, GPT-2 sequence {args.seq}, VGG-16 "
             f"images {args.image_size}x{args.image_size}; Top-k 1%, allgather; default `timeout_s` 60 s).", "",
             "*decision s*: rank 0's time from the start of the decision to its result (the work rank 1 "
             "used to wait for in one broadcast). *rank-1 max wait*: the longest time rank 1 spent inside a "
             "single collective of the policy (progress broadcasts arrive at least every 2 s = 0.05 x "
             "timeout, so this stays far below the 60 s collective timeout however long rank 0 works). "
             "*decision step +s* (bytecomp): rank 0's whole one-off cost in the deciding step (sharing "
             "traces, the alpha / beta probe, the shared compression profile = *profile s*, the decision); "
             "for lgreco and moo the decision time is that cost; flexible re-decides every step from its "
             "allgathered probe, on every rank, so no rank waits for another's work. During bytecomp's `profile_steps` the only per-step overhead "
             "is one timestamp per gradient (post-accumulate hook), and those steps run uncompressed.", "",
             "| model | tensors | policy | decision s | rank-1 max wait s | progress rounds | decision step +s "
             "| profile s | outcome |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        prof = f"{r['profile_s']:.2f}" if r["profile_s"] is not None else "-"
        extra = f"{r['decision_step_extra_s']:.2f}" if r["decision_step_extra_s"] is not None else "-"
        lines.append(f"| {r['model']} | {r['tensors']} | {r['policy']} | {r['decision_s']:.3f} | "
                     f"{r['rank1_max_wait_s']:.3f} | {r['rank1_rounds']} | {extra} | "
                     f"{prof} | {r['outcome']} |")
    lines += ["", NOTE, "", END]
    path = Path(args.out)
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + "\n".join(lines) + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    path.write_text(text)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adacomp bench policy_decisions", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2, help="workers to spawn when not started by a launcher")
    ap.add_argument("--models", nargs="+", default=["gpt2_small", "vgg16"], choices=["gpt2_small", "vgg16",
                                                                                       "resnet50", "lstm_lm"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16, help="GPT-2 / LSTM sequence length")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=f"{RESULTS}/adaptive.md", help="relative to the current directory (default: %(default)s)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    args.command = bench_command("policy_decisions", argv)
    return worker_or_spawn(lambda: worker(args), args.np, "policy_decisions", argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
