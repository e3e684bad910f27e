#!/usr/bin/env python3
"""Many queues (issue 31): memory after 1,000 queues were used and deleted, and cold queues.

``memory``: a private Skred whose processes trace their Python heap (``tracemalloc``, started by
a ``sitecustomize`` this script puts first on the broker's PYTHONPATH; the broker has no hook of
its own). On SIGUSR2 each process collects garbage and dumps a snapshot. The script takes one
snapshot of every process of the node when it is idle, runs workload 7 (``workloads.py queues``:
``--queues`` new queues, a producer and a consumer connection each, a first message and ``--warm``
more into each, then every queue deleted and every connection closed), waits ``--settle``
seconds, takes another, and prints per process the anonymous RSS before and after and the
tracebacks whose memory grew most (what a deleted queue left behind). Counts of the Python heap,
not RSS: RSS also holds the allocator's free pages. ``--cycles N`` runs the workload N times on
the one node, with an RSS reading right after each round's deletes, ``--settle`` seconds later
and after each process trimmed its heap (a rise per round is a leak, a plateau is not);
``--durable`` makes the queues durable and the messages persistent; ``--workers`` is the node's.

``cold``: workload 7's cold figure (the first message into each of 1,000 new queues, until all
were delivered) on a private Skred and a private RabbitMQ 3.10 in turn, ``--runs`` times each;
prints the median and range per broker and Skred's ratio to RabbitMQ (a ratio from one run on a
loaded machine means more than either time).

    python benchmarks/latency_queues.py memory --private /tmp/lq
    python benchmarks/latency_queues.py memory --private /tmp/lq --cycles 2 --settle 12 --workers 1
    python benchmarks/latency_queues.py cold --private /tmp/lq --runs 5
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tls_brokers import make_certs, start_rabbitmq, start_skred  # noqa: E402  (benchmarks/ is not a package)
from workloads import many_queues, memory_mib  # noqa: E402

TRACE_ENV = "LATENCY_TRACE_DIR"  # not SKRED_*: the broker reads those as its own options
TRACE_ON = "LATENCY_TRACE"
CLEAR_ON = "LATENCY_CLEAR_TYPE_CACHE"
HOOK = f'''
import ctypes, gc, os, signal, sys, tracemalloc
_dir = os.environ.get("{TRACE_ENV}")
if _dir:
    _taken = [0]
    if os.environ.get("{TRACE_ON}"):
        tracemalloc.start(6)

    def _dump(signum, frame):
        if os.environ.get("{CLEAR_ON}"):  # the type-cache probe: its names let go first
            sys._clear_type_cache()
        gc.collect()
        _taken[0] += 1
        out = os.path.join(_dir, "%d-%d.snap" % (os.getpid(), _taken[0]))
        if tracemalloc.is_tracing():
            tracemalloc.take_snapshot().dump(out)
        else:  # the trim probe: give the allocator's free pages back, its arenas' state, then say so
            ctypes.CDLL(None).malloc_trim(0)
            saved = os.dup(2)
            with open(out + ".stats", "w") as stats:
                os.dup2(stats.fileno(), 2)
                try:
                    sys._debugmallocstats()
                finally:
                    os.dup2(saved, 2)
                    os.close(saved)
            open(out, "w").close()

    signal.signal(signal.SIGUSR2, _dump)
'''


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def snapshots(pids: list[int], trace_dir: Path, n: int,
              timeout: float = 120.0) -> dict[int, tracemalloc.Snapshot | None]:
    """Snapshot ``n`` of every process in ``pids`` (SIGUSR2, then wait for the dumps); without
    tracing, each process trims its heap instead (None)."""
    for p in pids:
        os.kill(p, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    paths = {p: trace_dir / f"{p}-{n}.snap" for p in pids}
    got: dict[int, tracemalloc.Snapshot | None] = {}
    while len(got) < len(pids) and time.monotonic() < deadline:
        for p, path in paths.items():
            if p not in got and path.exists():
                size = path.stat().st_size
                time.sleep(0.5)
                if path.stat().st_size == size:  # written out
                    got[p] = tracemalloc.Snapshot.load(str(path)) if size else None
        time.sleep(0.2)
    return got


def memory(work: Path, queues: int, warm: int, settle: float, top: int, trace: bool,
           cycles: int = 1, durable: bool = False, workers: int = 0) -> int:
    trace_dir = work / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    os.environ[TRACE_ENV] = str(trace_dir)
    if trace:
        os.environ[TRACE_ON] = "1"
    certs = make_certs(work / "certs")
    skred = start_skred(work, *certs, path=hook, extra=("--workers", str(workers)))
    try:
        skred.wait_ready(300)
        time.sleep(settle)
        pids = tree(skred.pid)

        def rss() -> dict[int, float]:
            return {p: memory_mib(p).get("RssAnon", 0.0) for p in pids}

        before = snapshots(pids, trace_dir, 1)  # without tracing: trimmed, the baseline
        columns = [("idle" + ("" if trace else " (trimmed)"), rss())]
        after = before
        for c in range(1, cycles + 1):
            r = many_queues(skred.plain_uri, queues, warm, durable=durable)
            columns.append((f"cycle {c}: deleted", rss()))
            time.sleep(settle)
            columns.append((f"+{settle:g} s", rss()))
            after = snapshots(pids, trace_dir, c + 1)
            if not trace:  # each process trimmed its heap: what the allocator kept, not the broker
                columns.append(("malloc_trim(0)", rss()))
            print(f"cycle {c}, workload 7 ({queues} {'durable ' if durable else ''}queues): cold "
                  f"{r['cold_s']:.2f} s, warm {r['warm_rate']:.0f} msg/s, "
                  f"load average {os.getloadavg()[0]:.1f}")
        print("RssAnon MiB per process: " + " -> ".join(name for name, _ in columns))
        for p in pids:
            print(f"  pid {p}: " + " -> ".join(f"{m[p]:.1f}" for _, m in columns))
        print("  all: " + " -> ".join(f"{sum(m.values()):.1f}" for _, m in columns))
        for p in pids if trace else []:
            b, a = before.get(p), after.get(p)
            if b is None or a is None:
                print(f"pid {p}: no snapshot")
                continue
            heap_b = sum(s.size for s in b.statistics("filename"))
            heap_a = sum(s.size for s in a.statistics("filename"))
            print(f"\npid {p}: traced heap {heap_b / 2**20:.2f} -> {heap_a / 2**20:.2f} MiB")
            for st in a.compare_to(b, "traceback")[:top]:
                if st.size_diff <= 0:
                    break
                print(f"  +{st.size_diff / 1024:.1f} KiB in {st.count_diff:+d} blocks")
                for line in st.traceback.format(limit=6, most_recent_first=True):
                    print("     " + line)
    finally:
        skred.stop()
    return 0


def cold(work: Path, runs: int) -> int:
    certs = make_certs(work / "certs")
    brokers = [start_skred(work, *certs), start_rabbitmq(work, *certs)]
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for b in brokers:
            b.wait_ready(300)
        for run in range(runs):
            for b in brokers:
                r = many_queues(b.plain_uri, 1000, warm=0)
                r["load1"] = os.getloadavg()[0]
                results.setdefault(b.name, []).append(r)
                print(f"  run {run + 1} {b.name}: cold {r['cold_s']:.3f} s, p50 {r['cold_p50_ms']:.1f} ms, "
                      f"bystander max {r['bystander_max_ms']:.1f} ms, load {r['load1']:.1f}",
                      file=sys.stderr, flush=True)
    finally:
        for b in brokers:
            b.stop()
    print("| broker | runs | cold s | first-message p50 ms | bystander max ms | load |")
    print("|---|---|---|---|---|---|")
    for name, rs in results.items():
        cells = []
        for key in ("cold_s", "cold_p50_ms", "bystander_max_ms"):
            xs = [float(r[key]) for r in rs]
            cells.append(f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]")
        loads = [r["load1"] for r in rs]
        print(f"| {name} | {len(rs)} | " + " | ".join(cells) + f" | {min(loads):.1f}-{max(loads):.1f} |")
    pairs = [a["cold_s"] / b["cold_s"] for a, b in zip(results["Skred"], results["RabbitMQ"], strict=False)]
    if pairs:
        print(f"\nSkred / RabbitMQ cold, per pair of runs: median {statistics.median(pairs):.2f} "
              f"[{min(pairs):.2f}-{max(pairs):.2f}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("memory", "cold"))
    ap.add_argument("--private", required=True, metavar="DIR", help="brokers' data, logs and snapshots here")
    ap.add_argument("--runs", type=int, default=5, help="cold: runs per broker")
    ap.add_argument("--queues", type=int, default=1000, help="memory: queues used and deleted")
    ap.add_argument("--warm", type=int, default=10, help="memory: messages per queue after the first")
    ap.add_argument("--settle", type=float, default=5.0, help="memory: seconds idle before each snapshot")
    ap.add_argument("--trace", action="store_true",
                    help="memory: trace the Python heap and print what grew (RSS then includes tracing)")
    ap.add_argument("--top", type=int, default=25, help="memory: tracebacks to print per process")
    ap.add_argument("--cycles", type=int, default=1,
                    help="memory: rounds of the workload (RSS growing per round is a leak, a plateau is not)")
    ap.add_argument("--durable", action="store_true", help="memory: durable queues, persistent messages")
    ap.add_argument("--workers", type=int, default=0, help="memory: the node's --workers (0: one per core)")
    a = ap.parse_args(argv)
    work = Path(a.private)
    work.mkdir(parents=True, exist_ok=True)
    if a.what == "memory":
        return memory(work, a.queues, a.warm, a.settle, a.top, a.trace, a.cycles, a.durable, a.workers)
    return cold(work, a.runs)


if __name__ == "__main__":
    sys.exit(main())
