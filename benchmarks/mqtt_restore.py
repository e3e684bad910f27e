#!/usr/bin/env python3
"""A restart with many persistent MQTT sessions: this checkout against another, same run (issue 28).

Makes (once, with this checkout's broker) a data dir of ``--sessions`` persistent MQTT 3.1.1
sessions with one QoS 1 subscription each (``benchmarks/mqtt.make_sessions``), copies it for
each checkout and worker count, then restarts each copy ``--rounds`` times, the checkouts
alternately (the first round a warm-up: a data dir's first start with a new worker count
moves its shards), and prints, per restart and as medians: the wall time until the MQTT port
accepts and the CPU seconds of the broker's processes until then, by process (the parent,
the busiest worker: the owner of the sessions' vhost). With workers the path to the first
resumed session is the parent's CPU before it forks, then the owner's: ``critical`` is their
sum. On a loaded machine read the CPU, not the wall time.

    python benchmarks/mqtt_restore.py --other ../main-checkout --sessions 10000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.mqtt import Skred, make_sessions, tree  # noqa: E402
from benchmarks.mqtt_sessions import cpu_ms  # noqa: E402
from tests.integration._support import SkredProcess  # noqa: E402


def _broker(data: Path, repo: Path, workers: str) -> Skred:
    b = Skred(data.parent)
    b.p = SkredProcess(data, ["--workers", workers])
    b.p.extra_env["PYTHONPATH"] = str(repo)
    return b


def restart(data: Path, repo: Path, workers: str) -> tuple[float, float, float, float]:
    """One restart: (wall until MQTT accepts, parent CPU, busiest worker's CPU, all CPU)."""
    b = _broker(data, repo, workers)
    t0 = time.perf_counter()
    b.start()
    wall = time.perf_counter() - t0
    root = b.pids()[0]
    cpu = {pid: cpu_ms(pid) / 1000 for pid in tree([root])}
    b.stop()
    kids = [c for pid, c in cpu.items() if pid != root]
    return wall, cpu[root], max(kids, default=0.0), sum(cpu.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", type=Path, required=True, help="the checkout to compare with (e.g. main's)")
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", nargs="+", default=["1", "2"])
    ap.add_argument("--data", type=Path, help="a data dir of sessions made before (default: make one)")
    args = ap.parse_args()
    repos = {"other": args.other.resolve(), "this": REPO_ROOT}
    for repo in repos.values():  # a start byte-compiles nothing (benchmarks/mqtt.py does the same)
        compileall.compile_dir(str(repo / "broker"), quiet=1)
    root = Path(tempfile.mkdtemp(prefix="mqtt-restore-"))
    try:
        made = args.data
        if made is None:
            made = root / "made" / "data"
            b = _broker(made, REPO_ROOT, args.workers[-1])
            b.start()
            print("sessions made:", asyncio.run(make_sessions(b, args.sessions, 600)), flush=True)
            b.stop()
        results: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
        for r in range(args.rounds + 1):
            for workers in args.workers:
                for name, repo in repos.items():
                    data = root / f"{name}-w{workers}" / "data"
                    if not data.exists():
                        shutil.copytree(made, data, symlinks=True)
                    m = restart(data, repo, workers)
                    print(f"round {r} workers {workers} {name}: wall {m[0]:.2f} s, parent {m[1]:.2f} s, "
                          f"owner {m[2]:.2f} s, all {m[3]:.2f} s CPU, load {os.getloadavg()[0]:.1f}"
                          + (" (warm-up)" if r == 0 else ""), flush=True)
                    if r:
                        results.setdefault((workers, name), []).append(m)
        print("\nworkers | checkout | until MQTT accepts | CPU critical (parent + owner) | parent | owner"
              " | all")
        for (workers, name), ms in sorted(results.items()):
            med = [statistics.median(m[i] for m in ms) for i in range(4)]
            crit = statistics.median(m[1] + (m[2] if workers != "1" else 0) for m in ms)
            print(f"{workers} | {name} | {med[0]:.2f} s | {crit:.2f} s | {med[1]:.2f} s | {med[2]:.2f} s | "
                  f"{med[3]:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
