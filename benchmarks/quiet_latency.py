#!/usr/bin/env python3
"""Issue 31's cells in one run on a quiet machine: Skred against RabbitMQ 3.10, one table.

Meant to be run once, at the end of a session, when nothing else runs on the machine
(``benchmarks/quiet_latency.sh`` runs it with the defaults: about 9 minutes on 2 cores).

Theory of operation: every broker is started first and stays up for the whole run, idle while
another is measured; each cell then runs ``--runs`` times with the brokers taking turns inside
each round, so whatever else the machine does hits them alike, and the table shows the median
of the runs (and, per latency cell, the worst run's maximum: the issue's "no run over 10 ms").

- latency (``benchmarks/latency.py`` cells, each run in a fresh client interpreter): open-loop
  5k and 20k msg/s with varied Celery-like messages, autoack and manual ack of each message:
  p50/p99/p99.9/max; the synchronous pika publisher with confirms, with and without a 2,000
  message backlog: call p50/p99/p99.9/max;
- cold (``workloads.many_queues``): the first message into each of ``--cold-queues`` new
  queues, until all were delivered;
- topic (``workloads.varied --topic 50``): deliveries/s and broker CPU per delivery through a
  topic exchange with 50 queues, Skred with ``--workers 1`` and ``--workers 2``.

``--baseline REV`` adds a Skred built from another commit (``git archive`` into the work
directory; default ``ae1e1ed``, the commit of the issue's 225k topic figure) as a third
column of the topic cells, which makes the topic A/B part of the same run; with
``--baseline-all`` every cell runs on it too (about 3 minutes more). Brokers are configured
through ``SKRED_*`` environment variables, which any commit accepts (an old tree ignores the
options it does not know, such as ``workers``), every listener on a free port.

``--quick`` shrinks every count (one run, one second, 50 cold queues) to check the script
itself in a minute; its numbers mean nothing.

    python benchmarks/quiet_latency.py --work /tmp/quiet            # the real run
    python benchmarks/quiet_latency.py --work /tmp/quiet --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO_ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO_ROOT))

import latency  # noqa: E402  (benchmarks/ is not a package)
from tls_brokers import make_certs, start_rabbitmq  # noqa: E402
from workloads import many_queues, varied  # noqa: E402

from tests.integration._support import amqp_answers, listener_ports_env  # noqa: E402

LATENCY_CELLS = ("auto-5k", "auto-20k", "ack-5k", "ack-20k", "sync-0", "sync-2000")
LATENCY_METRICS = ("p50_ms", "p99_ms", "p999_ms", "max_ms")
READY_S = 300.0
TOPIC_QUEUES = 50


@dataclass
class Node:
    """A broker started here: its name in the table, AMQP URI and PID (for its CPU time)."""

    name: str
    uri: str
    pid: int
    stop: Callable[[], None]


def start_tree(name: str, root: Path, data: Path, workers: int, path: str = "") -> Node:
    """A Skred from the source tree ``root``, every listener on a free port, its log beside
    ``data``; waits until AMQP answers. ``path``: a directory put before ``root`` on its
    PYTHONPATH (an instrument's sitecustomize)."""
    data.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKRED_")}
    env.update(listener_ports_env(), PYTHONPATH=os.pathsep.join(p for p in (path, str(root)) if p),
               SKRED_MAIN_DATA_DIR=str(data), SKRED_AMQP_BIND="127.0.0.1", SKRED_MAIN_WORKERS=str(workers))
    port = int(env["SKRED_AMQP_PORT"])
    with open(data.with_suffix(".log"), "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "broker"], cwd=root, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
                proc.wait(10)

    deadline = time.monotonic() + READY_S
    while not amqp_answers("127.0.0.1", port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"{name} did not start; see {data.with_suffix('.log')}")
        time.sleep(0.2)  # readiness poll with a deadline
    return Node(name, f"amqp://guest:guest@127.0.0.1:{port}/", proc.pid, stop)


def export(rev: str, dest: Path) -> Path:
    """The tree of commit ``rev`` (of this repository) under ``dest``, exported once."""
    if not (dest / "broker").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", rev], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


# (row label, metric) -> column name -> one value per run
Results = dict[tuple[str, str], dict[str, list[float]]]


def _note(results: Results, row: str, metric: str, column: str, value: float) -> None:
    results.setdefault((row, metric), {}).setdefault(column, []).append(value)


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def latency_cells(results: Results, nodes: list[tuple[str, Node]], cells: list[str], runs: int,
                  seconds: float) -> None:
    for cell in cells:
        for run in range(runs):
            for column, node in nodes:
                r = latency._cell_in_child(node.uri, cell, seconds, node.pid)
                if "error" in r:
                    _say(f"{cell} {column} run {run + 1}: {r['error']}")
                    continue
                for m in LATENCY_METRICS:
                    _note(results, cell, m.removesuffix("_ms").replace("p999", "p99.9") + " ms", column, r[m])
                _say(f"{cell} {column} run {run + 1}: p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} "
                     f"max {r['max_ms']:.2f} ms, load {r['load1']:.1f}")


def cold_cells(results: Results, nodes: list[tuple[str, Node]], runs: int, queues: int) -> None:
    row = f"cold: first message into each of {queues} new queues"
    for run in range(runs):
        for column, node in nodes:
            r = many_queues(node.uri, queues, warm=0)
            _note(results, row, "s until all delivered", column, r["cold_s"])
            _say(f"cold {column} run {run + 1}: {r['cold_s']:.3f} s")


def topic_cells(results: Results, nodes: list[tuple[str, list[str], Node]], runs: int,
                seconds: float) -> None:
    """``nodes``: (column, the rows it belongs to, node)."""
    for run in range(runs):
        for column, rows, node in nodes:
            r = varied(node.uri, seconds, topic=TOPIC_QUEUES,
                       cpu=lambda pid=node.pid: latency.tree_cpu(pid))  # the node and its workers
            for row in rows:
                _note(results, row, "deliveries/s", column, r["consume_rate"])
                if "cpu_us_per_msg" in r:
                    _note(results, row, "broker CPU µs/delivery", column, r["cpu_us_per_msg"])
            _say(f"topic {column} run {run + 1}: {r['consume_rate']:.0f} deliveries/s")


def table(results: Results, columns: list[str]) -> str:
    """One markdown table: medians per column, Skred/RabbitMQ, and whether Skred is at or
    better than RabbitMQ (lower is better but for rates)."""
    head = ["cell", "metric", *columns, "Skred / RabbitMQ", "Skred at or better"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (row, metric), by_column in results.items():
        worst = metric == "max ms"  # the worst run's maximum, not the median's
        med = {c: (max(v) if worst else statistics.median(v)) for c, v in by_column.items() if v}
        cells = [f"{med[c]:,.2f}" + (" (worst run)" if worst else "") if c in med else "—" for c in columns]
        ratio, ok = "—", "—"
        if "Skred" in med and "RabbitMQ" in med and med["RabbitMQ"]:
            ratio = f"{med['Skred'] / med['RabbitMQ']:.2f}"
            higher_better = metric == "deliveries/s"
            s, r = med["Skred"], med["RabbitMQ"]
            ok = "yes" if s == r or (s > r) == higher_better else "no"
        out.append(f"| {row} | {metric} | " + " | ".join(cells) + f" | {ratio} | {ok} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=Path, help="brokers' data, logs and the baseline tree")
    ap.add_argument("--runs", type=int, default=5, help="runs per latency and cold cell (default 5)")
    ap.add_argument("--seconds", type=float, default=2.5, help="seconds per latency run")
    ap.add_argument("--cells", default=",".join(LATENCY_CELLS), help="latency cells (benchmarks/latency.py)")
    ap.add_argument("--cold-queues", type=int, default=1000)
    ap.add_argument("--topic-runs", type=int, default=3)
    ap.add_argument("--topic-seconds", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=2,
                    help="Skred's workers for the latency and cold cells (2: the default on 2 cores)")
    ap.add_argument("--baseline", default="ae1e1ed", metavar="REV",
                    help="also measure Skred at this commit ('' for none)")
    ap.add_argument("--baseline-all", action="store_true",
                    help="the baseline in the latency and cold cells too (default: topic only; +3 min)")
    ap.add_argument("--skip", default="", help="sections to leave out: latency,cold,topic")
    ap.add_argument("--quick", action="store_true", help="tiny counts: checks the script, not the brokers")
    a = ap.parse_args(argv)
    if a.quick:
        a.runs, a.seconds, a.cold_queues, a.topic_runs, a.topic_seconds = 1, 1.0, 50, 1, 1.0
    cells = [c for c in a.cells.split(",") if c]
    unknown = [c for c in cells if c not in latency.CELLS]
    if unknown:
        ap.error(f"unknown cells {unknown}")
    skip = set(a.skip.split(",")) - {""}
    work: Path = a.work
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    certs = make_certs(work / "certs")
    stops: list[Callable[[], None]] = []
    results: Results = {}
    try:
        skred = start_tree("Skred", REPO_ROOT, work / "skred", a.workers)
        stops.append(skred.stop)
        skred1 = skred
        if "topic" not in skip and a.workers != 1:
            skred1 = start_tree("Skred w1", REPO_ROOT, work / "skred-w1", 1)
            stops.append(skred1.stop)
        base: Node | None = None
        base_col = f"Skred@{a.baseline}"
        if a.baseline:
            tree = export(a.baseline, work / f"tree-{a.baseline}")
            base = start_tree(base_col, tree, work / "skred-base", a.workers)
            stops.append(base.stop)
        rabbit = start_rabbitmq(work, *certs)
        stops.append(rabbit.stop)
        rabbit.wait_ready(READY_S)
        rmq = Node("RabbitMQ", rabbit.plain_uri, rabbit.pid, rabbit.stop)
        _say(f"brokers up after {time.monotonic() - started:.0f} s")
        pair = [("Skred", skred), *([(base_col, base)] if base and a.baseline_all else []), ("RabbitMQ", rmq)]
        if "latency" not in skip:
            latency_cells(results, pair, cells, a.runs, a.seconds)
        if "cold" not in skip:
            cold_cells(results, pair, a.runs, a.cold_queues)
        if "topic" not in skip:
            r1 = f"topic-{TOPIC_QUEUES}, Skred --workers 1"
            r2 = f"topic-{TOPIC_QUEUES}, Skred --workers {a.workers}"
            topic = [("Skred", [r1], skred1), *([("Skred", [r2], skred)] if a.workers != 1 else []),
                     *([(base_col, [r1, r2], base)] if base else []), ("RabbitMQ", [r1, r2], rmq)]
            topic_cells(results, topic, a.topic_runs, a.topic_seconds)
    finally:
        for stop in reversed(stops):
            stop()
    columns = ["Skred", *([base_col] if a.baseline else []), "RabbitMQ"]
    print(f"\nSkred at {_head()} with --workers {a.workers} (topic rows as named); "
          f"{a.runs} runs per latency/cold cell, {a.topic_runs} per topic cell; medians; "
          f"load average at the end {os.getloadavg()[0]:.1f}; {time.monotonic() - started:.0f} s in all\n")
    print(table(results, columns))
    if a.baseline:
        print(f"\n{base_col}: the same options through the environment (a tree that has no "
              f"`workers` option runs one process); in the topic rows it ran once per round.")
    return 0


def _head() -> str:
    r = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
