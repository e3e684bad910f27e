"""The size distribution of published message bodies, RabbitMQ's ``rabbitmq_message_size_bytes``.

Theory of operation
-------------------
A histogram is one counter per bucket plus the sum of the sizes. The buckets are RabbitMQ's
(``rabbit_msg_size_metrics``: 100 B, 1 kB, 10 kB, 100 kB, 1 MB, 10 MB, 50 MB, 100 MB and
above), so its dashboards' ``le`` selectors find them. ``counts[i]`` holds the bodies of at most
``BOUNDS[i]`` bytes and more than the bound before it (the last slot: more than every bound);
the metrics collector turns them into Prometheus' cumulative buckets at scrape time.

Cost: a single publish takes one ``bisect`` on an 8-entry tuple. A run of publishes (the fast
path, ``observe_run``) measures its bodies with C-level ``map(len, ...)``, ``min`` and
``max``, and when both ends fall into one bucket (the common case: similar messages) it adds
the run's length to that bucket once; only a run that spans buckets is binned body by body.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import islice

# upper bounds in bytes, RabbitMQ's; a body of exactly a bound's size belongs to that bucket
BOUNDS = (100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000, 50_000_000, 100_000_000)


class MessageSizes:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS) + 1)
        self.total = 0  # bytes

    def observe(self, size: int) -> None:
        self.counts[bisect_left(BOUNDS, size)] += 1
        self.total += size

    def observe_run(self, bodies: Sequence[bytes | memoryview], lo: int = 0, hi: int | None = None) -> None:
        """``bodies[lo:hi]``, counted without a Python-level step per body when they share a bucket."""
        end = len(bodies) if hi is None else hi
        if end <= lo:
            return
        sizes = list(map(len, bodies if lo == 0 and end == len(bodies) else islice(bodies, lo, end)))
        first = bisect_left(BOUNDS, min(sizes))
        counts = self.counts
        if first == bisect_left(BOUNDS, max(sizes)):
            counts[first] += len(sizes)
        else:
            for size in sizes:
                counts[bisect_left(BOUNDS, size)] += 1
        self.total += sum(sizes)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, bodies of at most that size)`` per bucket, ``inf`` last."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip((*BOUNDS, float("inf")), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out
