#!/usr/bin/env python3
"""Issue 31's throughput goals, Skred against a private RabbitMQ in one run, from a C generator.

The issue's figures came from an independent load generator that uses far less CPU than the
broker; on 2 cores the Python generator (workloads.py) competes with the broker for them and
becomes the bottleneck. Here every cell is ``benchmarks/c/skload.c`` (built with ``cc``) in one
of its modes, varied messages (200 B-2 KiB, headers, message-id, timestamp) throughout:

  queues-1000  1,000 queues, a producer channel and a consumer channel each, unthrottled, no-ack
               (goal: >= 3x RabbitMQ)
  ack-100      1 producer, 1 consumer with prefetch 100 acking each message (goal: >= 4x)
  topic-50     a topic exchange, 50 queues bound with ``*.r<j % 10>.k<j // 10>``, random keys of
               the 50 that match one pattern each, a no-ack consumer per queue (goal: >= 225k
               deliveries/s on a quiet machine)

``--private DIR`` starts a Skred and a RabbitMQ of its own (benchmarks/tls_brokers.py, as
latency.py does); the brokers take turns, run by run, so load from elsewhere hits both alike.
Per cell and broker: the median rate of ``--runs`` runs (deliveries per second), the broker's CPU
microseconds per delivery (its process tree, sampled over the generator's measured window) and
the generator's own CPU seconds in that window (it must stay well under the broker's); then
Skred / RabbitMQ. Every run is bounded: skload exits after its set-up (60 s at most), a
warm-up second and ``--seconds``.

    python benchmarks/throughput.py --private /tmp/thru --runs 3 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from latency import tree_cpu  # noqa: E402
from workers import build_skload  # noqa: E402

# cell: (skload mode, PAIRS argument)
CELLS: dict[str, tuple[str, int]] = {"queues-1000": ("queues", 1000), "ack-100": ("ack", 1),
                                     "topic-50": ("topic", 1)}


def run_cell(skload: Path, port: int, pid: int, cell: str, seconds: float) -> dict[str, float]:
    """One run of ``cell`` against the broker on ``port`` (process ``pid``): deliveries per second,
    broker CPU µs per delivery and the generator's CPU seconds, over the generator's window."""
    mode, pairs = CELLS[cell]
    cmd = [str(skload), "-w", mode, "127.0.0.1", str(port), f"{seconds:g}", str(pairs), "/"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None
        cpu0 = cpu1 = None
        result: dict[str, float] = {}
        deadline = time.monotonic() + seconds + 120
        try:
            for line in p.stdout:  # the window's start, then the result: both end with a newline
                if time.monotonic() > deadline:
                    break
                if '"window"' in line:
                    cpu0 = tree_cpu(pid)
                elif line.startswith("{"):
                    cpu1 = tree_cpu(pid)
                    result = json.loads(line)
                    break
        finally:
            if p.poll() is None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            err = p.stderr.read() if p.stderr else ""
    if cpu0 is None or cpu1 is None or not result.get("consumed"):
        raise RuntimeError(f"skload {mode} failed ({p.returncode}): {err.strip()[-500:]}")
    consumed = float(result["consumed"])
    return {"rate": float(result["consume_rate"]), "cpu_us": (cpu1 - cpu0) * 1e6 / consumed,
            "client_cpu": float(result["cpu_seconds"]), "load1": os.getloadavg()[0]}


def table(results: dict[tuple[str, str], list[dict[str, float]]], cells: list[str], names: list[str],
          seconds: float) -> str:
    head = ["cell", "broker", "runs", "deliveries/s median [min-max]", "broker CPU µs/delivery",
            f"generator CPU s per {seconds:g} s", "load 1-min", "ratio to last broker"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in cells:
        base = results.get((cell, names[-1]), [])
        base_rate = statistics.median(r["rate"] for r in base) if base else 0.0
        for name in names:
            rs = results.get((cell, name), [])
            if not rs:
                rows.append(f"| {cell} | {name} | 0 | — | — | — | — | — |")
                continue
            rates = [r["rate"] for r in rs]
            med = statistics.median(rates)
            ratio = f"{med / base_rate:.2f}x" if base_rate else "—"
            loads = [r["load1"] for r in rs]
            rows.append(f"| {cell} | {name} | {len(rs)} | {med:,.0f} [{min(rates):,.0f}-{max(rates):,.0f}] "
                        f"| {statistics.median(r['cpu_us'] for r in rs):.1f} "
                        f"| {statistics.median(r['client_cpu'] for r in rs):.2f} "
                        f"| {min(loads):.1f}-{max(loads):.1f} | {ratio} |")
    return "\n".join(rows)


def alternate(skload: Path, targets: list[tuple[str, int, int]], cells: list[str], runs: int,
              seconds: float) -> int:
    """Every cell ``runs`` times on each (name, port, pid), the brokers in turn; prints the table."""
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    failed = 0
    for cell in cells:
        for run in range(runs):
            for name, port, pid in targets:
                try:
                    r = run_cell(skload, port, pid, cell, seconds)
                except (RuntimeError, OSError) as e:
                    failed += 1
                    print(f"  {cell} {name} run {run + 1}: {e}", file=sys.stderr, flush=True)
                    continue
                results.setdefault((cell, name), []).append(r)
                print(f"  {cell} {name} run {run + 1}: {json.dumps(r)}", file=sys.stderr, flush=True)
    print(table(results, cells, [t[0] for t in targets], seconds))
    print(f"\n{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M %Z')}")
    return 1 if failed else 0


def _own_listener_ports() -> None:
    """Every listener start_skred does not place goes to a free port of its own (another broker
    or a test may hold a default one): start_skred passes this environment to the broker."""
    from tests.integration._support import listener_ports_env

    os.environ.update({k: v for k, v in listener_ports_env().items()
                       if k not in ("SKRED_AMQP_PORT", "SKRED_MGMT_PORT", "SKRED_MGMT_METRICS_PORT")})
    os.environ.update(SKRED_MQTT_TLS_PORT="-1", SKRED_STREAM_TLS_PORT="-1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--private", default="", metavar="DIR",
                    help="start a Skred and a RabbitMQ with data in DIR")
    ap.add_argument("--skred-only", action="store_true", help="with --private: no RabbitMQ")
    ap.add_argument("--base", default="", metavar="CHECKOUT",
                    help="with --private: also a Skred run from the tree in CHECKOUT (an A/B pair)")
    ap.add_argument("--target", action="append", default=[], metavar="NAME=PORT,PID",
                    help="one more broker to measure in turn (e.g. Skred at another commit); repeatable")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--runs", type=int, default=3, help="runs per cell and broker (default 3)")
    ap.add_argument("-z", "--seconds", type=float, default=5.0)
    a = ap.parse_args(argv)
    cells = [c for c in a.cells.split(",") if c]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        ap.error(f"unknown cells {unknown}; choose from {','.join(CELLS)}")
    if not 0 < a.seconds <= 600 or not 0 < a.runs <= 50:
        ap.error("--seconds in (0, 600], --runs in [1, 50]")
    more = []
    for t in a.target:
        name, _, rest = t.partition("=")
        port, _, pid = rest.partition(",")
        more.append((name, int(port), int(pid or 0)))
    if not a.private and not more:
        ap.error("--private or --target is required")
    with tempfile.TemporaryDirectory(prefix="skred-throughput-") as tmp:
        skload = build_skload(Path(tmp))
        if not a.private:
            return alternate(skload, more, cells, a.runs, a.seconds)
        from tls_brokers import make_certs, start_rabbitmq, start_skred

        work = Path(a.private)
        certs = make_certs(work / "certs")
        _own_listener_ports()
        brokers = [start_skred(work, *certs)]
        if a.base:
            (work / "base").mkdir(exist_ok=True)
            _own_listener_ports()
            base = start_skred(work / "base", *certs, tree=Path(a.base).resolve())
            base.name = "Skred base"
            brokers.append(base)
        try:
            if not a.skred_only:
                brokers.append(start_rabbitmq(work, *certs))
            for b in brokers:
                b.wait_ready(300)
            targets = [(b.name, b.port, b.pid) for b in brokers]
            # Skred first, RabbitMQ last: the ratio column is against the last broker
            return alternate(skload, more + targets, cells, a.runs, a.seconds)
        finally:
            for b in brokers:
                b.stop()


if __name__ == "__main__":
    sys.exit(main())
