#!/usr/bin/env python3
"""What the management statistics sampler costs the event loop, with many idle queues.

In-process: a real ``VHost`` with ``N`` classic queues (declared in a temp dir), a
``RateSampler`` over it, and passes run step by step as the event loop would run them. For each
``N`` it prints the event-loop time of one whole pass (median of ``--passes``), the longest single
step (the longest stall the sampler puts on every connection) and the memory the sampler keeps
(tracemalloc, after the passes). ``--with-message`` puts one message in each queue first (idle
queues that have counted something). Times are the thread's CPU time, so that another process taking
the core away mid-step (a shared machine) does not count as the sampler's.

    python benchmarks/rates_sampler.py 10000 20000 100000
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's broker and test helpers

from test_features_policy import _vhost  # noqa: E402

from broker.amqp.broker import Stats  # noqa: E402
from broker.http.rates import RateSampler  # noqa: E402


class _Broker:
    """The part of the broker the sampler reads: vhosts, counters, connections."""

    def __init__(self, vhosts: dict[str, Any]) -> None:
        self.vhosts = vhosts
        self.stats = Stats()
        self.connections: set[Any] = set()


def measure(n: int, passes: int, with_message: bool) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="rates-bench-"))
    try:
        vh = _vhost(tmp)
        for i in range(n):
            q, _ = vh.declare_queue(f"q{i}", owner=None)
            if with_message:  # then it has counted something: the sampler keeps its last values
                q.publish(1, b"", q.name_bytes, b"\x00\x00", b"m", False)
        sampler = RateSampler(_Broker({"/": vh}))  # type: ignore[arg-type]
        totals, longest = [], 0.0
        for _ in range(passes):
            total = 0.0
            steps = sampler.steps()
            while True:
                t = time.thread_time()
                done = next(steps, StopIteration) is StopIteration
                step = time.thread_time() - t
                total += step
                longest = max(longest, step)
                if done:
                    break
            totals.append(total)
        del sampler
        tracemalloc.start()  # a second sampler, so that tracing does not slow the timed one
        before = tracemalloc.get_traced_memory()[0]
        sampler = RateSampler(_Broker({"/": vh}))  # type: ignore[arg-type]
        for _ in range(3):
            sampler.sample()
        kept = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        print(f"{n:>7} queues: per pass {statistics.median(totals) * 1e3:7.1f} ms "
              f"(max {max(totals) * 1e3:.1f}), longest step {longest * 1e3:5.2f} ms, "
              f"sampler memory {kept / 1e6:.1f} MB", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("queues", type=int, nargs="+")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--with-message", action="store_true", help="one message in each queue")
    args = ap.parse_args()
    for n in args.queues:
        measure(n, args.passes, args.with_message)


if __name__ == "__main__":
    main()
