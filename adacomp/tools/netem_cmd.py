"""``adacomp netem up | set | down | status | schedule`` — emulated hosts on one machine (root only).

Examples::

    adacomp netem up --hosts 4 --bandwidth 100mbit
    adacomp netem set --host all --bandwidth 20mbit      # while training runs
    adacomp netem schedule configs/netem_c1.yaml --step-file /tmp/step.json &
    adacomp netem status
    adacomp netem down                                   # idempotent; also after a crash
"""
from __future__ import annotations

import argparse
import sys

from adacomp.netem import hosts as netem
from adacomp.errors import AdacompError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adacomp netem", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="see docs/netem.md")
    sub = p.add_subparsers(dest="action", required=True)

    def prefixed(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--prefix", default=netem.DEFAULT_PREFIX,
                        help=f"name prefix of every object created (default {netem.DEFAULT_PREFIX})")
        return sp

    sp = prefixed("up", "create N hosts (namespaces on a bridge) with an egress cap")
    sp.add_argument("--hosts", type=int, required=True)
    sp.add_argument("--bandwidth", required=True, help="egress cap per host, e.g. 100mbit, 1gbit")
    sp.add_argument("--subnet", default=netem.DEFAULT_SUBNET, help="private subnet used inside the namespaces only")
    sp = prefixed("set", "change the egress cap of one host or all, while traffic runs")
    sp.add_argument("--host", default="all", help="host index or 'all'")
    sp.add_argument("--bandwidth", required=True)
    prefixed("down", "remove everything `up` created with this prefix (idempotent)")
    prefixed("status", "print hosts, addresses and current rates")
    sp = prefixed("schedule", "apply a schedule file's bandwidth events in the foreground")
    sp.add_argument("file", help="YAML schedule (see docs/netem.md)")
    sp.add_argument("--step-file", default=None, help="progress file written by report_step() (step/epoch units)")
    sp.add_argument("--poll", type=float, default=0.1, help="seconds between polls")
    return p


def _host(text: str) -> int | None:
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise AdacompError(f"--host: expected an index or 'all', got {text!r}") from None


def _schedule(args: argparse.Namespace) -> int:
    from adacomp.netem.schedule import ScheduleController, load_schedule
    netem.require_root()
    ctl = ScheduleController(load_schedule(args.file), args.prefix, args.step_file, args.poll).start()
    try:
        while not ctl.done and ctl.error is None:
            ctl.join(0.5)
            for ev in ctl.applied:
                rates = ", ".join(f"{'all' if h is None else h}={netem.format_rate(b)}" for h, b in ev.bandwidth.items())
                print(f"at {ev.at:g}: {rates or 'latency only (applied by the workers)'}", flush=True)
            ctl.applied.clear()
    except KeyboardInterrupt:
        ctl.stop()
    if ctl.error is not None:
        raise ctl.error
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.action == "up":
            names = netem.up(args.hosts, args.bandwidth, args.prefix, args.subnet)
            print(f"up: {len(names)} hosts ({', '.join(names)}) at {args.bandwidth} egress each")
            print(f"launch: adacomp run --netem ...  |  by hand: {' '.join(netem.wrap_command(0, ['CMD'], args.prefix))}")
        elif args.action == "set":
            hosts = netem.set_bandwidth(args.bandwidth, _host(args.host), args.prefix)
            print(f"set: hosts {hosts} -> {args.bandwidth}")
        elif args.action == "down":
            removed = netem.down(args.prefix)
            print(f"down: removed {', '.join(removed)}" if removed else f"down: nothing with prefix {args.prefix!r}")
        elif args.action == "status":
            rows = netem.status(args.prefix)
            if not rows:
                print(f"no emulated hosts with prefix {args.prefix!r}")
            for r in rows:
                rate = netem.format_rate(r.rate_bps) if r.rate_bps else "uncapped"
                print(f"host {r.index}  {r.namespace:<10} {r.interface:<10} {r.address or '-':<15} {rate}")
        else:
            return _schedule(args)
    except (AdacompError, ValueError) as exc:
        print(f"adacomp netem {args.action}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
