#!/usr/bin/env python3
"""What TLS costs: skred-perf scenarios over the plain and the AMQPS port of one broker.

Runs each scenario alternately over ``--plain`` and ``--tls`` (plain, tls, plain, tls, ...),
and besides the throughput reads the broker's CPU time from /proc/<--pid>/stat around each run,
so the table also shows broker CPU microseconds per message: on a shared, loaded machine that
is steadier than a rate. Scenarios and their arguments are benchmarks/run.py's.

    python benchmarks/tls_cost.py --pid 1234 --plain amqp://guest:guest@127.0.0.1:5672/ \\
        --tls "amqps://guest:guest@localhost:5671/?cacertfile=tls/ca.crt" --only a,e
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pid", type=int, required=True, help="the broker's process id (for its CPU time)")
    ap.add_argument("--plain", required=True, help="amqp:// URI of the plain port")
    ap.add_argument("--tls", required=True, help="amqps:// URI of the TLS port")
    ap.add_argument("--only", default="a,e", help="comma-separated scenarios (default a,e)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    all_scenarios = scenarios(1_000_000)
    rows = ["| scenario | unit | plain (median) | TLS (median) | TLS / plain "
            "| broker CPU µs/msg plain | broker CPU µs/msg TLS |", "|---|---|---|---|---|---|---|"]
    for key in (k.strip() for k in args.only.split(",") if k.strip()):
        sc = all_scenarios[key]
        rate: dict[str, list[float]] = {"plain": [], "tls": []}
        cost: dict[str, list[float]] = {"plain": [], "tls": []}
        for run in range(args.runs):
            for name, uri in (("plain", args.plain), ("tls", args.tls)):
                before = cpu_seconds(args.pid)
                r = run_perf(uri, sc, args.seconds, 1_000_000)
                used = cpu_seconds(args.pid) - before
                if "error" in r or r.get("errors"):
                    print(f"  ({key}) {name} run {run + 1}: ERROR {r.get('error') or r['errors']}",
                          file=sys.stderr)
                    continue
                value = float(r.get(sc.metric, 0.0))
                messages = max(1.0, float(r.get("consumed", 0)), float(r.get("published", 0)))
                rate[name].append(value)
                cost[name].append(used / messages * 1e6)
                print(f"  ({key}) {name:5} run {run + 1}: {fmt(value, sc.unit)} {sc.unit}, "
                      f"broker {used:.2f} s CPU for {messages:,.0f} messages", file=sys.stderr, flush=True)
        med = {n: statistics.median(v) if v else 0.0 for n, v in rate.items()}
        cmed = {n: statistics.median(v) if v else 0.0 for n, v in cost.items()}
        ratio = f"{med['tls'] / med['plain']:.2f}" if med["plain"] else "—"
        rows.append(f"| {key} | {sc.unit} | {fmt(med['plain'], sc.unit)} | {fmt(med['tls'], sc.unit)} "
                    f"| {ratio} | {cmed['plain']:.2f} | {cmed['tls']:.2f} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
