#!/usr/bin/env python3
"""What stalls Skred's event loop during issue 31's latency cells, this tree against a baseline
commit and RabbitMQ 3.10 in one run.

Theory of operation: both Skreds (this tree and ``--baseline REV``, exported with ``git
archive``) run with an instrument: a ``sitecustomize`` put first on their PYTHONPATH (the
broker has no hook of its own) that (1) ticks on the event loop every millisecond and logs
every tick that came more than ``LAG_MS`` late, with the loop thread's CPU time over the
gap (a gap with little CPU was the loop blocked in the kernel or not scheduled; one with
CPU was Python work); (2) logs every ``posix_fallocate``, ``unlink``, ``rename``, ``ftruncate``,
``rmdir`` and file-creating ``open`` the loop thread itself makes, with its wall time: the system calls
that can wait for the filesystem's journal while the group commit's thread is inside an
fdatasync. Each cell of ``benchmarks/latency.py`` (or ``cold``: workload 7's first message into
each of ``--cold-queues`` new queues, ``workloads.many_queues``; ``cold-durable``: durable
queues, persistent messages and manual-ack consumers, so every first message is stored;
``delete``: ``--cold-queues`` durable queues holding 20 stored messages each deleted at once,
``workloads.delete_queues``, with the broker's RSS growth from before they were made) then
runs ``--runs`` times with the brokers in turn (RabbitMQ uninstrumented); after each run the
instrument's lines of that run are counted. The table shows medians per broker: the cell's p99
and the worst run's maximum, loop gaps over 5 and 10 ms, and the loop's journal calls (count,
and the worst wall time). On a loaded machine the gaps are mostly the scheduler's; the journal
calls' count is not.

    python benchmarks/latency_stalls.py --work /tmp/stalls --baseline 4f4ff3c
    python benchmarks/latency_stalls.py --work /tmp/stalls --baseline 336eb40 --cells cold-durable
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO_ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO_ROOT))

import latency  # noqa: E402  (benchmarks/ is not a package)
from quiet_latency import Node, export, start_tree  # noqa: E402
from tls_brokers import make_certs, start_rabbitmq  # noqa: E402
from workloads import delete_queues, many_queues, memory_mib  # noqa: E402

LOG_ENV = "LATENCY_STALLS_DIR"  # not SKRED_*: the broker reads those as its own options
LAG_MS = 2.0
HOOK = f'''
import os, threading, time
_dir = os.environ.get("{LOG_ENV}")
if _dir:
    import uvloop

    def _log(line):
        with open(os.path.join(_dir, "%d.log" % os.getpid()), "a") as f:
            f.write(line)

    _loop_thread = []

    def _timed(name, call):
        def timed(*args, **kwargs):
            if not _loop_thread or threading.current_thread() is not _loop_thread[0]:
                return call(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                _log("%.4f call %s %.3f\\n" % (time.monotonic(), name, (time.perf_counter() - t0) * 1e3))
        return timed

    for _name in ("posix_fallocate", "unlink", "rename", "ftruncate", "rmdir"):
        setattr(os, _name, _timed(_name, getattr(os, _name)))
    _plain_open = os.open
    _creating_open = _timed("open-create", _plain_open)

    def _open(path, flags, *args, **kwargs):
        return (_creating_open if flags & os.O_CREAT else _plain_open)(path, flags, *args, **kwargs)

    os.open = _open

    def _factory():
        loop = uvloop.new_event_loop()
        last = [0.0, 0.0]

        def tick():
            now, cpu = time.monotonic(), time.thread_time()
            if last[0] and (now - last[0]) * 1e3 > {LAG_MS}:
                _log("%.4f gap %.3f %.3f\\n" % (now, (now - last[0]) * 1e3, (cpu - last[1]) * 1e3))
            last[0], last[1] = time.monotonic(), time.thread_time()
            loop.call_later(0.001, tick)

        _loop_thread[:] = [threading.current_thread()]
        loop.call_soon(tick)
        return loop

    _run = uvloop.run

    def _instrumented_run(main, **kwargs):
        kwargs["loop_factory"] = _factory
        return _run(main, **kwargs)

    uvloop.run = _instrumented_run
'''


def _lines(log_dir: Path, offsets: dict[Path, int]) -> list[list[str]]:
    """The instrument's lines written since ``offsets`` (updated), split."""
    out: list[list[str]] = []
    for path in sorted(log_dir.glob("*.log")):
        with open(path) as f:
            f.seek(offsets.get(path, 0))
            out += [line.split() for line in f if line.endswith("\n")]
            offsets[path] = f.tell()
    return out


def _tree_rss(pid: int) -> float:
    """VmRSS (MiB) of ``pid`` and its descendants (with ``--workers`` the vhosts live in children)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += memory_mib(p).get("VmRSS", 0.0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return total


def _stalls(lines: list[list[str]]) -> dict[str, float]:
    gaps = [float(p[2]) for p in lines if p[1] == "gap"]
    calls = [float(p[3]) for p in lines if p[1] == "call"]
    return {"loop gaps > 5 ms": sum(g > 5 for g in gaps), "loop gaps > 10 ms": sum(g > 10 for g in gaps),
            "journal calls on the loop": len(calls), "worst journal call ms": max(calls, default=0.0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=Path, help="brokers' data, logs and the baseline tree")
    ap.add_argument("--baseline", default="4f4ff3c", metavar="REV", help="the Skred to compare with")
    ap.add_argument("--cells", default="ack-5k,ack-20k", help="benchmarks/latency.py cells")
    ap.add_argument("--runs", type=int, default=3, help="runs per cell and broker (default 3)")
    ap.add_argument("--seconds", type=float, default=2.5, help="seconds per run")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-rabbitmq", action="store_true")
    ap.add_argument("--cold-queues", type=int, default=1000, help="new queues per run of the cold cell")
    a = ap.parse_args(argv)
    work: Path = a.work
    work.mkdir(parents=True, exist_ok=True)
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    trees = [("Skred", REPO_ROOT), (f"Skred@{a.baseline}", export(a.baseline, work / "baseline"))]
    nodes: list[tuple[str, Node, Path | None]] = []
    try:
        for name, root in trees:
            logs = work / f"stalls-{len(nodes)}"
            logs.mkdir(exist_ok=True)
            os.environ[LOG_ENV] = str(logs)  # the broker's environment is this one's
            node = start_tree(name, root, work / f"skred-{len(nodes)}", a.workers, str(hook))
            nodes.append((name, node, logs))
        os.environ.pop(LOG_ENV, None)
        rabbit = None
        if not a.no_rabbitmq:
            rabbit = start_rabbitmq(work, *make_certs(work / "certs"))
            rabbit.wait_ready(300)
            nodes.append(("RabbitMQ", Node("RabbitMQ", rabbit.plain_uri, 0, rabbit.stop), None))
        results: dict[tuple[str, str], dict[str, list[float]]] = {}
        offsets: dict[Path, int] = {}
        for cell in a.cells.split(","):
            for run in range(a.runs):
                for name, node, logs in nodes:
                    if logs is not None:
                        _lines(logs, offsets)  # skip what came before this run
                    if cell in ("cold", "cold-durable"):
                        r = many_queues(node.uri, a.cold_queues, warm=0, durable=cell == "cold-durable")
                        r["load1"] = os.getloadavg()[0]
                        found = {"until all delivered s": r["cold_s"],
                                 "first-message p50 ms": r["cold_p50_ms"],
                                 "max bystander ms": r["bystander_max_ms"]}
                    elif cell == "delete":
                        before = _tree_rss(node.pid) if node.pid else 0.0
                        r = delete_queues(node.uri, a.cold_queues)
                        r["load1"] = os.getloadavg()[0]
                        found = {"all deleted s": r["delete_s"], "max bystander ms": r["bystander_max_ms"]}
                        if node.pid:
                            found["RSS growth MiB"] = _tree_rss(node.pid) - before
                    else:
                        r = latency._cell_in_child(node.uri, cell, a.seconds, node.pid)
                        if "error" in r:
                            print(f"{cell} {name} run {run + 1}: {r['error']}", file=sys.stderr)
                            continue
                        found = {"p99 ms": r["p99_ms"], "max ms": r["max_ms"]}
                    if logs is not None:
                        found.update(_stalls(_lines(logs, offsets)))
                    for metric, value in found.items():
                        results.setdefault((cell, metric), {}).setdefault(name, []).append(value)
                    print(f"[{time.strftime('%H:%M:%S')}] {cell} {name} run {run + 1}: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in found.items())
                          + f", load {r['load1']:.1f}", file=sys.stderr, flush=True)
    finally:
        for _name, node, _logs in reversed(nodes):
            node.stop()
    names = [n for n, _node, _logs in nodes]
    print("| cell | metric | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 2))
    for (cell, metric), by in results.items():
        worst = metric.startswith("max") or metric.startswith("worst")
        vals = [(max(by[n]) if worst else statistics.median(by[n])) if by.get(n) else None for n in names]
        print(f"| {cell} | {metric}{' (worst run)' if worst else ' (median)'} | "
              + " | ".join("—" if v is None else f"{v:,.2f}" for v in vals) + " |")
    print(f"\nSkred at this tree and at {a.baseline}, --workers {a.workers}, both instrumented (a 1 ms "
          f"tick on the loop); {a.runs} runs of {a.seconds} s per cell, brokers in turn; load average "
          f"at the end {os.getloadavg()[0]:.1f}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
