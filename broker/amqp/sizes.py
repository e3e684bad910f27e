"""The size distribution of published message bodies, RabbitMQ's ``rabbitmq_message_size_bytes``.

Theory of operation
-------------------
A histogram is one counter per bucket plus the sum of the sizes. The buckets are RabbitMQ's
(``rabbit_msg_size_metrics``: 100 B, 1 kB, 10 kB, 100 kB, 1 MB, 10 MB, 50 MB, 100 MB and
above), so its dashboards' ``le`` selectors find them. ``counts[i]`` holds the bodies of at most
``BOUNDS[i]`` bytes and more than the bound before it (the last slot: more than every bound);
the metrics collector turns them into Prometheus' cumulative buckets at scrape time.

Cost: a run of publishes whose bodies are all of one length (the codec knows: ``same`` of
``handle_publish_run``, the fast path) costs one bucket lookup for the whole run. Other runs
and batches measure their bodies with C-level ``map(len, ...)``, ``min`` and ``max`` and, when
both ends fall into one bucket (similar messages), add the count to that bucket once; a run
that spans buckets sorts its sizes (in C) and takes one ``bisect`` per bound it spans: no
Python-level step per body. A single publish looks its bucket up in a table of the sizes under
16 KiB (a ``bisect`` above that).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import islice

# upper bounds in bytes, RabbitMQ's; a body of exactly a bound's size belongs to that bucket
BOUNDS = (100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000, 50_000_000, 100_000_000)
_SMALL = bytes(bisect_left(BOUNDS, size) for size in range(16 * 1024))  # size -> bucket, 16 KiB


def bucket(size: int) -> int:
    try:
        return _SMALL[size]
    except IndexError:
        return bisect_left(BOUNDS, size)


class MessageSizes:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS) + 1)
        self.total = 0  # bytes

    def observe(self, size: int) -> None:
        try:
            self.counts[_SMALL[size]] += 1
        except IndexError:
            self.counts[bisect_left(BOUNDS, size)] += 1
        self.total += size

    def observe_run(self, bodies: Sequence[bytes | memoryview], lo: int = 0, hi: int | None = None,
                    same: bool = False) -> None:
        """``bodies[lo:hi]``; ``same``: all of one length (one lookup), else counted without a
        Python-level step per body when they share a bucket."""
        end = len(bodies) if hi is None else hi
        if end <= lo:
            return
        counts = self.counts
        if same:
            size = len(bodies[lo])
            counts[bucket(size)] += end - lo
            self.total += size * (end - lo)
            return
        sizes = list(map(len, bodies if lo == 0 and end == len(bodies) else islice(bodies, lo, end)))
        first, largest = bucket(min(sizes)), max(sizes)
        last = bucket(largest)
        if first == last:
            counts[first] += len(sizes)
        else:  # sorted (in C), each bound spanned is one bisect
            sizes.sort()
            below = 0
            for i in range(first, last):
                upto = bisect_right(sizes, BOUNDS[i])
                counts[i] += upto - below
                below = upto
            counts[last] += len(sizes) - below
        self.total += sum(sizes)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, bodies of at most that size)`` per bucket, ``inf`` last."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip((*BOUNDS, float("inf")), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out
