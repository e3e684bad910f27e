#!/usr/bin/env python3
"""Run the issue-3 benchmark scenarios against Skred and, optionally, a peer broker.

Each scenario is one ``skred-perf throughput ... -j`` run (bounded by ``--seconds``); with
``--peer`` the two brokers are measured alternately (skred, peer, skred, peer, ...) so that
background noise on a shared machine hits both alike. The table shows the median of
``--runs`` runs per broker and the ratio skred/peer; ``--write`` also stores it with a machine
description in docs/benchmarks.md. skred-perf deletes the queues and exchanges it declares, on
both brokers.

    python benchmarks/run.py --skred amqp://guest:guest@127.0.0.1:5672/ \\
        --peer amqp://guest:guest@127.0.0.1:5682/ --only a,c --seconds 5 --write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    args: tuple[str, ...]
    metric: str  # key of skred-perf's JSON summary
    unit: str
    tool: str = "perf"  # "perf": skred-perf throughput; "workload": benchmarks/workloads.py
    runs: int = 0  # runs per broker when not --runs (0: --runs)


def scenarios(prefill: int, rss_count: int = 1_000_000) -> dict[str, Scenario]:
    items = [
        Scenario(
            "a",
            "16 B, 1 producer + 1 consumer, autoack",
            ("-x", "1", "-y", "1", "-s", "16"),
            "consume_rate",
            "msg/s",
        ),
        Scenario(
            "b",
            "16 B, 1p1c, manual ack (every 500), prefetch 1000",
            ("-x", "1", "-y", "1", "-s", "16", "-a", "500", "-P", "1000"),
            "consume_rate",
            "msg/s",
        ),
        Scenario("c", "16 B, publish only", ("-x", "1", "-y", "0", "-s", "16"), "publish_rate", "msg/s"),
        Scenario(
            "d",
            f"16 B, consume only from a pre-filled queue of {prefill:,}",
            ("-x", "0", "-y", "1", "-s", "16", "--prefill", str(prefill)),
            "consume_rate",
            "msg/s",
        ),
        Scenario(
            "e",
            "16 B persistent, durable queue, confirms (window 1000), 1p1c manual ack",
            ("-x", "1", "-y", "1", "-s", "16", "-p", "-c", "1000", "-a", "500", "-P", "1000"),
            "confirm_rate",
            "msg/s",
        ),
        Scenario(
            "f",
            "64 KiB bodies, 1p1c, autoack",
            ("-x", "1", "-y", "1", "-s", "65536"),
            "consume_mib_s",
            "MiB/s",
        ),
        Scenario(
            "g",
            "16 B fan-out: 1 producer, fanout exchange with 10 queues, 10 consumers",
            ("-x", "1", "-y", "1", "-s", "16", "--fanout-queues", "10"),
            "consume_rate",
            "deliveries/s",
        ),
        # Not in issue 3's list: (a) and (b) as most client libraries publish, each message
        # with its own message-id, so consecutive publishes are never one run.
        Scenario(
            "a-ids",
            "(a) with a distinct message-id per message",
            ("-x", "1", "-y", "1", "-s", "16", "--message-ids"),
            "consume_rate",
            "msg/s",
        ),
        Scenario(
            "b-ids",
            "(b) with a distinct message-id per message",
            ("-x", "1", "-y", "1", "-s", "16", "-a", "500", "-P", "1000", "--message-ids"),
            "consume_rate",
            "msg/s",
        ),
        # Issue 13: the workloads users run (benchmarks/workloads.py).
        Scenario("1", "every message different: 200 B-2 KiB, message-id, timestamp, 3 headers; 1p1c autoack",
                 ("varied",), "consume_rate", "msg/s", "workload"),
        Scenario("2", "(1) with 4 producers and 4 consumers on 4 queues", ("varied", "--pairs", "4"),
                 "consume_rate", "msg/s", "workload"),
        Scenario("3", "(1) into a topic exchange with 50 bound queues, routing keys in turn, one consumer "
                 "each (one connection)", ("varied", "--topic", "50"), "consume_rate", "deliveries/s",
                 "workload"),
        Scenario("4", "(1) persistent, durable queue, confirms (window 1000), manual ack, prefetch 100",
                 ("varied", "--persistent", "--confirm", "1000", "--prefetch", "100"), "consume_rate",
                 "msg/s", "workload"),
        *(Scenario(f"5-{mode}-{rate // 1000}k-{label}",
                   f"latency {label} at {rate:,} msg/s, " + ("manual ack (prefetch 100)" if mode == "ack"
                                                             else "autoack"),
                   ("latency", "--rate", str(rate), *(("--ack",) if mode == "ack" else ())), metric,
                   "ms (lower is better)", "workload")
          for mode in ("auto", "ack") for rate in (5000, 20000)
          for label, metric in (("p50", "p50_ms"), ("p99", "p99_ms"), ("p99.9", "p999_ms"))),
        Scenario("6", "synchronous pika publisher, confirm per message, persistent, into a backlogged "
                 "durable queue with a consumer", ("sync",), "publish_rate", "msg/s", "workload"),
        Scenario("6-transient", "(6) with transient messages", ("sync", "--transient"), "publish_rate",
                 "msg/s", "workload"),
        Scenario("6-celery", "(6) as Celery's task.delay() with confirm_publish", ("celery",), "publish_rate",
                 "msg/s", "workload"),
        *(Scenario(f"7-{key}", title, ("queues",), metric, unit, "workload")
          for key, title, metric, unit in (
              ("cold", "1,000 new queues, a producer and a consumer connection each: until the first "
               "message into every one was delivered", "cold_s", "s (lower is better)"),
              ("cold-p50", "(7) median latency of those first messages", "cold_p50_ms",
               "ms (lower is better)"),
              ("stall", "(7) worst latency of a bystander on a warm queue (1 msg/ms) meanwhile",
               "bystander_max_ms", "ms (lower is better)"),
              ("warm", "(7) then 100 more per queue, all at once", "warm_rate", "msg/s"))),
        Scenario("8-fill", f"{rss_count:,} persistent 1 KiB messages into a durable queue, confirms "
                 "(window 1000): fill rate", ("rss", "--count", str(rss_count)), "fill_rate", "msg/s",
                 "workload", 1),
        Scenario("8-rss", f"(8) broker memory with {rss_count:,} messages queued (anonymous RSS; mapped "
                 "segment pages not counted)", ("rss", "--count", str(rss_count)), "rss_anon_mib",
                 "MiB (lower is better)", "workload", 1),
    ]
    return {s.key: s for s in items}


def run_perf(uri: str, scenario: Scenario, seconds: float, prefill: int, pid: int = 0) -> dict[str, Any]:
    if scenario.tool == "workload":
        cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "workloads.py"), *scenario.args, "--uri", uri,
               "-z", f"{seconds:g}", "--pid", str(pid)]
    else:
        cmd = [sys.executable, "-m", "broker.perf", "throughput", "--uri", uri, "-z", f"{seconds:g}",
               *scenario.args, "-j"]
    budget = seconds * 3 + 60 + (prefill / 20000 if "--prefill" in scenario.args else 0)
    if scenario.args[0] == "rss":
        budget += 1800
    elif scenario.args[0] == "queues":
        budget += 240
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=budget, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {budget:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def machine() -> dict[str, str]:
    info = {
        "nproc": str(os.cpu_count()),
        "python": platform.python_version() + " " + platform.python_implementation(),
        "os": f"{platform.system()} {platform.release()}",
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["memory"] = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                    break
    except OSError:
        pass
    return info


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "MiB/s":
        return f"{value:,.1f}"
    if unit.split()[0] in ("ms", "s"):
        return f"{value:,.2f}"
    if unit.split()[0] == "MiB":
        return f"{value:,.0f}"
    return f"{value:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skred", required=True, help="Skred AMQP URL")
    ap.add_argument("--peer", default="", help="peer broker AMQP URL (e.g. a RabbitMQ), measured alternately")
    ap.add_argument("--peer-name", default="", help="label for the peer (default: its product name)")
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario and broker (default 3)")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each run (default 5)")
    ap.add_argument("--only", default="", help="comma-separated scenarios, e.g. a,b,f (default all)")
    ap.add_argument("--prefill", type=int, default=1_000_000, help="queue depth for scenario d")
    ap.add_argument("--rss-count", type=int, default=1_000_000, help="messages queued for scenario 8")
    ap.add_argument("--skred-pid", type=int, default=0, help="Skred's pid: broker CPU per message, RSS")
    ap.add_argument("--peer-pid", type=int, default=0, help="the peer's pid (RabbitMQ: beam.smp)")
    ap.add_argument("--write", action="store_true", help="write the results to docs/benchmarks.md")
    ap.add_argument("--note", default="", help="a paragraph for docs/benchmarks.md (who shared the machine)")
    ap.add_argument("--output", default=str(REPO_ROOT / "docs" / "benchmarks.md"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    all_scenarios = scenarios(args.prefill, args.rss_count)
    keys = [k.strip() for k in args.only.split(",") if k.strip()] or list(all_scenarios)
    unknown = [k for k in keys if k not in all_scenarios]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {','.join(all_scenarios)}")
    targets = [("skred", args.skred, args.skred_pid)]
    if args.peer:
        targets.append(("peer", args.peer, args.peer_pid))
    values: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    broker_cpu: dict[tuple[str, str], list[float]] = {}  # broker CPU us per message
    loads: dict[str, list[float]] = {}  # 1-minute load average at the start of each run
    versions: dict[str, str] = {}
    errors: list[str] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start = os.getloadavg()

    done: dict[tuple[str, tuple[str, ...], int], dict[str, Any]] = {}  # one run serves p50/p99/p99.9
    for key in keys:
        sc = all_scenarios[key]
        for run in range(sc.runs or args.runs):
            for name, uri, pid in targets:  # alternate brokers run by run
                loads.setdefault(key, []).append(os.getloadavg()[0])
                r = done.get((name, sc.args, run))
                if r is None:
                    r = done[(name, sc.args, run)] = run_perf(uri, sc, args.seconds, args.prefill, pid)
                if "error" in r or r.get("errors"):
                    msg = r.get("error") or "; ".join(r["errors"])
                    errors.append(f"({key}) {name} run {run + 1}: {msg}")
                    print(f"  ({key}) {name:5} run {run + 1}: ERROR {msg}", file=sys.stderr)
                    continue
                value = float(r.get(sc.metric, 0.0))
                values.setdefault((key, name), []).append(value)
                cpu.setdefault((key, name), []).append(float(r.get("tool_cpu_percent", 0.0)))
                if "cpu_us_per_msg" in r:
                    broker_cpu.setdefault((key, name), []).append(float(r["cpu_us_per_msg"]))
                server = r.get("server", {})
                versions[name] = f"{server.get('product', '?')} {server.get('version', '?')}".strip()
                print(f"  ({key}) {name:5} run {run + 1}: {fmt(value, sc.unit)} {sc.unit}", file=sys.stderr,
                      flush=True)

    peer_label = args.peer_name or versions.get("peer", "peer").split(" ")[0] or "peer"
    head = ["scenario", "what", "unit", "Skred (median)"]
    if args.peer:
        head += [f"{peer_label} (median)", "Skred / " + peer_label]
    head.append("tool CPU % (skred runs)")
    head.append("broker CPU µs/msg" + (f" (Skred / {peer_label})" if args.peer else ""))
    head.append("load avg (1 min) min-max")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        sc = all_scenarios[key]
        s_vals = values.get((key, "skred"), [])
        s_med = statistics.median(s_vals) if s_vals else None
        row = [key, sc.title, sc.unit, fmt(s_med, sc.unit)]
        if args.peer:
            p_vals = values.get((key, "peer"), [])
            p_med = statistics.median(p_vals) if p_vals else None
            ratio = f"{s_med / p_med:.2f}×" if s_med is not None and p_med else "—"
            row += [fmt(p_med, sc.unit), ratio]
        c_vals = cpu.get((key, "skred"), [])
        row.append(f"{statistics.median(c_vals):.0f}" if c_vals else "—")
        b_meds = [statistics.median(v) if (v := broker_cpu.get((key, name))) else None
                  for name in (("skred", "peer") if args.peer else ("skred",))]
        row.append(" / ".join("—" if m is None else f"{m:.1f}" for m in b_meds)
                   if any(m is not None for m in b_meds) else "—")
        ld = loads.get(key, [])
        row.append(f"{min(ld):.1f}-{max(ld):.1f}" if ld else "—")
        rows.append("| " + " | ".join(row) + " |")
    table = "\n".join(rows)
    print(table)
    for err in errors:
        print(f"error: {err}")

    if args.write:
        m = machine()
        lines = [
            "# Benchmarks",
            "",
            "Written by `benchmarks/run.py` — do not edit by hand; rerun it instead.",
            "",
            f"Run: {started}; {args.runs} runs per broker per scenario, {args.seconds:g} s each, "
            "brokers measured alternately; the table shows medians. Load generator: `skred-perf` "
            "(one process per client; its own CPU use is in the column 'tool CPU', % of one core) and "
            "`benchmarks/workloads.py` for the issue-13 workloads (8 runs once per broker). Load average "
            "(1/5/15 min) at the "
            f"start {'/'.join(f'{x:.1f}' for x in load_start)}, at the end "
            f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}.",
            "",
            *([args.note, ""] if args.note else []),
            "## Machine",
            "",
            *(f"- {k}: {v}" for k, v in m.items()),
            *(f"- {name} broker: {v}" for name, v in versions.items()),
            "",
            "## Results",
            "",
            table,
            "",
        ]
        if errors:
            lines += ["## Errors", "", *(f"- {e}" for e in errors), ""]
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines))
        print(f"wrote {out}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
