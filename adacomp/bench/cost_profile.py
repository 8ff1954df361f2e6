"""Where a cost cell's step spends its time: ``perf`` samples of the timed steps alone, or the
time of each C call in them.

    adacomp bench cost profile --model resnet50 --method chunktopk --steps 100 [--sizes 65536:262144]
    adacomp bench cost profile --model resnet50 --method sidco --steps 7 --calls

runs ``adacomp bench cost cell`` under ``perf record`` (Linux perf, Debian's ``linux-perf``) with
its events disabled, and the cell enables them around each timed step only (perf's ``--control``
fifos), so the warm-up, the gradients' copies before each step and the floor passes between steps
are not in the profile. It prints the samples' shares by group of shared objects (the package's C
passes, the Python interpreter, torch, libc and the allocator, the kernel) and the top symbols.
Why perf and not cProfile: cProfile's per-call cost inflates the many small Python calls ~2.5x and
does not see inside the C passes; perf's sampling splits the step between both at no such cost
(cost_notes item 71 used it to tell which cells the Python calls hold above the goal).
``--calls`` (:class:`CallClock`) times each of the package's C entry points inside the timed steps
instead, without perf, and prints the step's split between them and the rest: what the step would
take if everything around the C passes cost nothing (cost_notes item 81). ``cell --calls`` adds the
same to the cell's JSON (``c_calls_s``: the C calls' seconds a step; ``c_calls``: per entry point).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, TextIO

GROUPS = (("native C passes", re.compile(r"^adacomp_native")), ("Python interpreter", re.compile(r"^libpython")),
          ("torch", re.compile(r"^(libtorch|libc10|_C\.)")),
          ("libc, allocator, loader", re.compile(r"^(libc\.so|libc-|ld-linux|libstdc\+\+|libm\.so|libffi|_ctypes)")),
          ("kernel", re.compile(r"^\[kernel")))
_LINE = re.compile(r"^\s*([0-9.]+)%\s+(\S.*?)\s*$")

_control: tuple[TextIO, TextIO] | None = None


def sizes_arg(text: str) -> tuple[int, int]:
    """``LO:HI`` (numel bounds; either may be empty: 0 and no limit) as a pair of ints."""
    lo, sep, hi = text.partition(":")
    try:
        got = (int(lo) if lo else 0, int(hi) if hi else 1 << 62)
    except ValueError:
        got = (0, -1)
    if not sep or got[0] < 0 or got[1] <= got[0]:
        raise argparse.ArgumentTypeError(f"--sizes wants LO:HI with 0 <= LO < HI (numel bounds), got {text!r}")
    return got


def connect(spec: str) -> None:
    """Open perf's control and acknowledgement fifos (``CTL,ACK``) for :func:`sampled`."""
    global _control
    ctl, _, ack = spec.partition(",")
    _control = (open(ctl, "w"), open(ack, "r"))


def _tell(command: str) -> None:
    assert _control is not None, "connect() first"
    ctl, ack = _control
    ctl.write(command + "\n")
    ctl.flush()
    if not ack.readline().strip("\x00\n").startswith("ack"):  # perf ends each reply with a NUL
        raise RuntimeError(f"perf did not acknowledge {command!r}")


def sampled(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with perf's events enabled while it runs (``cell``'s ``around``)."""
    def run() -> None:
        _tell("enable")
        try:
            step()
        finally:
            _tell("disable")
    return run


class CallClock:
    """Seconds each of the package's C entry points takes while a timed step runs (``cell --calls``):
    the step split between the C passes and the Python and torch work around them, without perf
    (which some machines forbid) and without cProfile's per-call inflation. Each entry point of the
    built library is wrapped by a timer (~0.3 us a call, on only inside :meth:`around`), and the
    originals are put back by :meth:`close`."""

    def __init__(self) -> None:
        from adacomp.compressors import _native
        lib = _native.library()
        if lib is None:
            raise SystemExit(f"--calls needs the package's C library: {_native.why_unavailable()}")
        self.lib = lib
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.steps = 0
        self._on = False
        names = sorted(set(re.findall(r"\b(ac_[a-z0-9_]+)\b", _native._SOURCE)))  # macro-made ones too
        self._saved = {n: getattr(lib, n) for n in names if hasattr(lib, n)}
        for name, fn in self._saved.items():
            setattr(lib, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def call(*args: Any) -> Any:
            if not self._on:
                return fn(*args)
            t0 = clock()
            try:
                return fn(*args)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + clock() - t0
                self.calls[name] = self.calls.get(name, 0) + 1
        return call

    def around(self, step: Callable[[], None]) -> Callable[[], None]:
        """``step`` with the timers on (``cell``'s ``around``)."""
        def run() -> None:
            self._on = True
            try:
                step()
            finally:
                self._on = False
                self.steps += 1
        return run

    def report(self) -> dict[str, Any]:
        """What ``cell --calls`` adds to its JSON: ``c_calls`` = {entry point: [seconds, calls]}, each
        the mean over the timed steps, the costliest first, and ``c_calls_s``, their sum."""
        n = max(1, self.steps)
        per = {k: [v / n, self.calls[k] / n] for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        return {"c_calls": per, "c_calls_s": sum(v[0] for v in per.values())}

    def close(self) -> None:
        for name, fn in self._saved.items():
            setattr(self.lib, name, fn)


class OpCounter:
    """The aten ops each timed step dispatches (``cell --ops``), by op and by the package's line that
    called it: a count, not a time, so it reads the same on every machine and run (the per-tensor
    path's torch glue: ~1-1.5 us an op, cost_notes item 85), and on alternate steps the Python calls
    (``sys.setprofile``: the interpreter's share of that glue). A ``TorchDispatchMode`` sees each op
    once, as the dispatcher does, views included; both slow the steps, so their times mean nothing here."""

    SITES = 12  # the call sites reported, the most frequent first

    def __init__(self) -> None:
        self.ops: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self.python_calls = self.builtin_calls = 0  # the interpreter's, counted on the odd steps
        self.steps = 0

    def around(self, step: Callable[[], None]) -> Callable[[], None]:
        from torch.utils._python_dispatch import TorchDispatchMode
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                name = func.overloadpacket.__name__
                counter.ops[name] += 1
                for frame in reversed(traceback.extract_stack(limit=16)[:-1]):
                    at = frame.filename.replace(os.sep, "/")
                    if "/adacomp/" in at and "/adacomp/bench/" not in at and not at.endswith("/adacomp/tensors.py"):
                        counter.sites[f"{name} {at.rsplit('/adacomp/', 1)[1]}:{frame.lineno}"] += 1
                        break
                return func(*args, **(kwargs or {}))

        def calls(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                counter.python_calls += 1
            elif event == "c_call":
                counter.builtin_calls += 1

        def run() -> None:  # even steps count the dispatches, odd ones the calls (the mode's own are many)
            if counter.steps % 2 == 0:
                with Mode():
                    step()
            else:
                sys.setprofile(calls)
                try:
                    step()
                finally:
                    sys.setprofile(None)
            counter.steps += 1
        return run

    def report(self) -> dict[str, Any]:
        """What ``cell --ops`` adds to its JSON: ``aten_ops`` (all), ``aten_ops_by`` (per op, the most
        first) and ``aten_ops_at`` (per op and calling line of the package, the :data:`SITES` most
        frequent), each a mean over the even timed steps; ``python_calls`` (Python functions) and
        ``builtin_calls`` (builtins and methods, ctypes' entry points among them), a mean over the odd
        ones (none counted with fewer than two steps)."""
        n, odd = max(1, (self.steps + 1) // 2), max(1, self.steps // 2)
        return {"aten_ops": sum(self.ops.values()) / n, "python_calls": self.python_calls / odd,
                "builtin_calls": self.builtin_calls / odd,
                "aten_ops_by": {k: v / n for k, v in self.ops.most_common()},
                "aten_ops_at": {k: v / n for k, v in self.sites.most_common(self.SITES)}}


class Toggle:
    """``cell --toggle MODULE:NAME.ATTR``: the timed steps alternate a boolean switch of the code
    (True on even steps, False on odd ones, restored after each), so both ways are timed in one
    process over the same gradients and state, each beside its own floor pass. Why: on a machine
    whose memory speed drifts by tens of percent within minutes, two cells of two checkouts
    measured one after another compare the hours more than the code (cost_notes item 84); the
    switch must leave every result the same (a speed path and its fallback)."""

    def __init__(self, spec: str):
        import importlib
        module, _, path = spec.partition(":")
        owner_name, _, self.attr = path.rpartition(".")
        if not module or not self.attr:
            raise SystemExit(f"--toggle: MODULE:NAME.ATTR or MODULE:ATTR, got {spec!r}")
        owner: Any = importlib.import_module(module)
        for part in filter(None, owner_name.split(".")):
            owner = getattr(owner, part)
        if not isinstance(getattr(owner, self.attr, None), bool):
            raise SystemExit(f"--toggle {spec}: not a boolean attribute")
        self.owner, self.spec, self.steps = owner, spec, 0

    def _with(self, on: bool, run: Callable[[], Any]) -> Any:
        """``run()`` with the switch set to ``on``, restored afterwards."""
        was = getattr(self.owner, self.attr)
        setattr(self.owner, self.attr, on)
        try:
            return run()
        finally:
            setattr(self.owner, self.attr, was)

    def around(self, step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            on = self.steps % 2 == 0
            self.steps += 1
            self._with(on, step)
        return run

    def report(self, got: dict[str, Any]) -> dict[str, Any]:
        return {"toggle": self.spec, **alternated(got)}

    def cells(self, pairs: int, one: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``cell --toggle SPEC --cells N``: N pairs of whole cells ``one()`` in this process, the switch
        on for the first of each pair and off for the second. Why: a switch whose effect spans steps
        (a residual left to the next step's pass) cannot alternate step by step, where each step
        would pay half of either way; whole cells, each with its own state and warm-up, can. Returns
        the last cell's record with, per way, the median step (``on_s``), the median step over its
        floor (``on_x_floor``), the tenth percentile of the steps (``on_p10_s``) and each cell's median
        ratio (``on_cells_x_floor``)."""
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        got: dict[str, Any] = {}
        for _ in range(pairs):
            for on in (True, False):
                got = self._with(on, one)
                runs[on].append(got)
        out = {**got, "toggle": self.spec, "cells": pairs}
        for on, way in ((True, "on"), (False, "off")):
            steps = [s for c in runs[on] for s in c["steps_s"]]
            out.update(_way(way, steps, [f for c in runs[on] for f in c["floors_s"]]))
            out[f"{way}_p10_s"] = sorted(steps)[len(steps) // 10]
            out[f"{way}_cells_x_floor"] = [_way(way, c["steps_s"], c["floors_s"])[f"{way}_x_floor"] for c in runs[on]]
        return out


def _way(way: str, steps: list[float], floors: list[float]) -> dict[str, float]:
    """One way's median step (``<way>_s``) and median step over the floor timed beside it (``<way>_x_floor``)."""
    import statistics
    return {f"{way}_s": statistics.median(steps),
            f"{way}_x_floor": statistics.median(a / b for a, b in zip(steps, floors))}


def alternated(got: dict[str, Any]) -> dict[str, Any]:
    """Of a cell whose timed steps alternated two ways (even steps "on", odd ones "off"): per way, the
    median step, and the median of each step over the floor timed after it."""
    out: dict[str, Any] = {}
    for parity, way in ((0, "on"), (1, "off")):
        out.update(_way(way, got["steps_s"][parity::2], got["floors_s"][parity::2]))
    return out


class Against:
    """``cell --against REV``: the timed steps alternate this checkout's C library (even steps, "on")
    and one built from another version's ``_native.py`` (a git revision or a path; odd steps, "off"),
    so a change of the C passes is timed in one process over the same gradients and state, each step
    beside its own floor (:func:`alternated`). Both libraries must give the same bits, as every fast
    path must (``adacomp bench cost passes`` checks each pass's)."""

    def __init__(self, spec: str):
        from adacomp.bench.cost_passes import against_library
        from adacomp.compressors import _native
        mine = _native.library()
        if mine is None:
            raise SystemExit(f"--against needs the package's C library: {_native.why_unavailable()}")
        try:
            self.libs = (mine, against_library(spec))
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
        self.spec, self.steps = spec, 0

    def around(self, step: Callable[[], None]) -> Callable[[], None]:
        from adacomp.compressors import _native

        def run() -> None:
            was = _native._lib
            _native._lib = self.libs[self.steps % 2]
            self.steps += 1
            try:
                step()
            finally:
                _native._lib = was
        return run

    def report(self, got: dict[str, Any]) -> dict[str, Any]:
        return {"against": self.spec, **alternated(got)}


def shares(report: str) -> list[tuple[float, str]]:
    """(percent, name) of each row of ``perf report --stdio`` (sorted by one key), in its order."""
    return [(float(m.group(1)), m.group(2)) for m in map(_LINE.match, report.splitlines()) if m]


def grouped(by_dso: list[tuple[float, str]]) -> list[tuple[str, float]]:
    """The shared objects' shares summed by :data:`GROUPS` (the rest as "other"), largest first."""
    out = {name: 0.0 for name, _ in GROUPS}
    out["other"] = 0.0
    for pct, dso in by_dso:
        out[next((name for name, rx in GROUPS if rx.search(dso)), "other")] += pct
    return sorted(out.items(), key=lambda kv: -kv[1])


def _report(data: Path, key: str) -> str:
    return subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", key, "--stdio"],
                          capture_output=True, text=True, check=True).stdout


def _cell_command(args: argparse.Namespace, *extra: str) -> list[str]:
    cell = [sys.executable, "-m", "adacomp.bench.cost", "cell", "--model", args.model, "--method", args.method,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--grads", args.grads, *extra]
    if args.sizes is not None:
        cell += ["--sizes", f"{args.sizes[0]}:{args.sizes[1]}"]
    return cell


def calls_split(args: argparse.Namespace) -> None:
    """``profile --calls``: the cell with each C call timed (:class:`CallClock`), no perf: the step's
    split between the C calls and the rest, and the costliest entry points, in floors."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    run = subprocess.run(_cell_command(args, "--calls"), capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise SystemExit(f"the cost cell failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    step, floor, c = got["step_s"], got["floor_s"], got["c_calls_s"]
    print(f"{args.model} / {args.method}: median step {1e3 * step:.1f} ms, floor {1e3 * floor:.1f} ms, "
          f"{step / floor:.2f}x floor; its C calls {1e3 * c:.1f} ms a step ({c / floor:.2f} floors, "
          f"{100 * c / step:.0f} %), the rest (Python, torch, ctypes) {1e3 * (step - c):.1f} ms "
          f"({(step - c) / floor:.2f} floors)")
    print(f"\ntop {args.top} C entry points (ms a step, floors, calls a step):")
    for name, (seconds, calls) in list(got["c_calls"].items())[:args.top]:
        print(f"  {1e3 * seconds:8.2f} ms  {seconds / floor:5.2f}  {calls:7.1f}  {name}")


def profile(args: argparse.Namespace) -> None:
    """The ``profile`` subcommand (see the module docstring)."""
    if args.calls:
        calls_split(args)
        return
    if shutil.which("perf") is None:
        raise SystemExit("adacomp bench cost profile needs Linux perf on PATH (Debian: apt install linux-perf)")
    if args.method in args.peers:
        raise SystemExit(f"adacomp bench cost profile: {args.method} runs on two processes; profile one of "
                         f"{', '.join(m for m in args.methods if m not in args.peers)}")
    with tempfile.TemporaryDirectory(prefix="adacomp-perf-") as tmp:
        ctl, ack, data = Path(tmp, "ctl"), Path(tmp, "ack"), Path(tmp, "perf.data")
        os.mkfifo(ctl)
        os.mkfifo(ack)
        cell = _cell_command(args, "--perf-control", f"{ctl},{ack}")
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        t0 = time.perf_counter()
        rec = subprocess.run(["perf", "record", "-F", str(args.frequency), "-D", "-1",
                              f"--control=fifo:{ctl},{ack}", "-o", str(data), "--", *cell],
                             capture_output=True, text=True, env=env)
        if rec.returncode != 0 or not data.exists():
            raise SystemExit(f"perf record of the cell failed (exit {rec.returncode}; perf_event_paranoid may "
                             f"forbid it: /proc/sys/kernel/perf_event_paranoid):\n{rec.stderr[-3000:]}")
        got = json.loads(rec.stdout.strip().splitlines()[-1])
        by_dso, by_sym = shares(_report(data, "dso")), shares(_report(data, "sym"))
    print(f"{args.model} / {args.method}: {args.steps} timed steps sampled at {args.frequency} Hz "
          f"({time.perf_counter() - t0:.0f} s in all): median step {1e3 * got['step_s']:.1f} ms, floor "
          f"{1e3 * got['floor_s']:.1f} ms, {got['step_s'] / got['floor_s']:.2f}x floor (perf's sampling slows the "
          f"steps a little; `cell` without it measures them)")
    print("\nshare of the sampled steps by group:")
    for name, pct in grouped(by_dso):
        if pct > 0:
            print(f"  {pct:6.2f} %  {name}")
    print(f"\ntop {args.top} symbols:")
    for pct, sym in by_sym[:args.top]:
        print(f"  {pct:6.2f} %  {sym[:110]}")


def add_parser(sub: Any, methods: list[str], peers: list[str], warmup_arg: Callable[[str], int], warmup: int,
               warmup_help: str) -> None:
    p = sub.add_parser("profile", help="perf samples of a cost cell's timed steps alone (see cost_profile)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--method", required=True, choices=methods)
    p.add_argument("--steps", type=int, default=100, help="timed steps sampled (default: %(default)s)")
    p.add_argument("--warmup", type=warmup_arg, default=warmup, help=warmup_help)
    p.add_argument("--sizes", type=sizes_arg, help="LO:HI, only the tensors of LO <= numel < HI")
    p.add_argument("--grads", choices=("randn", "model"), default="randn")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--frequency", type=int, default=2000, help="samples a second (default: %(default)s)")
    p.add_argument("--top", type=int, default=30, help="symbols listed (default: %(default)s)")
    p.add_argument("--calls", action="store_true",
                   help="no perf: time each C call of the timed steps instead (`cell --calls`) and print the "
                        "step's split between them and the rest")
    p.set_defaults(methods=methods, peers=peers)
