"""Emulated hosts on one machine: Linux network namespaces on a bridge, egress capped by ``tbf``.

Why namespaces: every worker gets its own address and its own egress queue, so a real transport
(gloo, MPI, Horovod) crosses a real, rate-limited link instead of loopback. The AR-Topk paper
(artopk-flexible-communication-moo.txt, Section IV, Fig. 6) changes bandwidth and latency with
``tc`` while training runs; we do the bandwidth half with ``tbf`` here. The ``netem`` qdisc is not
available in this kernel, so latency is added by :class:`adacomp.backends.shaped.ShapedBackend`.

Objects created by :func:`up` (``P`` = prefix, ``i`` = host index):

* namespace ``P-h<i>`` holding interface ``P-eth`` (same name in every namespace, so one
  ``GLOO_SOCKET_IFNAME`` fits all workers) with address ``<subnet>.<i+1>/24`` and a ``tbf`` root qdisc;
* in the root namespace, bridge ``P-br`` and the veth ends ``P-v<i>``. The bridge has no address:
  the subnet exists only inside the namespaces, so no traffic can leave them.

:func:`down` deletes exactly the names matching those patterns, so it is idempotent, works after a
crash, and leaves every other namespace / link alone. No state file is kept: :func:`status` reads
the live system. The schedule half (YAML -> bandwidth changes over steps, epochs or seconds) is in
:mod:`adacomp.netem.schedule`.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from adacomp.errors import AdacompError
from adacomp.units import format_rate, parse_duration, parse_rate  # noqa: F401 - netem.hosts.parse_rate is public

DEFAULT_PREFIX = "acn"
DEFAULT_SUBNET = "10.213.0.0/24"
TBF_LATENCY_MS = 50  # queue bound: ~50 ms of data may wait, as on a modest switch port
# One burst for every rate, larger than veth's biggest GSO packet (64 KiB). Why fixed: tbf admits
# packets up to the burst size at enqueue; if `set` later shrank the burst, packets already queued
# that are bigger than the new burst could never be sent and the link would stall (seen here with a
# rate-scaled burst). Why > 64 KiB: with a smaller burst tbf must split GSO packets, and 1gbit then
# measured ~580 Mbit/s instead of ~945 on this machine. Cost: below ~10mbit a burst is > 50 ms.
TBF_BURST_BYTES = 70000
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,5}$")  # keeps "P-v255" within Linux's 15-char limit


class NetemError(AdacompError, RuntimeError):
    """A netem operation failed or was refused; the message says what to do."""


# ---------------------------------------------------------------- units
# ---------------------------------------------------------------- names
def _check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix):
        raise NetemError(f"prefix: expected 1-6 lower-case letters/digits starting with a letter, got "
                         f"{prefix!r}. Fix: e.g. --prefix acn")
    return prefix


def namespace(i: int, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{_check_prefix(prefix)}-h{i}"


def interface(prefix: str = DEFAULT_PREFIX) -> str:
    """The interface name inside every namespace (use as ``GLOO_SOCKET_IFNAME``)."""
    return f"{_check_prefix(prefix)}-eth"


def _bridge(prefix: str) -> str:
    return f"{prefix}-br"


def _veth(i: int, prefix: str) -> str:
    return f"{prefix}-v{i}"


def _address_for(subnet: str, i: int) -> str:
    net = ipaddress.ip_network(subnet)
    addr = net.network_address + i + 1  # .1 for host 0; .0 is the network itself
    if addr >= net.broadcast_address:  # type: ignore[operator]  # both of net's IP version
        raise NetemError(f"subnet {subnet} has no room for host {i}; use a /24 or larger private subnet")
    return str(addr)


# ---------------------------------------------------------------- running commands
def require_root(euid: int | None = None) -> None:
    """Namespaces, links and qdiscs need CAP_NET_ADMIN; fail early with the fix."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise NetemError(f"adacomp netem needs root (expected euid 0, got {euid}). Fix: run it with "
                         "sudo, or as root inside a container started with --cap-add NET_ADMIN")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetemError("adacomp netem needs the `ip` and `tc` tools. Fix: apt-get install iproute2")


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetemError(f"`{' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def _json(args: list[str]) -> list[dict]:
    out = _run(args).stdout.strip()
    return json.loads(out) if out else []


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces named ``prefix-h<i>`` in host-index order; nothing else matches."""
    pat = re.compile(rf"^{re.escape(_check_prefix(prefix))}-h(\d+)$")
    names = [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]
    return sorted((n for n in names if pat.match(n)), key=lambda n: int(pat.match(n).group(1)))  # type: ignore[union-attr]


def _root_links(prefix: str) -> list[str]:
    pat = re.compile(rf"^{re.escape(prefix)}-(br|v\d+)$")
    return [link["ifname"] for link in _json(["ip", "-j", "link", "show"]) if pat.match(link.get("ifname", ""))]


# ---------------------------------------------------------------- tbf
def _tbf_args(bps: int) -> list[str]:
    return ["tbf", "rate", f"{bps}bit", "burst", str(TBF_BURST_BYTES), "latency", f"{TBF_LATENCY_MS}ms"]


def set_bandwidth(bandwidth: str | int, host: int | None = None, prefix: str = DEFAULT_PREFIX) -> list[int]:
    """Change the egress cap of one host (``host=None``: all) while traffic runs; returns hosts changed.

    Uses ``tc qdisc change`` so packets already queued stay queued (``replace`` would drop them).
    """
    require_root()
    bps = parse_rate(bandwidth)
    names = list_namespaces(prefix)
    if not names:
        raise NetemError(f"no emulated hosts with prefix {prefix!r}. Fix: adacomp netem up --hosts N --prefix {prefix}")
    targets = range(len(names)) if host is None else [host]
    for i in targets:
        if not 0 <= i < len(names):
            raise NetemError(f"host: expected 0..{len(names) - 1} or 'all', got {i}")
        _run(["tc", "-n", names[i], "qdisc", "change", "dev", interface(prefix), "root", *_tbf_args(bps)])
    return list(targets)


# ---------------------------------------------------------------- up / down / status
def up(hosts: int, bandwidth: str | int, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET) -> list[str]:
    """Create ``hosts`` namespaces on one bridge, each capped at ``bandwidth`` egress.

    Refuses when objects with this prefix already exist (run :func:`down` first). If any step
    fails, everything created so far is removed before the error propagates.
    """
    require_root()
    _check_prefix(prefix)
    if not 1 <= hosts <= 250:
        raise NetemError(f"hosts: expected 1..250, got {hosts}")
    bps = parse_rate(bandwidth)
    net = ipaddress.ip_network(subnet)
    if not net.is_private:
        raise NetemError(f"subnet: expected a private range (e.g. {DEFAULT_SUBNET}), got {subnet}")
    addrs = [_address_for(subnet, i) for i in range(hosts)]
    if list_namespaces(prefix) or _root_links(prefix):
        raise NetemError(f"emulated hosts with prefix {prefix!r} already exist. Fix: adacomp netem down "
                         f"--prefix {prefix} (or pick another --prefix)")
    eth, br = interface(prefix), _bridge(prefix)
    try:
        _run(["ip", "link", "add", br, "type", "bridge"])
        _run(["ip", "link", "set", br, "up"])
        for i, addr in enumerate(addrs):
            ns, veth = namespace(i, prefix), _veth(i, prefix)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", eth, "netns", ns])
            _run(["ip", "link", "set", veth, "master", br])
            _run(["ip", "link", "set", veth, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", eth])
            _run(["tc", "-n", ns, "qdisc", "add", "dev", eth, "root", *_tbf_args(bps)])
            _run(["ip", "-n", ns, "link", "set", eth, "up"])
    except BaseException:
        down(prefix)
        raise
    return [namespace(i, prefix) for i in range(hosts)]


def down(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every namespace and root link matching this prefix's patterns; returns what was removed.

    Deleting a namespace destroys its veth end, the peer in the root namespace and its qdisc.
    """
    require_root()
    removed = []
    for ns in list_namespaces(prefix):
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    for link in _root_links(prefix):
        _run(["ip", "link", "del", link], check=False)
        removed.append(link)
    return removed


@dataclass(frozen=True)
class HostStatus:
    index: int
    namespace: str
    interface: str
    address: str | None
    rate_bps: int | None


def status(prefix: str = DEFAULT_PREFIX) -> list[HostStatus]:
    """Hosts as they are now (read from the kernel, not from a state file)."""
    require_root()
    eth, rows = interface(prefix), []
    for i, ns in enumerate(list_namespaces(prefix)):
        addr = rate = None
        for link in _json(["ip", "-n", ns, "-j", "addr", "show"]):
            for a in link.get("addr_info", []):
                if link.get("ifname") == eth and a.get("family") == "inet":
                    addr = a["local"]
        for q in _json(["tc", "-n", ns, "-j", "qdisc", "show", "dev", eth]):
            if q.get("kind") == "tbf" and q.get("root"):
                rate = int(q["options"]["rate"]) * 8  # tc -j reports bytes/s
        rows.append(HostStatus(i, ns, eth, addr, rate))
    return rows


# ---------------------------------------------------------------- launching inside hosts
def wrap_command(host_index: int, argv: list[str], prefix: str = DEFAULT_PREFIX) -> list[str]:
    """``argv`` run inside emulated host ``host_index`` (needs root; environment is inherited)."""
    return ["ip", "netns", "exec", namespace(host_index, prefix), *argv]


def host_address(i: int, prefix: str = DEFAULT_PREFIX) -> str:
    """The live IPv4 address of host ``i`` (e.g. for MASTER_ADDR = host_address(0))."""
    for row in status(prefix):
        if row.index == i and row.address:
            return row.address
    raise NetemError(f"no emulated host {i} with prefix {prefix!r}. Fix: adacomp netem up --hosts N --prefix {prefix}")


def worker_env(prefix: str = DEFAULT_PREFIX) -> dict[str, str]:
    """Environment a worker inside a host needs: gloo (and TensorPipe) must bind the namespace's
    interface, otherwise gloo falls back to 127.0.0.1 and peers in other namespaces cannot connect."""
    eth = interface(prefix)
    return {"GLOO_SOCKET_IFNAME": eth, "TP_SOCKET_IFNAME": eth}
