"""Rates for the management API's ``*_details``: a sampler over monotonic counters and gauges.

Theory of operation: the hot path only increments integers (``Broker.stats``, each queue's
``n_published``/``n_delivered``/..., each exchange's ``n_in``/``n_out``). Every ``INTERVAL``
(one second) a task on the event loop snapshots those counters, and the node's gauges, into a
short ring per object covering the last ``WINDOW`` seconds. A rate is, as RabbitMQ's
sample-based ``{"rate": r}``, the change between the oldest and newest snapshot in the ring
divided by the time between them; it is computed when an answer is rendered. Nothing is done per
message. Objects are keyed by identity, so a queue or exchange deleted and re-declared under the
same name starts from zero (one first seen counts as zero at the previous sample, so its first
interval has a rate); rings of objects that no longer exist are dropped at the next sample.

``consumer_utilisation`` (RabbitMQ: the fraction of time the queue could deliver to a consumer at
once, i.e. its consumers were not held back by prefetch limits or a full socket) is approximated
from the same samples: at each sample a queue with a consumer that is ``ready()`` counts the
seconds since the previous sample as able, and the utilisation is the share of able time over
the window. A queue without consumers has none (``null``, as RabbitMQ).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from broker.model.exchange import Exchange
from broker.model.queue import Queue
from broker.model.vhost import VHost

if TYPE_CHECKING:
    from broker.views import BrokerView, ConnectionView

INTERVAL = 1.0  # seconds between samples
WINDOW = 5.0  # seconds a rate is taken over (RabbitMQ: the last few samples, 5 s by default)

GLOBAL_FIELDS = ("published", "delivered", "acked", "confirmed", "unroutable", "gets", "gets_empty",
                 "returned", "delivered_autoack", "gets_autoack", "connections_opened",
                 "channels_opened", "connections_closed", "channels_closed", "queues_created",
                 "queues_deleted", "redelivered")
QUEUE_FIELDS = ("publish", "deliver_get", "ack", "redeliver", "ready", "unacked", "get", "get_no_ack",
                "get_empty", "utilisation")
VHOST_FIELDS = ("confirm", "unroutable", "returned")
EXCHANGE_FIELDS = ("publish_in", "publish_out")
CONNECTION_FIELDS = ("recv_oct", "send_oct")
GAUGE_FIELDS = ("mem_used", "disk_free", "fd_used", "sockets_used", "proc_used")

Sample = tuple[float, tuple[float, ...]]


def _queue_counters(q: Queue, ring: Ring | None, now: float) -> tuple[float, ...]:
    """The queue's counters, and the seconds (summed over samples) during which one of its
    consumers could take a delivery: its rate over the window is ``consumer_utilisation``."""
    able = 0.0
    if ring is not None and ring.samples:
        t, last = ring.samples[-1]
        able = last[-1] + (now - t if any(c.ready() for c in q.consumers) else 0.0)
    return (q.n_published, q.n_delivered, q.n_acked, q.n_redelivered, q.message_count,
            q.store.unacked_count, q.n_gets, q.n_gets_no_ack, q.n_get_empty, able)


class Ring:
    """One object's snapshots over the last ``WINDOW`` seconds."""

    __slots__ = ("samples",)

    def __init__(self) -> None:
        self.samples: deque[Sample] = deque(maxlen=int(WINDOW / INTERVAL) + 1)

    def add(self, t: float, values: tuple[float, ...]) -> None:
        self.samples.append((t, values))

    def rates(self, n: int) -> tuple[float, ...]:
        if len(self.samples) < 2:
            return (0.0,) * n
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        dt = max(t1 - t0, 1e-3)
        return tuple((b - a) / dt for a, b in zip(first, last, strict=True))


class RateSampler:
    def __init__(self, broker: BrokerView,
                 gauges: Callable[[], tuple[int, ...]] = lambda: (0,) * len(GAUGE_FIELDS)) -> None:
        self.broker = broker
        self.gauges = gauges
        self._global = Ring()
        self._node = Ring()
        self._queues: dict[int, Ring] = {}
        self._exchanges: dict[int, Ring] = {}
        self._connections: dict[int, Ring] = {}
        self._vhosts: dict[int, Ring] = {}
        self._previous: float | None = None
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

    def global_counters(self) -> tuple[int, ...]:
        """``GLOBAL_FIELDS`` now: the broker's counters and the ones derived from the model."""
        b = self.broker
        st = b.stats
        vhs = list(b.vhosts.values())
        sessions = list(b.connections)
        channels = sum(len(s.chs) for s in sessions)
        return (st.published, st.delivered, st.acked, st.confirmed, st.unroutable, st.gets,
                st.gets_empty, st.returned, st.delivered_autoack, st.gets_autoack,
                st.connections_opened, st.channels_opened,
                max(0, st.connections_opened - len(sessions)), max(0, st.channels_opened - channels),
                sum(vh.queues_created for vh in vhs), sum(vh.queues_deleted for vh in vhs),
                sum(q.n_redelivered for vh in vhs for q in vh.queues.values()))

    def sample(self) -> None:
        now = time.monotonic()
        self._global.add(now, self.global_counters())
        self._node.add(now, self.gauges())
        queues: list[tuple[int, tuple[float, ...]]] = []
        exchanges: list[tuple[int, tuple[float, ...]]] = []
        rings = self._queues
        for vh in self.broker.vhosts.values():
            queues.extend((id(q), _queue_counters(q, rings.get(id(q)), now)) for q in vh.queues.values())
            exchanges.extend((id(ex), (ex.n_in, ex.n_out)) for ex in vh.exchanges.values())
        self._queues = self._advance(self._queues, queues, now)
        self._exchanges = self._advance(self._exchanges, exchanges, now)
        self._vhosts = self._advance(self._vhosts, (
            (id(vh), (vh.n_confirmed, vh.n_unroutable, vh.n_returned))
            for vh in self.broker.vhosts.values()), now)
        self._connections = self._advance(
            self._connections, ((id(s), (s.recv_oct, s.send_oct)) for s in self.broker.connections), now)
        self._previous = now

    def _advance(self, rings: dict[int, Ring], current: Iterable[tuple[int, tuple[float, ...]]],
                 now: float) -> dict[int, Ring]:
        out: dict[int, Ring] = {}
        for key, values in current:
            ring = rings.get(key)
            if ring is None:
                ring = Ring()
                if self._previous is not None:  # born since the last sample: it started from zero
                    ring.add(self._previous, (0,) * len(values))
            ring.add(now, values)
            out[key] = ring
        return out

    def global_rates(self) -> dict[str, float]:
        return dict(zip(GLOBAL_FIELDS, self._global.rates(len(GLOBAL_FIELDS)), strict=True))

    def node_rates(self) -> dict[str, float]:
        return dict(zip(GAUGE_FIELDS, self._node.rates(len(GAUGE_FIELDS)), strict=True))

    def queue_rates(self, q: Queue) -> dict[str, float]:
        """``QUEUE_FIELDS`` per second over the window, zeros before two samples."""
        ring = self._queues.get(id(q))
        values = ring.rates(len(QUEUE_FIELDS)) if ring else (0.0,) * len(QUEUE_FIELDS)
        return dict(zip(QUEUE_FIELDS, values, strict=True))

    def queues_rates(self, queues: Iterable[Queue]) -> dict[str, float]:
        """The sum of ``queue_rates`` (a vhost's or the node's queues)."""
        total = dict.fromkeys(QUEUE_FIELDS, 0.0)
        for q in queues:
            for k, v in self.queue_rates(q).items():
                total[k] += v
        return total

    def exchange_rates(self, ex: Exchange) -> dict[str, float]:
        ring = self._exchanges.get(id(ex))
        values = ring.rates(len(EXCHANGE_FIELDS)) if ring else (0.0,) * len(EXCHANGE_FIELDS)
        return dict(zip(EXCHANGE_FIELDS, values, strict=True))

    def connection_rates(self, s: ConnectionView) -> dict[str, float]:
        """Bytes per second received and sent over the window."""
        ring = self._connections.get(id(s))
        values = ring.rates(len(CONNECTION_FIELDS)) if ring else (0.0,) * len(CONNECTION_FIELDS)
        return dict(zip(CONNECTION_FIELDS, values, strict=True))

    def consumer_utilisation(self, q: Queue) -> float | None:
        if not q.consumers:
            return None
        ring = self._queues.get(id(q))
        if ring is None or len(ring.samples) < 2:
            return 1.0 if any(c.ready() for c in q.consumers) else 0.0
        return min(1.0, max(0.0, ring.rates(len(QUEUE_FIELDS))[-1]))

    def vhost_rates(self, vh: VHost) -> dict[str, float]:
        """``VHOST_FIELDS`` per second (the vhost's own counters; queue sums: ``queues_rates``)."""
        ring = self._vhosts.get(id(vh))
        values = ring.rates(len(VHOST_FIELDS)) if ring else (0.0,) * len(VHOST_FIELDS)
        return dict(zip(VHOST_FIELDS, values, strict=True))
