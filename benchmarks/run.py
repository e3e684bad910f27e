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
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
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
    # "perf": skred-perf throughput; "workload": benchmarks/workloads.py; "latency":
    # benchmarks/latency.py (args: its cell)
    tool: str = "perf"
    runs: int = 0  # runs per broker when not --runs (0: --runs)
    # at least this many runs: a latency percentile of one run moves with the few stalls the
    # machine itself gives a client process (see the 5-floor-* rows)
    min_runs: int = 0


@dataclass
class Target:
    """One broker under test; ``broker`` when run.py started it (``--private``), so that
    workload 8 can restart it (which changes ``uri`` and ``pid``)."""

    name: str
    uri: str
    pid: int
    broker: Any = field(default=None)


def scenarios(prefill: int, rss_count: int = 1_000_000, rss_drain: int = 300_000) -> dict[str, Scenario]:
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
        # Issue 31: measured as an outside generator does (benchmarks/latency.py: open loop from
        # the intended send time, Celery-like 200 B-2 KiB messages, an ack frame per message).
        *(Scenario(f"5-{mode}-{rate // 1000}k-{label}",
                   f"latency {label} at {rate:,} msg/s, open loop, 200 B-2 KiB, "
                   + ("manual ack of each message (prefetch 100)" if mode == "ack" else "autoack"),
                   (f"{mode}-{rate // 1000}k",), metric, "ms (lower is better)", "latency", min_runs=5)
          for mode in ("auto", "ack") for rate in (5000, 20000)
          for label, metric in (("p50", "p50_ms"), ("p99", "p99_ms"), ("p99.9", "p999_ms"),
                                ("max", "max_ms"))),
        *(Scenario(f"5-sync-{backlog}-{label}",
                   f"synchronous pika publisher, confirms, persistent, live consumer, backlog {backlog:,}: "
                   f"call time {label}", (f"sync-{backlog}",), metric, "ms (lower is better)", "latency",
                   min_runs=5)
          for backlog in (0, 2000) for label, metric in (("p50", "p50_ms"), ("p99", "p99_ms"))),
        # The floor of the latency clients these rows used before issue 31 (workloads.py
        # latency: closed loop, one 64-byte message, one ack per read): the two client processes
        # with no broker between them (the producer writes the deliveries). Measured in each
        # broker's turn, so its two columns show how much the floor itself moves between turns.
        *(Scenario(f"5-floor-{rate // 1000}k-{label}",
                   f"(5) floor: no broker, the latency clients connected directly, manual ack, "
                   f"{rate:,} msg/s, {label}, measured in each broker's turn",
                   ("latency", "--direct", "--ack", "--rate", str(rate)), metric, "ms (lower is better)",
                   "workload", min_runs=5)
          for rate in (5000, 20000)
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
        *(Scenario(key, title.replace("{n}", f"{rss_count:,}"), ("rss", "--count", str(rss_count)), metric,
                   unit, "workload", 1)
          for key, title, metric, unit in (
              ("8-fill", "{n} persistent 1 KiB messages into a durable queue, confirms (window 1000): "
               "fill rate (the fill stops after --rss-cap s or a 2-minute stall)", "fill_rate", "msg/s"),
              ("8-queued", "(8) messages confirmed into the queue", "messages", "messages"),
              ("8-rss", "(8) broker memory with them queued (anonymous RSS; mapped segment pages not "
               "counted)", "rss_anon_mib", "MiB (lower is better)"),
              ("8-vmrss", "(8) the same as VmRSS (mapped segment pages counted)", "rss_mib",
               "MiB (lower is better)"),
              ("8-stop", "(8) clean stop with that backlog (SIGTERM until the process exited; private "
               "brokers)", "stop_s", "s (lower is better)"),
              ("8-restart", "(8) restart with that backlog: from starting the process to the queue "
               "answering with its depth", "restart_s", "s (lower is better)"),
              ("8-rss-restart", "(8) broker memory right after that restart", "restart_rss_anon_mib",
               "MiB (lower is better)"),
              ("8-drain", f"(8) then a consumer drains {rss_drain:,} of them: manual ack, prefetch 1000",
               "drain_rate", "msg/s"),
              ("8-drain-slowest", "(8) the slowest tenth of that drain (steady if close to the rate)",
               "drain_tenth_min", "msg/s"),
              ("8-rss-drain", "(8) highest broker memory while draining", "drain_rss_anon_mib",
               "MiB (lower is better)"))),
    ]
    return {s.key: s for s in items}


def run_perf(uri: str, scenario: Scenario, seconds: float, prefill: int, pid: int = 0,
             budget: float = 0) -> dict[str, Any]:
    if scenario.tool == "latency":
        cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "latency.py"), "--uri", uri, "--cell",
               scenario.args[0], "-z", f"{seconds:g}", "--pid", str(pid)]
    elif scenario.tool == "workload":
        cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "workloads.py"), *scenario.args, "--uri", uri,
               "-z", f"{seconds:g}", "--pid", str(pid)]
    else:
        cmd = [sys.executable, "-m", "broker.perf", "throughput", "--uri", uri, "-z", f"{seconds:g}",
               *scenario.args, "-j"]
    budget = budget or seconds * 3 + 60 + (prefill / 20000 if "--prefill" in scenario.args else 0)
    if scenario.args[0] == "rss" and "--cap" not in scenario.args:
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


def run_rss(target: Target, scenario: Scenario, drain: int, cap: float) -> dict[str, Any]:
    """Workload 8 on one broker: fill (``workloads.py rss --keep``); if ``target`` holds a
    broker we started, restart it and time the recovery of the backlog, then drain ``drain``
    messages (``workloads.py drain``, which deletes the queue). The restarted broker replaces
    the one in ``target``."""
    fill = run_perf(target.uri, Scenario(scenario.key, scenario.title, (*scenario.args, "--keep", "--cap",
                                                                        f"{cap:g}"), scenario.metric,
                                         scenario.unit, scenario.tool), 0, 0, target.pid, budget=cap + 900)
    if "error" in fill:
        return fill
    queue = str(fill["queue"])
    result = dict(fill)
    if target.broker is not None:
        from workloads import memory_mib, passive_depth

        stopping = time.monotonic()
        target.broker.stop(timeout=900)  # a clean shutdown, however long it takes
        started = time.monotonic()
        result["stop_s"] = started - stopping
        broker = target.broker = target.broker.relaunch() if target.broker.relaunch else None
        assert broker is not None
        target.uri = broker.plain_uri
        while True:
            if broker.proc.poll() is not None:
                return {**result, "error": f"{broker.name} exited with {broker.proc.returncode} on restart"}
            if time.monotonic() - started > 1800:
                return {**result, "error": f"{broker.name} not back with the queue after 1800 s"}
            try:
                result["restart_depth"] = passive_depth(target.uri, queue)
                break
            except (OSError, TimeoutError, EOFError, asyncio.IncompleteReadError):
                time.sleep(0.2)
        result["restart_s"] = time.monotonic() - started
        target.pid = broker.pid  # RabbitMQ: its Erlang VM
        mem = memory_mib(target.pid)
        result["restart_rss_mib"] = mem.get("VmRSS", 0.0)
        result["restart_rss_anon_mib"] = mem.get("RssAnon", 0.0)
    cmd = ["drain", "--queue", queue, "--count", str(drain), "--cap", "600"]
    drained = run_perf(target.uri, Scenario(scenario.key, scenario.title, tuple(cmd), "drain_rate", "msg/s",
                                            "workload"), 0, 0, target.pid, budget=600 + 960)
    if "error" in drained:
        return {**result, "error": f"drain: {drained['error']}"}
    return {**result, **{k: v for k, v in drained.items() if k != "server"}}


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


def _sections(text: str) -> tuple[str, dict[str, list[str]]]:
    """The text before the first ``## `` heading, and each ``## `` section's lines by heading."""
    head, _, rest = text.partition("\n## ")
    sections: dict[str, list[str]] = {}
    for chunk in rest.split("\n## ") if rest else []:
        title, *body = chunk.split("\n")
        sections[title.strip()] = body
    return head, sections


def merge_results(old: str, rows: list[str], rerun: str, errors: list[str]) -> str:
    """``old`` (a docs/benchmarks.md) with the scenario rows of ``rows`` (this run's table:
    header, separator, rows) replacing its rows of the same scenarios; new scenarios go after
    their predecessor in ``rows``' order (or at the end). Other rows, the machine description and
    other sections stay. ``rerun`` is noted under "Partial reruns" (replacing notes of earlier
    reruns of a subset of these scenarios); errors of these scenarios are replaced by ``errors``."""
    head, sections = _sections(old)
    table = [line for line in sections.get("Results", []) if line.startswith("|")]
    if not table or table[0] != rows[0]:
        raise ValueError("docs/benchmarks.md has other columns than this run (a peer or not): "
                         "rerun every scenario to rewrite it")

    def key(line: str) -> str:
        return line.split("|")[1].strip()

    merged = table[2:]
    new = rows[2:]
    keys = [key(r) for r in new]
    prev = ""
    for r in new:
        k = key(r)
        at = [i for i, line in enumerate(merged) if key(line) == k]
        if at:
            merged[at[0]] = r
        else:
            after = [i for i, line in enumerate(merged) if key(line) == prev]
            merged.insert(after[0] + 1 if after else len(merged), r)
        prev = k
    notes = [line for line in sections.get("Partial reruns", []) if line.startswith("- ")
             and not set(line[2:].split(":", 1)[0].split(", ")) <= set(keys)]
    notes.append(f"- {', '.join(keys)}: {rerun}")
    errs = [line for line in sections.get("Errors", []) if line.startswith("- ")
            and line[2:].split(")", 1)[0].lstrip("(") not in keys] + [f"- {e}" for e in errors]
    out = [head.rstrip("\n"), ""]
    for title, body in sections.items():
        if title not in ("Results", "Partial reruns", "Errors"):
            out += [f"## {title}", *body]
    out += ["## Results", "", *table[:2], *merged, "", "## Partial reruns", "", *notes, ""]
    if errs:
        out += ["## Errors", "", *errs, ""]
    return "\n".join(line for line in out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skred", default="", help="Skred AMQP URL (required unless --private)")
    ap.add_argument("--peer", default="", help="peer broker AMQP URL (e.g. a RabbitMQ), measured alternately")
    ap.add_argument("--peer-name", default="", help="label for the peer (default: its product name)")
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario and broker (default 3)")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each run (default 5)")
    ap.add_argument("--only", default="", help="comma-separated scenarios, e.g. a,b,f (default all)")
    ap.add_argument("--prefill", type=int, default=1_000_000, help="queue depth for scenario d")
    ap.add_argument("--rss-count", type=int, default=1_000_000, help="messages queued for scenario 8")
    ap.add_argument("--skred-pid", type=int, default=0, help="Skred's pid: broker CPU per message, RSS")
    ap.add_argument("--peer-pid", type=int, default=0, help="the peer's pid (RabbitMQ: beam.smp)")
    ap.add_argument("--rss-drain", type=int, default=300_000, help="messages scenario 8 drains after filling")
    ap.add_argument("--rss-cap", type=float, default=1200.0, help="scenario 8: stop each fill after N s")
    ap.add_argument("--private", default="", metavar="DIR",
                    help="start a Skred and a RabbitMQ of our own (benchmarks/tls_brokers.py) with their "
                    "data in DIR, measure those (scenario 8 also restarts them) and stop them at the end")
    ap.add_argument("--write", action="store_true", help="write the results to docs/benchmarks.md (with "
                    "--only: replace those scenarios' rows, keep the others)")
    ap.add_argument("--note", default="", help="a paragraph for docs/benchmarks.md (who shared the machine)")
    ap.add_argument("--output", default=str(REPO_ROOT / "docs" / "benchmarks.md"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    all_scenarios = scenarios(args.prefill, args.rss_count, args.rss_drain)
    keys = [k for part in args.only.split(",") if (k0 := part.strip())  # "8": every 8-* scenario
            for k in ([k0] if k0 in all_scenarios else [s for s in all_scenarios if s.startswith(k0 + "-")]
                      or [k0])] or list(all_scenarios)
    unknown = [k for k in keys if k not in all_scenarios]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {','.join(all_scenarios)}")
    if not args.skred and not args.private:
        ap.error("--skred or --private is required")
    if args.private:
        return with_private_brokers(Path(args.private), args,
                                    lambda targets: measure(args, keys, all_scenarios, targets))
    targets = [Target("skred", args.skred, args.skred_pid)]
    if args.peer:
        targets.append(Target("peer", args.peer, args.peer_pid))
    return measure(args, keys, all_scenarios, targets)


def with_private_brokers(work: Path, args: argparse.Namespace, body: Any) -> int:
    """Run ``body(targets)`` against a Skred and a RabbitMQ started here, then stop both."""
    from tls_brokers import make_certs, start_rabbitmq, start_skred

    certs = make_certs(work / "certs")
    brokers = [start_skred(work, *certs)]
    try:
        brokers.append(start_rabbitmq(work, *certs))
        for b in brokers:
            b.wait_ready(300)
        targets = [Target("skred", brokers[0].plain_uri, brokers[0].pid, brokers[0]),
                   Target("peer", brokers[1].plain_uri, brokers[1].pid, brokers[1])]
        args.peer = targets[1].uri
        try:
            return int(body(targets))
        finally:
            brokers = [t.broker for t in targets]  # workload 8 replaced them
    finally:
        for b in brokers:
            b.stop(timeout=900)


def measure(args: argparse.Namespace, keys: list[str], all_scenarios: dict[str, Scenario],
            targets: list[Target]) -> int:
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
        for run in range(sc.runs or max(args.runs, sc.min_runs)):
            for target in targets:  # alternate brokers run by run
                name = target.name
                loads.setdefault(key, []).append(os.getloadavg()[0])
                r = done.get((name, sc.args, run))
                if r is None:
                    r = done[(name, sc.args, run)] = (
                        run_rss(target, sc, args.rss_drain, args.rss_cap) if sc.args[0] == "rss"
                        else run_perf(target.uri, sc, args.seconds, args.prefill, target.pid))
                    if sc.args[0] == "rss":
                        print(f"  ({key}) {name} run {run + 1}: {json.dumps(r)}", file=sys.stderr, flush=True)
                if "error" in r or r.get("errors"):
                    msg = r.get("error") or "; ".join(r["errors"])
                    errors.append(f"({key}) {name} run {run + 1}: {msg}")
                    print(f"  ({key}) {name:5} run {run + 1}: ERROR {msg}", file=sys.stderr)
                    continue
                if sc.metric not in r and sc.tool == "workload":
                    continue  # e.g. no restart time from a broker we did not start
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
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        load = (f"load average (1/5/15 min) at the start {'/'.join(f'{x:.1f}' for x in load_start)}, at the "
                f"end {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
        if args.only and out.exists():  # a partial rerun: replace only these scenarios' rows
            rerun = (f"run {started}; {args.runs} runs per broker per scenario (8: once; 5-*: at least 5), "
                     f"{args.seconds:g} s each; {load}." + (f" {args.note}" if args.note else ""))
            text = merge_results(out.read_text(), rows, rerun, errors)
        else:
            m = machine()
            lines = [
                "# Benchmarks",
                "",
                "Written by `benchmarks/run.py` — do not edit by hand; rerun it instead.",
                "",
                f"Run: {started}; {args.runs} runs per broker per scenario (5-*: at least 5), "
                f"{args.seconds:g} s each, "
                "brokers measured alternately; the table shows medians. Load generator: `skred-perf` "
                "(one process per client; its own CPU use is in the column 'tool CPU', % of one core) and "
                "`benchmarks/workloads.py` for the issue-13 workloads (8 runs once per broker). "
                f"{load[0].upper()}{load[1:]}.",
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
            text = "\n".join(lines)
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
