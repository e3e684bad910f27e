#!/usr/bin/env python3
"""A synchronous publisher's confirms while the window's full syncs run (issue 31), no sockets.

A real ``Syncer`` and a real ``QueueStore`` on real files (``--dir``: put it on the disk the
broker uses; on tmpfs an fsync costs nothing and there is nothing to see). One publisher appends
a Celery-sized persistent message, waits for its confirm (``after_sync``), and a live consumer
takes and acks it, so the store has settlements for every full sync of the ack window
(``--window``, 1 s as in the node: a full sync every half second). Each call is timed from the
append to the confirm's callback. Two modes in turns within one process (``--rounds``), so load
on the machine hits them alike: *apart* (the node's: a full commit answers its confirms, then the
settlement files are fsynced on the settling thread) and *inside* (``Syncer.settle_apart =
False``: the settlement's fsyncs inside the commit, as before). Prints, per mode, the median over
rounds of each percentile, and how many calls in all took longer than 10 ms.

What survives a loaded machine is the count, not the time: every fsync the store makes is
recorded (its thread and span), and for each call the number of fsyncs on the group commit's
thread that ran while it waited (``fsyncs waited``). A call that waits only for its own commit
waits for one (the segment) or two; one that arrived during a full sync with the settlement
inside waits for that sync's three or more (segment, ack file, delivered mark) and its own.

    python benchmarks/latency_settle.py --dir /var/tmp --rounds 5 --seconds 4
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from broker.store import segment_log  # noqa: E402
from broker.store.queue_store import QueueStore  # noqa: E402
from broker.syncer import Syncer  # noqa: E402

PERSISTENT = struct.pack(">HB", 0x1000, 2)
MAX_CALLS = 200_000  # per round, besides the time bound
PCTS = (("p50", 0.50), ("p99", 0.99), ("p99.9", 0.999))
COMMIT_THREAD = "skred-fsync"
SETTLE_THREAD = "skred-fsync-settle"
SPANS: list[tuple[float, float]] = []  # fsyncs on the group commit's thread: (start, end)
SETTLES: list[tuple[float, float]] = []  # and on the settling thread


def _recorded(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    def wrapper(arg: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn(arg)
        finally:
            name = threading.current_thread().name
            if name == COMMIT_THREAD:
                SPANS.append((t0, time.perf_counter()))
            elif name == SETTLE_THREAD:
                SETTLES.append((t0, time.perf_counter()))
    return wrapper


for _name in ("datasync", "datasync_path", "fsync_dir"):  # the store's fsync seams
    setattr(segment_log, _name, _recorded(getattr(segment_log, _name)))


async def one_round(directory: Path, apart: bool, seconds: float,
                    window: float) -> tuple[list[float], list[int], list[bool]]:
    """Call times (ms) of one mode's run, the fsyncs each waited for, and whether a settling
    thread's fsync ran while it waited."""
    loop = asyncio.get_running_loop()
    s = Syncer(loop, True, window=window)
    s.settle_apart = apart
    store = QueueStore(directory, notify=s.mark_dirty)
    rnd = random.Random(31)
    bodies = [rnd.randbytes(rnd.randint(200, 2048)) for _ in range(64)]
    calls: list[float] = []
    spans: list[tuple[float, float]] = []
    SPANS.clear()
    SETTLES.clear()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and len(calls) < MAX_CALLS:
            t0 = time.perf_counter()
            store.append(0, b"", b"k", PERSISTENT, bodies[len(calls) % len(bodies)])
            s.mark_dirty(store)
            fut: asyncio.Future[bool] = loop.create_future()
            s.after_sync(fut.set_result, [store])
            assert await fut
            t1 = time.perf_counter()
            calls.append((t1 - t0) * 1e3)
            spans.append((t0, t1))
            got = store.next_delivery(False)  # the live consumer: deliver, ack
            assert got is not None
            store.ack(got[0])
    finally:
        done: asyncio.Future[bool] = loop.create_future()
        s.after_sync(done.set_result)  # the last commit, then no loop turn left to it
        await done
        await asyncio.sleep(0.01)  # its own tail (a next commit it schedules) runs
        store.close()
        s.sync_now()
        s.shutdown()
    fs = sorted(SPANS)
    waited = [sum(1 for a, b in fs if a >= t0 and b <= t1) for t0, t1 in spans]
    beside = [any(a < t1 and b > t0 for a, b in SETTLES) for t0, t1 in spans]
    return calls, waited, beside


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


async def run(base: Path, rounds: int, seconds: float, window: float) -> None:
    res: dict[str, list[list[float]]] = {"apart": [], "inside": []}
    waits: dict[str, list[int]] = {"apart": [], "inside": []}
    beside: list[float] = []  # apart: calls that overlapped a settling fsync (ms)
    alone: list[float] = []
    behind: list[float] = []  # inside: calls that waited for a full sync's 3+ fsyncs (ms)
    for r in range(rounds):
        for mode in (("apart", "inside") if r % 2 == 0 else ("inside", "apart")):
            calls, waited, overlap = await one_round(base / f"q{r}-{mode}", mode == "apart", seconds, window)
            res[mode].append(calls)
            waits[mode] += waited
            for ms, o in zip(calls, overlap, strict=True):
                if mode == "apart":
                    (beside if o else alone).append(ms)
            if mode == "inside":
                behind += [ms for ms, k in zip(calls, waited, strict=True) if k >= 3]
            print(f"  round {r + 1} {mode}: {len(calls)} calls, p99 {pct(calls, 0.99):.2f} ms, "
                  f"max {max(calls):.2f} ms", file=sys.stderr, flush=True)
    print("| mode | calls/round | " + " | ".join(f"{n} ms" for n, _ in PCTS)
          + " | max ms | calls > 10 ms | calls | waited for 1 / 2 / 3+ fsyncs |")
    print("|---|--:|" + "--:|" * (len(PCTS) + 4))
    for mode, runs in res.items():
        cells = [f"{statistics.median(pct(c, q) for c in runs):.2f}" for _, q in PCTS]
        slow = sum(1 for c in runs for x in c if x > 10)
        w = waits[mode]
        dist = " / ".join(str(sum(1 for x in w if x == k)) for k in (1, 2))
        dist += f" / {sum(1 for x in w if x >= 3)}"
        print(f"| {mode} | {statistics.median(len(c) for c in runs):.0f} | " + " | ".join(cells)
              + f" | {statistics.median(max(c) for c in runs):.2f} | {slow} | {len(w)} | {dist} |")
    if beside and alone:
        print(f"\napart: {len(beside)} calls overlapped a settling fsync, median "
              f"{statistics.median(beside):.2f} ms (max {max(beside):.2f}); the other {len(alone)}: "
              f"median {statistics.median(alone):.2f} ms")
    if behind:
        print(f"inside: {len(behind)} calls waited for a full sync's fsyncs, median "
              f"{statistics.median(behind):.2f} ms (max {max(behind):.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the stores go (a temp dir is made inside)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0, help="per mode and round")
    ap.add_argument("--window", type=float, default=1.0, help="the ack window, seconds (node: 1)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="latency-settle-") as tmp:
        uvloop.run(run(Path(tmp), a.rounds, a.seconds, a.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
