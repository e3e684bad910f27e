#!/usr/bin/env python3
"""What TLS costs: skred-perf scenarios over the plain and the AMQPS port of one broker.

Runs each scenario alternately over ``--plain`` and ``--tls`` (plain, tls, plain, tls, ...),
and besides the throughput reads the broker's CPU time from /proc/<--pid>/stat around each run,
so the table also shows broker CPU microseconds per message: on a shared, loaded machine that
is steadier than a rate. Scenarios and their arguments are benchmarks/run.py's.

    python benchmarks/tls_cost.py --pid 1234 --plain amqp://guest:guest@127.0.0.1:5672/ \\
        --tls "amqps://guest:guest@localhost:5671/?cacertfile=tls/ca.crt" --only a,e

``--both DIR`` starts its own Skred and RabbitMQ 3.10 (benchmarks/tls_brokers.py) with a fresh
test CA and measures both the same way, one broker after the other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import fmt, run_perf, scenarios  # noqa: E402  (a sibling script, not a package)

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def measure(label: str, pid: int, plain: str, tls: str, keys: list[str], runs: int,
            seconds: float) -> list[str]:
    """Table rows for one broker: each scenario over plain and TLS alternately, medians."""
    all_scenarios = scenarios(1_000_000)
    rows = []
    for key in keys:
        sc = all_scenarios[key]
        rate: dict[str, list[float]] = {"plain": [], "tls": []}
        cost: dict[str, list[float]] = {"plain": [], "tls": []}
        failed: set[str] = set()
        for run in range(runs):
            for name, uri in (("plain", plain), ("tls", tls)):
                if name in failed:
                    continue  # a side that failed once is not retried: keep the session short
                before = cpu_seconds(pid)
                r = run_perf(uri, sc, seconds, 1_000_000)
                used = cpu_seconds(pid) - before
                if "error" in r or r.get("errors"):
                    print(f"  {label} ({key}) {name} run {run + 1}: ERROR {r.get('error') or r['errors']}",
                          file=sys.stderr)
                    failed.add(name)
                    continue
                value = float(r.get(sc.metric, 0.0))
                messages = max(1.0, float(r.get("consumed", 0)), float(r.get("published", 0)))
                rate[name].append(value)
                cost[name].append(used / messages * 1e6)
                print(f"  {label} ({key}) {name:5} run {run + 1}: {fmt(value, sc.unit)} {sc.unit}, "
                      f"broker {used:.2f} s CPU for {messages:,.0f} messages", file=sys.stderr, flush=True)
        med = {n: statistics.median(v) if v else 0.0 for n, v in rate.items()}
        cmed = {n: statistics.median(v) if v else 0.0 for n, v in cost.items()}
        ratio = f"{med['tls'] / med['plain']:.2f}" if med["plain"] and med["tls"] else "—"
        counts = f"{len(rate['plain'])}+{len(rate['tls'])}"
        rows.append(f"| {label} | {key} | {sc.unit} | {fmt(med['plain'], sc.unit)} "
                    f"| {fmt(med['tls'], sc.unit)} | {ratio} | {cmed['plain']:.2f} | {cmed['tls']:.2f} "
                    f"| {counts} |")
    return rows


HEADER = ["| broker | scenario | unit | plain (median) | TLS (median) | TLS / plain "
          "| broker CPU µs/msg plain | broker CPU µs/msg TLS | runs ok (plain+TLS) |",
          "|---|---|---|---|---|---|---|---|---|"]


def both(keys: list[str], runs: int, seconds: float, work: Path) -> list[str]:
    """Start a private Skred and a private RabbitMQ with TLS, measure both, stop both."""
    from tls_brokers import make_certs, start_rabbitmq, start_skred

    ca, cert, key = make_certs(work / "certs")
    rows = []
    for start in (start_skred, start_rabbitmq):
        broker = start(work, ca, cert, key)
        try:
            broker.wait_ready(120)
            rows += measure(broker.name, broker.pid, broker.plain_uri, broker.tls_uri, keys, runs, seconds)
        finally:
            broker.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pid", type=int, help="the broker's process id (for its CPU time)")
    ap.add_argument("--plain", help="amqp:// URI of the plain port")
    ap.add_argument("--tls", help="amqps:// URI of the TLS port")
    ap.add_argument("--both", metavar="WORK_DIR",
                    help="start a private Skred and a private RabbitMQ (TLS with a fresh test CA, files "
                         "under WORK_DIR) and measure both, instead of --pid/--plain/--tls")
    ap.add_argument("--only", default="a,e", help="comma-separated scenarios (default a,e)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    load = os.getloadavg()
    if args.both:
        rows = both(keys, args.runs, args.seconds, Path(args.both))
    elif args.pid and args.plain and args.tls:
        rows = measure("broker", args.pid, args.plain, args.tls, keys, args.runs, args.seconds)
    else:
        ap.error("give --both WORK_DIR, or --pid, --plain and --tls")
    after = os.getloadavg()
    print("\n".join(HEADER + rows))
    print(f"load average (1/5/15 min) before: {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, "
          f"after: {after[0]:.1f}/{after[1]:.1f}/{after[2]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
