"""Whether emulated hosts (network namespaces, tc) can be built here: the one skip condition of every
test that builds them (tests/test_netem.py, the netem benches in tests/test_bench.py)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

PREFIX = "acnt"


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); CI runs these as root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed: apt-get install iproute2"
    probe = f"{PREFIX}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"`ip netns add` fails here: {made.stderr.strip()}"


_SKIP_REASON = _netns_unavailable()
needs_netns = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")
