"""adacomp netem: real namespaces, real tbf, a real TCP bulk transfer between two emulated hosts.

Root tests build hosts with prefix ``acnt`` (never the user's default ``acn``) and skip, with the
reason, only when not root or when ``ip netns`` cannot work here. Parsing, schedules and the
controller are tested without root.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from adacomp.netem import hosts as netem
from adacomp.tools import netem_cmd
from adacomp.errors import ConfigError
from adacomp.netem.schedule import ScheduleController, load_schedule, parse_schedule, read_progress, report_step
from tests._netns import needs_netns

PREFIX = "acnt"
TRANSFER = [sys.executable, "-m", "adacomp.bench.netem_transfer"]  # adacomp bench netem_transfer





# ---------------------------------------------------------------- no root needed
def test_parse_rate_and_duration():
    assert netem.parse_rate("100mbit") == 100_000_000
    assert netem.parse_rate("1gbit") == 10**9
    assert netem.parse_rate("2.5Mbit") == 2_500_000
    assert netem.format_rate(20_000_000) == "20mbit"
    with pytest.raises(ValueError, match="bytes per second.*100mbit"):
        netem.parse_rate("100mbps")
    with pytest.raises(ValueError, match="unknown unit"):
        netem.parse_rate("100furlongs")
    assert netem.parse_duration("5ms") == pytest.approx(0.005)
    assert netem.parse_duration(0.25) == 0.25


def test_refuses_non_root_with_the_fix():
    with pytest.raises(netem.NetemError, match="needs root.*got 1000.*sudo"):
        netem.require_root(euid=1000)


def test_wrap_command_and_env():
    assert netem.wrap_command(1, ["python", "t.py"], "acx") == ["ip", "netns", "exec", "acx-h1", "python", "t.py"]
    assert netem.worker_env("acx")["GLOO_SOCKET_IFNAME"] == "acx-eth"
    with pytest.raises(netem.NetemError, match="prefix"):
        netem.namespace(0, "Bad-Prefix")


def test_schedule_validation_names_the_path(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("unit: epoch\nevents:\n  - {at: 3, bandwidth: {0: 20mbit, all: 1gbit}}\n  - {at: 1, latency: 5ms}\n")
    s = load_schedule(f)
    assert [e.at for e in s.events] == [1.0, 3.0]  # sorted by position
    assert s.value_at("bandwidth", 3, 0) == 20_000_000 and s.value_at("bandwidth", 3, 1) == 10**9
    assert s.value_at("bandwidth", 2, 1) is None and s.value_at("latency", 9, 1) == pytest.approx(0.005)
    bad = [({"unit": "hour", "events": [{"at": 0, "latency": 1}]}, "s.unit"),
           ({"events": [{"at": -1, "latency": 1}]}, r"s.events\[0\].at"),
           ({"events": [{"at": 0, "bandwidth": {0: "fast"}}]}, r"s.events\[0\].bandwidth.0"),
           ({"events": [{"at": 0, "bandwidth": {"x": "1gbit"}}]}, r"s.events\[0\].bandwidth.x"),
           ({"events": [{"at": 0, "rate": "1gbit"}]}, r"s.events\[0\].rate"),
           ({"events": [{"at": 0}]}, r"s.events\[0\]"),
           ({"events": []}, "s.events")]
    for data, path in bad:
        with pytest.raises(ConfigError, match=path):
            parse_schedule(data, source="s")


def test_controller_follows_reported_steps(tmp_path):
    step_file = str(tmp_path / "progress.json")
    sched = parse_schedule({"unit": "step", "events": [
        {"at": 0, "bandwidth": "100mbit"}, {"at": 10, "latency": "1ms"}, {"at": 20, "bandwidth": {1: "20mbit"}}]})
    seen: list[float] = []
    ctl = ScheduleController(sched, step_file=step_file, apply=lambda ev: seen.append(ev.at))
    assert ctl.tick() == 0  # nothing reported yet
    report_step(12, path=step_file)
    assert read_progress(step_file) == {"step": 12, "epoch": None}
    assert ctl.tick() == 2 and seen == [0.0]  # latency-only events are for the workers' backend
    report_step(25, path=step_file)
    assert ctl.tick() == 1 and seen == [0.0, 20.0] and ctl.done
    with pytest.raises(ConfigError, match="step file"):
        ScheduleController(sched, step_file=None)


def test_report_step_is_a_noop_without_a_step_file(monkeypatch):
    monkeypatch.delenv("ADACOMP_NETEM_STEP_FILE", raising=False)
    report_step(3)  # must not raise or write anywhere


# ---------------------------------------------------------------- root: real namespaces
def _leftovers() -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout)
    names = ns + [link["ifname"] for link in links]
    return sorted(n for n in names if n.startswith(f"{PREFIX}-h") or n in (f"{PREFIX}-br",)
                  or (n.startswith(f"{PREFIX}-v") and n[len(PREFIX) + 2:].isdigit()))


@pytest.fixture
def unrelated():
    """Objects sharing the prefix text but not netem's name patterns: they must survive."""
    for cmd in (["netns", "del", f"{PREFIX}-keep"], ["netns", "del", f"{PREFIX}x-h0"],
                ["link", "del", f"{PREFIX}-vk"]):
        subprocess.run(["ip", *cmd], capture_output=True)  # from an interrupted earlier run
    made = [["netns", "add", f"{PREFIX}-keep"], ["netns", "add", f"{PREFIX}x-h0"],
            ["link", "add", f"{PREFIX}-vk", "type", "bridge"]]  # no dummy driver in this kernel
    for cmd in made:
        subprocess.run(["ip", *cmd], check=True, capture_output=True)
    yield
    for cmd in (["netns", "del", f"{PREFIX}-keep"], ["netns", "del", f"{PREFIX}x-h0"],
                ["link", "del", f"{PREFIX}-vk"]):
        subprocess.run(["ip", *cmd], capture_output=True)


@pytest.fixture
def hosts(unrelated):
    netem.down(PREFIX)  # leftovers of a crashed earlier run
    assert netem_cmd.main(["up", "--hosts", "2", "--bandwidth", "100mbit", "--prefix", PREFIX]) == 0
    try:
        yield
    finally:
        netem.down(PREFIX)


def _in_host(i: int, *argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(netem.wrap_command(i, [*TRANSFER, *argv], PREFIX), text=True, **kw)


def _rate(intervals: list, lo: float, hi: float, interval: float) -> float:
    rows = [b for t, b in intervals if lo < t <= hi]
    assert len(rows) >= 3, f"too few intervals in ({lo}, {hi}]: {intervals}"
    return sum(rows) * 8 / (len(rows) * interval) / 1e6


@needs_netns
def test_bulk_transfer_matches_the_cap_and_set_changes_it_while_running(hosts):
    rows = {r.index: r for r in netem.status(PREFIX)}
    assert [rows[i].rate_bps for i in (0, 1)] == [100_000_000] * 2
    assert rows[1].address == netem.host_address(1, PREFIX) == "10.213.0.2"
    seconds, interval, switch_after = 4.5, 0.25, 2.0
    server = _in_host(1, "server", "--bind", rows[1].address, "--port", "5302", "--seconds", str(seconds),
                      "--interval", str(interval), "--announce", stdout=subprocess.PIPE)
    client = None
    try:
        assert server.stdout.readline().strip() == "listening"
        client = _in_host(0, "client", "--host", rows[1].address, "--port", "5302", "--seconds", str(seconds))
        assert server.stdout.readline().strip() == "receiving"  # first byte arrived: t = 0
        time.sleep(switch_after)
        assert netem_cmd.main(["set", "--host", "all", "--bandwidth", "20mbit", "--prefix", PREFIX]) == 0
        out, _ = server.communicate(timeout=seconds + 20)
        assert client.wait(timeout=20) == 0
    finally:
        for p in (server, client):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    result = json.loads(out)
    before = _rate(result["intervals"], 0.5, switch_after, interval)
    after = _rate(result["intervals"], switch_after + 1.0, seconds, interval)
    assert 85 <= before <= 115, f"at 100mbit measured {before:.1f} Mbit/s: {result['intervals']}"
    assert 17 <= after <= 23, f"after set 20mbit measured {after:.1f} Mbit/s: {result['intervals']}"
    assert {r.rate_bps for r in netem.status(PREFIX)} == {20_000_000}


@needs_netns
def test_down_removes_everything_and_only_ours(hosts):
    ctl = ScheduleController(parse_schedule({"unit": "seconds", "events": [
        {"at": 0, "bandwidth": "50mbit"}, {"at": 0.1, "bandwidth": {1: "30mbit"}}]}), PREFIX, poll_s=0.02).start()
    ctl.join(10)
    assert ctl.done and ctl.error is None
    assert [r.rate_bps for r in netem.status(PREFIX)] == [50_000_000, 30_000_000]
    assert netem_cmd.main(["up", "--hosts", "2", "--bandwidth", "1gbit", "--prefix", PREFIX]) == 2  # already up
    assert _leftovers()
    assert netem_cmd.main(["down", "--prefix", PREFIX]) == 0
    assert _leftovers() == []
    assert netem_cmd.main(["down", "--prefix", PREFIX]) == 0  # idempotent
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{PREFIX}-keep" in names and f"{PREFIX}x-h0" in names
    assert subprocess.run(["ip", "link", "show", f"{PREFIX}-vk"], capture_output=True).returncode == 0


@needs_netns
def test_failure_midway_through_up_cleans_up(unrelated, monkeypatch):
    netem.down(PREFIX)
    real_run, calls = netem._run, []

    def failing(args, check=True):
        calls.append(args)
        if len(calls) == 15:  # 2 listing calls, 2 for the bridge, 8 per host: inside host 1
            raise netem.NetemError("injected failure")
        return real_run(args, check)
    monkeypatch.setattr(netem, "_run", failing)
    with pytest.raises(netem.NetemError, match="injected"):
        netem.up(2, "100mbit", PREFIX)
    monkeypatch.setattr(netem, "_run", real_run)
    assert _leftovers() == []
    assert f"{PREFIX}-keep" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_netns
def test_a_non_root_process_is_refused(hosts):
    """A forked child drops to nobody (no exec needed, so /root permissions do not matter)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 99
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = netem_cmd.main(["down", "--prefix", PREFIX])
            os.write(w, err.getvalue().encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        message = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 2
    assert "needs root" in message and "got 65534" in message
    assert len(netem.list_namespaces(PREFIX)) == 2  # nothing was touched
