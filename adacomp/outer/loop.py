"""The outer loop: H local steps, then a compressed, averaged pseudo-gradient and an outer step.

DiLoCo (Douillard et al., 2023, Algorithm 1): every worker starts a window from the synchronised
parameters theta, takes H inner optimizer steps on its own data (no communication), then

    Delta_r = theta - theta_r                       (the pseudo-gradient of rank r, line 10)
    Delta   = mean_r C(Delta_r + e_r)               (compressed with error feedback e_r, averaged)
    theta   = OuterOpt(theta, Delta)                (line 12: Nesterov, lr 0.7, momentum 0.9)

and every rank continues from theta, keeping its inner optimizer state. ``C`` and ``e`` are the
configured compressor and memory, the mean is the configured communicator: the same components as
the per-step path, run by the same :class:`~adacomp.engine.step_engine.StepEngine` on the
synchronised copies, whose ``.grad`` holds Delta_r. With the identity C and outer SGD (lr 1,
momentum 0) theta becomes the average of the workers' parameters (Local SGD).

Streaming DiLoCo (Douillard et al., 2025) cuts the parameters into P fragments (§2.2): fragment f is
synchronised after the steps t with t mod H = (f + 1) H / P, so the peak payload is 1/P of the
model; with an overlap of tau steps (§2.3) a fragment's collectives run while the next tau inner steps
compute, and when they land the outer result is mixed in: theta_r <- alpha theta_r + (1 - alpha) theta
(alpha = ``mixing``; tau = 0 replaces the local copy, as DiLoCo does).

Each fragment owns a :class:`~adacomp.engine.routes.RouteTable` (buckets, compressors, memories),
a :class:`StepEngine`, a :class:`~adacomp.engine.optimizer_state.ComponentState` and an outer
``torch.optim.SGD`` over its synchronised copies: composition, no state shared between fragments.

Rank consistency: the schedule counts optimizer steps, so every rank issues the same collectives in
the same order. A rank that runs out of data inside ``join()`` follows the schedule without
computing (:meth:`OuterLoop.drain`): it sends what it has not yet sent once, then zeros, until the
votes say no rank is active; then every rank sends its remainder once more and all end identical.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from adacomp import outer
from adacomp.backends.base import Backend
from adacomp.config import Config, LocalStepsConfig
from adacomp.engine.error_feedback import LossScale
from adacomp.engine.metrics import StepStats
from adacomp.engine.optimizer_state import ComponentState
from adacomp.engine.routes import RouteTable
from adacomp.engine.round import Vote
from adacomp.engine.step_engine import EngineOptions, StepEngine
from adacomp.errors import ConfigError

_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


def blocks(names: list[str]) -> list[list[str]]:
    """Consecutive parameters of one block: the name up to its first numeric part (``blocks.3``),
    else its module path. Streaming DiLoCo fragments whole transformer blocks (§2.2)."""
    out: list[list[str]] = []
    last = None
    for n in names:
        m = _BLOCK.match(n)
        key = m.group(1) if m else n.rpartition(".")[0]
        if out and key == last:
            out[-1].append(n)
        else:
            out.append([n])
        last = key
    return out


def partition(params: list[tuple[str, Tensor]], fragments: int, pattern: str) -> list[list[str]]:
    """Parameter names of each fragment. ``strided``: block i -> fragment i mod P (the pattern
    Streaming DiLoCo found better, §3.2); ``sequential``: contiguous blocks, balanced by size."""
    names = [n for n, _ in params]
    units = blocks(names)
    if fragments > len(units):
        raise ConfigError("local_steps.fragments", f"the model has {len(units)} parameter blocks, fewer than "
                                                   f"{fragments} fragments; use at most {len(units)}")
    if pattern == "strided":
        return [[n for u in units[f::fragments] for n in u] for f in range(fragments)]
    sizes = dict((n, p.numel()) for n, p in params)
    total = sum(sizes.values())
    frags: list[list[str]] = [[] for _ in range(fragments)]
    done = 0
    for i, u in enumerate(units):
        # the fragment this block's midpoint falls into, but never leaving a later fragment empty
        mid = done + sum(sizes[n] for n in u) / 2
        f = min(int(mid * fragments / max(total, 1)), fragments - 1)
        f = max(f, fragments - (len(units) - i))
        f = min(f, next((j for j in range(fragments) if not frags[j]), fragments - 1))
        frags[f].extend(u)
        done += sum(sizes[n] for n in u)
    return frags


def offsets(every: int, fragments: int) -> list[int]:
    """Step residue (mod ``every``) after which fragment f is synchronised."""
    return [((f + 1) * every // fragments) % every for f in range(fragments)]


@dataclass
class Fragment:
    """One synchronised piece of the model and everything its synchronisation owns."""

    index: int
    names: list[str]
    local: list[Tensor]  # the model's parameters (the inner optimizer steps them)
    synced: list[torch.nn.Parameter]  # theta: parameters at the last synchronisation
    delta: list[Tensor]  # buffers the pseudo-gradient is written into
    table: RouteTable
    engine: StepEngine
    io: ComponentState
    outer_opt: torch.optim.Optimizer
    offset: int
    syncs: int = 0
    launched_at: int | None = None  # step whose round is in flight
    merge_at: int | None = None  # step after which a finished round is mixed into the local copy
    discard: bool = False  # the finished round was non-finite: the window is dropped
    dirty: bool = False  # local steps since this fragment's last round (a leaving rank owes them)
    last_stats: StepStats | None = field(default=None, repr=False)


class OuterLoop:
    """The synchronisation schedule over fragments, driven by the optimizer's ``step()``."""

    def __init__(self, config: Config, params: list[tuple[str, Tensor]], backend: Backend):
        ls = config.local_steps
        assert ls is not None
        self.ls: LocalStepsConfig = ls
        self.backend = backend
        self.started = False
        self.skipped_syncs = 0
        self.last_vote: Vote | None = None  # the vote of the last round finished
        spec = ls.outer_optimizer
        self._outer_factory = outer.get(spec.name, **spec.params)
        by_name = dict(params)
        self.fragments = [self._fragment(config, f, names, [by_name[n] for n in names], off)
                          for f, (names, off) in enumerate(zip(partition(params, ls.fragments, ls.fragment_pattern),
                                                               offsets(ls.every, ls.fragments)))]

    def _fragment(self, config: Config, index: int, names: list[str], local: list[Tensor], offset: int) -> Fragment:
        synced = [torch.nn.Parameter(p.detach().clone(), requires_grad=False) for p in local]
        table = RouteTable(config, list(zip(names, synced)))
        engine = StepEngine(table, self.backend, EngineOptions(1, False, config.nonfinite, False), LossScale(None))

        def set_syncs(n: int) -> None:
            frag.syncs = n

        io = ComponentState(None, table, LossScale(None), lambda: None, lambda: frag.syncs, set_syncs)
        frag = Fragment(index, names, local, synced, [torch.zeros_like(p) for p in local], table, engine, io,
                        self._outer_factory.build(synced), offset)
        return frag

    # --- the schedule ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Take the synchronised copies from the model (the first ``step()``, after the script's
        ``broadcast_parameters``; a loaded checkpoint has set them already)."""
        with torch.no_grad():
            for fr in self.fragments:
                for s, p in zip(fr.synced, fr.local):
                    s.copy_(p)
        self.started = True

    def after_step(self, step: int, contribute: bool = True, active: bool = True) -> StepStats:
        """After optimizer step ``step`` (or, for a rank that left, the step the others are at):
        land the rounds due, launch the ones due, and return what this step sent."""
        stats = StepStats(step=step)
        if contribute and active:
            for fr in self.fragments:
                fr.dirty = True
        for fr in self.fragments:
            if self._due(fr, step):
                self._launch(fr, step, contribute, active)
        for fr in self._in_order():
            if fr.launched_at is not None and fr.launched_at + self.ls.overlap_steps <= step:
                self._complete(fr)
            if fr.merge_at is not None and fr.merge_at <= step:
                self._merge(fr)
            if fr.last_stats is not None:
                stats.add(fr.last_stats)
                fr.last_stats = None
        return stats

    def _due(self, fr: Fragment, step: int) -> bool:
        return step % self.ls.every == fr.offset

    def _in_order(self) -> list[Fragment]:
        """Fragments in the order their rounds were launched (the order every rank finishes them)."""
        return sorted(self.fragments, key=lambda fr: (fr.launched_at is None, fr.launched_at or 0, fr.index))

    def _launch(self, fr: Fragment, step: int, contribute: bool, active: bool) -> None:
        if fr.launched_at is not None or fr.merge_at is not None:
            raise RuntimeError(f"fragment {fr.index}: a synchronisation is still pending at step {step}")
        send = contribute and fr.dirty
        with torch.no_grad():
            for s, p, d in zip(fr.synced, fr.local, fr.delta):
                torch.sub(s, p, out=d)  # Delta_r = theta - theta_r (DiLoCo Alg. 1 line 10)
                s.grad = d
        fr.engine.launch_all(contribute=send, report_active=active)
        fr.dirty = False
        fr.launched_at = step

    def _complete(self, fr: Fragment) -> None:
        """Finish the round in flight, apply the outer step to the synchronised copy; the local copy
        is updated later, at ``merge_at`` (the same step when there is no overlap)."""
        assert fr.launched_at is not None
        fr.engine.finish()
        vote = fr.engine.last_vote
        assert vote is not None
        self.last_vote = vote
        fr.syncs += 1
        fr.discard = vote.nonfinite
        if vote.nonfinite:
            self.skipped_syncs += 1
        elif any(vote.used_by_any):
            fr.outer_opt.step()  # averaged Delta in .grad of the synchronised copies
        for s in fr.synced:
            s.grad = None
        for c in fr.table.unique_compressors():
            c.on_step(fr.syncs)
        fr.last_stats = fr.engine.end_step(fr.syncs)
        fr.merge_at = fr.launched_at + self.ls.overlap_steps
        fr.launched_at = None

    def _merge(self, fr: Fragment) -> None:
        """theta_r <- theta (no overlap, or a dropped window), else alpha theta_r + (1 - alpha) theta."""
        a = self.ls.mixing
        with torch.no_grad():
            for s, p in zip(fr.synced, fr.local):
                if self.ls.overlap_steps == 0 or fr.discard:
                    p.copy_(s)
                else:
                    p.mul_(a).add_(s, alpha=1.0 - a)
        fr.merge_at, fr.discard = None, False

    def settle(self) -> None:
        """Finish every round in flight now (a checkpoint's state must not hold open collectives);
        the local copies are still mixed at their step. Every rank must call it at the same step."""
        for fr in self._in_order():
            if fr.launched_at is not None:
                self._complete(fr)

    # --- uneven inputs --------------------------------------------------------------------------------
    def drain(self, step: int) -> int:
        """This rank has no more data: follow the schedule without computing (sending what it owes,
        then zeros) until a vote shows no active rank; then every rank sends its remainder once
        and ends with the same parameters. Returns the step count the ranks ended at."""
        while True:
            step += 1
            self.last_vote = None
            self.after_step(step, contribute=True, active=False)
            if self.last_vote is not None and not self.last_vote.active_ranks:
                break
        self.flush(step)
        return step

    def flush(self, step: int) -> None:
        """One last round of every fragment (all ranks together), applied at once: no rank keeps
        local progress the others do not have."""
        self.settle()
        for fr in self.fragments:
            if fr.merge_at is not None:
                self._merge(fr)
        for fr in self.fragments:
            self._launch(fr, step, True, False)
            self._complete(fr)
            fr.merge_at = None
            with torch.no_grad():
                for s, p in zip(fr.synced, fr.local):
                    p.copy_(s)

    # --- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.settle()
        return {"started": self.started, "skipped_syncs": self.skipped_syncs,
                "fragments": [{"names": fr.names, "synced": {n: s.detach().clone() for n, s in zip(fr.names, fr.synced)},
                               "outer_optimizer": fr.outer_opt.state_dict(), "syncs": fr.syncs,
                               "merge_at": fr.merge_at, "discard": fr.discard, "dirty": fr.dirty,
                               "components": fr.io.adacomp_state_dict()} for fr in self.fragments]}

    def reshard(self, states: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
        """Resume on another world size: synced parameters and outer optimizer state are equal on
        every rank; each fragment's compression state is resharded by its components' rules."""
        out = dict(states[rank % len(states)])
        out["fragments"] = [{**fr_state, "components": fr.io.reshard([s["fragments"][i]["components"] for s in states],
                                                                     world, rank)}
                            for i, (fr, fr_state) in enumerate(zip(self.fragments, out["fragments"]))]
        return out

    def owed(self, states: list[dict[str, Any]]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for i, fr in enumerate(self.fragments):
            for k, t in fr.io.owed([s["fragments"][i]["components"] for s in states]).items():
                out[f"fragment{i}/{k}"] = t
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        frs = state.get("fragments", [])
        if len(frs) != len(self.fragments) or any(s["names"] != fr.names for s, fr in zip(frs, self.fragments)):
            raise ValueError(f"checkpoint's outer loop has {len(frs)} fragments over other parameters than this "
                             f"one's {len(self.fragments)}; was it written with another local_steps config or model?")
        for s, fr in zip(frs, self.fragments):
            with torch.no_grad():
                for n, t in zip(fr.names, fr.synced):
                    if n not in s["synced"] or s["synced"][n].shape != t.shape:
                        raise ValueError(f"checkpoint's synchronised copy of {n!r} is missing or has another shape")
                    t.copy_(s["synced"][n])
            fr.outer_opt.load_state_dict(_int_keys(s["outer_optimizer"]))
            fr.io.load_adacomp_state_dict(s["components"])
            fr.syncs, fr.merge_at, fr.discard, fr.dirty = int(s["syncs"]), s["merge_at"], bool(s["discard"]), bool(s["dirty"])
            fr.launched_at = None
        self.started = bool(state.get("started", True))
        self.skipped_syncs = int(state.get("skipped_syncs", 0))


def _int_keys(opt_state: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer state dict whose per-parameter keys went through a format that keeps only
    string keys (torch.distributed.checkpoint): torch's ``load_state_dict`` matches them as ints and
    would silently drop the momentum otherwise."""
    return {**opt_state, "state": {int(k): v for k, v in opt_state.get("state", {}).items()}}


__all__ = ["Fragment", "OuterLoop", "blocks", "offsets", "partition"]
