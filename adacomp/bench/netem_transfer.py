"""Bulk TCP transfer between two emulated hosts: measures what ``adacomp netem`` really delivers.

    adacomp bench netem_transfer probe --src 0 --dst 1 --seconds 3     # as root, after netem up
    -> {"mbit_s": 95.1, "intervals": [[0.25, 2981888], ...], ...}

``probe`` starts ``server`` inside host ``dst`` and ``client`` inside host ``src`` (via
``ip netns exec``), and prints the receiver's per-interval byte counts as JSON. Every loop is
bounded by ``--seconds`` plus a fixed grace, so a broken link fails instead of hanging. The
reported rate is TCP payload; tbf counts Ethernet frames, so expect ~95% of the configured cap.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time

LAUNCH = "adacomp bench netem_transfer probe --src 0 --dst 1"  # root, after `adacomp netem up`

CHUNK = 64 * 1024
GRACE_S = 10.0


def server(bind: str, port: int, seconds: float, interval: float, announce: bool = False) -> dict:
    with socket.create_server((bind, port)) as srv:
        print("listening", flush=True)
        srv.settimeout(GRACE_S)
        conn, _ = srv.accept()
    intervals: list[list[float]] = []
    total, t0 = 0, None
    deadline = time.monotonic() + seconds + GRACE_S
    with conn:
        conn.settimeout(GRACE_S)
        bucket, bucket_end = 0, 0.0
        while time.monotonic() < deadline:
            data = conn.recv(CHUNK)
            now = time.monotonic()
            if not data:
                break
            if t0 is None:
                t0, bucket_end = now, now + interval
                if announce:  # lets a caller time actions relative to the first byte
                    print("receiving", flush=True)
            while now >= bucket_end:  # close every interval that ended before this read
                intervals.append([round(bucket_end - t0, 6), bucket])
                bucket, bucket_end = 0, bucket_end + interval
            bucket += len(data)
            total += len(data)
    return {"intervals": intervals, "total_bytes": total, "interval_s": interval}


def client(host: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + GRACE_S
    while True:  # the server may still be binding; retry for a bounded time
        try:
            sock = socket.create_connection((host, port), timeout=GRACE_S)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = os.urandom(CHUNK)
    end = time.monotonic() + seconds
    with sock:
        while time.monotonic() < end:
            sock.sendall(payload)


def rate_mbit(result: dict, skip_s: float = 0.5, until_s: float | None = None) -> float:
    """Mean receive rate over intervals ending after ``skip_s`` (and at most ``until_s``)."""
    rows = [(t, b) for t, b in result["intervals"] if t > skip_s and (until_s is None or t <= until_s)]
    if not rows:
        raise ValueError("no complete intervals in the window; transfer too short")
    return sum(b for _, b in rows) * 8 / (len(rows) * result["interval_s"]) / 1e6


def probe(src: int, dst: int, seconds: float, prefix: str, port: int, interval: float) -> dict:
    from adacomp.bench.common import module_command
    from adacomp.netem import hosts as netem
    me = module_command("netem_transfer")
    addr = netem.host_address(dst, prefix)
    srv = subprocess.Popen(netem.wrap_command(dst, [*me, "server", "--bind", addr, "--port", str(port),
                                                    "--seconds", str(seconds), "--interval", str(interval)], prefix),
                           stdout=subprocess.PIPE, text=True)
    try:
        if srv.stdout.readline().strip() != "listening":  # type: ignore[union-attr]
            raise RuntimeError("transfer server did not start")
        subprocess.run(netem.wrap_command(src, [*me, "client", "--host", addr, "--port", str(port),
                                                "--seconds", str(seconds)], prefix),
                       check=True, timeout=seconds + 2 * GRACE_S)
        out, _ = srv.communicate(timeout=2 * GRACE_S)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    result = json.loads(out)
    result["mbit_s"] = round(rate_mbit(result), 3)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="adacomp bench netem_transfer", description=(__doc__ or "").split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server")
    s.add_argument("--bind", required=True)
    s.add_argument("--announce", action="store_true", help='print "receiving" at the first byte')
    c = sub.add_parser("client")
    c.add_argument("--host", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--src", type=int, default=0)
    pr.add_argument("--dst", type=int, default=1)
    pr.add_argument("--prefix", default="acn")
    for sp in (s, c, pr):
        sp.add_argument("--port", type=int, default=5301)
        sp.add_argument("--seconds", type=float, default=3.0)
    for sp in (s, pr):
        sp.add_argument("--interval", type=float, default=0.25)
    a = p.parse_args(argv)
    if a.mode == "server":
        print(json.dumps(server(a.bind, a.port, a.seconds, a.interval, a.announce)))
    elif a.mode == "client":
        client(a.host, a.port, a.seconds)
    else:
        print(json.dumps(probe(a.src, a.dst, a.seconds, a.prefix, a.port, a.interval)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
