#!/usr/bin/env python3
"""The group commit's two hand-offs without a disk (issue 31): loop -> fsync thread -> loop.

A confirm waits for the fsync and for two hand-offs around it: the event loop gives the commit
to the syncer's thread, and the thread gives the result back (``call_soon_threadsafe``). This
times that round trip with an empty job, for the syncer's dedicated thread
(``broker/syncer.py`` ``_FsyncThread``: blocked in C on a ``queue.SimpleQueue``) against the
one-worker ``ThreadPoolExecutor`` it replaced and a thread waiting on a ``threading.Condition``
(the first version of the change, slower than the queue: its wait is Python code), in turns
(``--rounds``) within one process on uvloop, so load on the machine hits them alike; prints
the median over rounds of each one's p50 and p99.

    python benchmarks/latency_handoff.py --rounds 5 --trips 3000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from broker.syncer import _FsyncThread  # noqa: E402

Submit = Callable[[Callable[[], None]], object]


class CondThread:
    """A dedicated thread woken by a ``threading.Condition`` (for comparison only)."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.jobs: deque[Callable[[], None] | None] = deque()
        self.thread = threading.Thread(target=self.main, daemon=True)
        self.thread.start()

    def run(self, job: Callable[[], None] | None) -> None:
        with self.cond:
            self.jobs.append(job)
            self.cond.notify()

    def main(self) -> None:
        while True:
            with self.cond:
                while not self.jobs:
                    self.cond.wait()
                job = self.jobs.popleft()
            if job is None:
                return
            job()


async def trips(submit: Submit, n: int) -> tuple[float, float]:
    """p50 and p99 in µs of ``n`` round trips through ``submit``."""
    loop = asyncio.get_running_loop()
    lat: list[int] = []
    for _ in range(n):
        fut: asyncio.Future[None] = loop.create_future()

        def job(fut: asyncio.Future[None] = fut) -> None:
            loop.call_soon_threadsafe(fut.set_result, None)

        t0 = time.perf_counter_ns()
        submit(job)
        await fut
        lat.append(time.perf_counter_ns() - t0)
    lat.sort()
    return lat[len(lat) // 2] / 1e3, lat[len(lat) * 99 // 100] / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trips", type=int, default=3000)
    a = ap.parse_args()
    executor = ThreadPoolExecutor(max_workers=1)
    thread, cond = _FsyncThread("handoff"), CondThread()
    ways: dict[str, Submit] = {"executor (before)": executor.submit, "condition": cond.run,
                               "dedicated thread, SimpleQueue (now)": thread.run}
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    try:
        for _ in range(a.rounds):
            for name, submit in ways.items():
                got[name].append(uvloop.run(trips(submit, a.trips)))
    finally:
        executor.shutdown()
        thread.stop()
        cond.run(None)
    print("| hand-off | p50 µs | p99 µs |\n|---|---|---|")
    for name, rs in got.items():
        p50, p99 = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        print(f"| {name} | {p50:.1f} | {p99:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
