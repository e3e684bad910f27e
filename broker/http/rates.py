"""Message rates for ``message_stats``: a sampler over the monotonic counters.

Theory of operation: the hot path only increments integers (``Broker.stats``
and each queue's ``n_published``/``n_delivered``/...). Every ``INTERVAL``
seconds a task on the event loop snapshots those counters; a rate is the
difference between the last two snapshots divided by the time between them.
Nothing is done per message. Queues are keyed by object identity, so a queue
deleted and re-declared under the same name starts from zero (a queue first
seen counts as zero at the previous sample, so its first interval has a rate);
snapshots of
queues that no longer exist are dropped at the next sample.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from broker.model.queue import Queue

if TYPE_CHECKING:
    from broker.views import BrokerView

INTERVAL = 5.0  # seconds between samples; RabbitMQ's default collect_statistics_interval

GLOBAL_FIELDS = ("published", "delivered", "acked", "confirmed", "unroutable")
QUEUE_FIELDS = ("n_published", "n_delivered", "n_acked", "n_redelivered")


def _queue_counters(q: Queue) -> tuple[int, ...]:
    return (q.n_published, q.n_delivered, q.n_acked, q.n_redelivered, q.message_count,
            q.store.unacked_count)


class RateSampler:
    def __init__(self, broker: BrokerView) -> None:
        self.broker = broker
        self._last_global: tuple[float, tuple[int, ...]] | None = None
        self.global_rates: dict[str, float] = {f: 0.0 for f in GLOBAL_FIELDS}
        self._last_queue: dict[int, tuple[float, tuple[int, ...]]] = {}
        self._queue_rates: dict[int, tuple[float, ...]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.sample()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL)
            self.sample()

    def sample(self) -> None:
        now = time.monotonic()
        stats = self.broker.stats
        current = tuple(int(getattr(stats, f)) for f in GLOBAL_FIELDS)
        if self._last_global is not None:
            then, before = self._last_global
            dt = max(now - then, 1e-3)
            pairs = zip(GLOBAL_FIELDS, current, before, strict=True)
            self.global_rates = {f: (c - b) / dt for f, c, b in pairs}
        previous_sample = self._last_global[0] if self._last_global is not None else None
        self._last_global = (now, current)
        seen: dict[int, tuple[float, tuple[int, ...]]] = {}
        rates: dict[int, tuple[float, ...]] = {}
        for vh in self.broker.vhosts.values():
            for q in vh.queues.values():
                key = id(q)
                counters = _queue_counters(q)
                prev = self._last_queue.get(key)
                if prev is None and previous_sample is not None:
                    # Born since the last sample: it started from zero then.
                    prev = (previous_sample, (0,) * len(counters))
                if prev is not None:
                    dt = max(now - prev[0], 1e-3)
                    rates[key] = tuple((c - b) / dt for c, b in zip(counters, prev[1], strict=True))
                seen[key] = (now, counters)
        self._last_queue = seen
        self._queue_rates = rates

    def queue_rates(self, q: Queue) -> tuple[float, ...]:
        """(publish, deliver, ack, redeliver, ready, unacked) per second, zeros before two samples."""
        return self._queue_rates.get(id(q), (0.0,) * 6)
