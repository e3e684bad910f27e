"""Rates for the management API's ``*_details``: a sampler over monotonic counters and gauges.

Theory of operation: the hot path only increments integers (``Broker.stats``, each queue's
``n_published``/``n_delivered``/..., each exchange's ``n_in``/``n_out``). Every ``INTERVAL``
(RabbitMQ's ``collect_statistics_interval``, 5 s) a task on the event loop makes one pass over the
node: it reads every queue's, exchange's and connection's counters, ``CHUNK`` objects' work at a
time (a history made counting ``NEW_COST``), and gives the event loop back between chunks, so a
node with 100k queues, or 3,000 objects that all began to count, never stalls its connections
for more than one chunk's work. A rate is, as RabbitMQ's sample-based
``{"rate": r}``, the change between the oldest and newest snapshot kept for the object over the
last ``WINDOW`` seconds, divided by the time between them; it is computed when an answer is
rendered. Nothing is done per message.

What a pass keeps, so that many idle queues cost little time and RAM:

- nothing for an object that never counted anything (most idle queues);
- the last values of one that did (one tuple), kept in place: an unchanged object costs a lookup
  and a compare, no write;
- a ring of snapshots only for an object that changed within the window (or a queue with
  consumers, for its utilisation): an object without one has a rate of zero, which is what its
  ring would say. A ring whose oldest and newest snapshots are equal is dropped;
- nothing for a queue whose store boot left unread (``DeferredQueueStore``): reading its
  counts would recover it, and one pass over 10,000 such queues took seconds after a restart.
  The pass after its first use sees it as the node's first pass sees every queue: its counts
  are where it starts from, not a change;
- per vhost, running sums of its queues' changes: the vhost's and the node's queue totals (and
  the node's redelivered count) are rates of those sums, never a walk over the queues when an
  answer is rendered.

Objects are keyed by identity (what is kept for one holds it until a pass finds it gone), so a
queue or exchange deleted and re-declared under the same name starts from zero: one first
seen counts as zero at the previous pass, so its first interval has a rate. A queue deleted
between passes keeps what it counted in the sums; only its last interval is not seen.

``consumer_utilisation`` (RabbitMQ: the fraction of time the queue could deliver to a consumer at
once, i.e. its consumers were not held back by prefetch limits or a full socket) is approximated
from the same passes: at each pass a queue with a consumer that is ``ready()`` counts the seconds
since the previous pass as able, and the utilisation is the share of able time over the window.
A queue without consumers has none (``null``, as RabbitMQ).

History: the same pass records the values of an object that counted something, and the node's,
the vhosts' and the broker's, in a ``history.History`` (fixed-size rings at 5 s to 30 min per
slot, a day back) for the API's ``?lengths_age=&lengths_incr=`` samples; ``history.py`` says
what it keeps and what it costs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Generic, TypeVar

from broker.http.history import MAX_AGE, MAX_HISTORIES, History
from broker.model.exchange import Exchange
from broker.model.queue import Queue
from broker.model.vhost import VHost

if TYPE_CHECKING:
    from broker.views import BrokerView, ChannelView, ConnectionView

INTERVAL = 5.0  # seconds between passes: RabbitMQ's default collect_statistics_interval
WINDOW = 5.0  # seconds a rate is taken over (RabbitMQ: the last sample interval by default)
# objects read between two returns to the event loop: about 0.5 ms of work on this machine
CHUNK = 500
# what a new history costs, in objects read: made and given its first two samples, about 2.5
# times an object's read with a history (callgrind), rounded up for its rings and entries
NEW_COST = 4

GLOBAL_FIELDS = ("published", "delivered", "acked", "confirmed", "unroutable", "gets", "gets_empty",
                 "returned", "delivered_autoack", "gets_autoack", "connections_opened",
                 "channels_opened", "connections_closed", "channels_closed", "queues_created",
                 "queues_deleted", "redelivered")
QUEUE_FIELDS = ("publish", "deliver_get", "ack", "redeliver", "ready", "unacked", "get", "get_no_ack",
                "get_empty")
REDELIVER = QUEUE_FIELDS.index("redeliver")
VHOST_FIELDS = ("confirm", "unroutable", "returned")
EXCHANGE_FIELDS = ("publish_in", "publish_out")
CONNECTION_FIELDS = ("recv_oct", "send_oct")
# RabbitMQ's channel message_stats: deliver_get is deliver + deliver_no_ack + get + get_no_ack
CHANNEL_FIELDS = ("publish", "confirm", "deliver_get", "ack", "deliver", "deliver_no_ack", "get",
                  "get_no_ack", "redeliver")
GAUGE_FIELDS = ("mem_used", "disk_free", "fd_used", "sockets_used", "proc_used")

log = logging.getLogger(__name__)

Values = tuple[float, ...]
Sample = tuple[float, Values]
K = TypeVar("K")
T = TypeVar("T")


class Ring:
    """One object's snapshots over the last ``WINDOW`` seconds."""

    __slots__ = ("samples",)

    def __init__(self) -> None:
        self.samples: deque[Sample] = deque(maxlen=int(WINDOW / INTERVAL) + 1)

    def add(self, t: float, values: Values) -> None:
        self.samples.append((t, values))

    def flat(self) -> bool:
        """No change over the window: every rate is zero."""
        return self.samples[0][1] == self.samples[-1][1]

    def rates(self, n: int) -> Values:
        if len(self.samples) < 2:
            return (0.0,) * n
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        dt = max(t1 - t0, 1e-3)
        return tuple((b - a) / dt for a, b in zip(first, last, strict=True))


class Tracked(Generic[K]):
    """One kind of object (queues, exchanges, connections): the last values of those that ever
    counted something, and rings of those that changed within the window.

    Kept in place from pass to pass, so that an idle object costs a lookup and a compare and no
    write. A pass calls ``see`` for each live object; when fewer were seen than are kept, some
    went away, and ``drop`` forgets those (with their rings)."""

    __slots__ = ("last", "rings", "zeros", "known", "histories", "made")

    def __init__(self, width: int) -> None:
        self.zeros: Values = (0,) * width
        self.last: dict[K, Values] = {}
        self.rings: dict[K, Ring] = {}
        self.histories: dict[K, History] = {}  # of the first MAX_HISTORIES to count something
        self.known = 0  # objects seen by this pass that have an entry in ``last``
        self.made = 0  # histories made, ever (the pass charges each ``NEW_COST``)

    def see(self, obj: K, values: Values, now: float, previous: float | None) -> Values | None:
        """Record ``obj``'s values at ``now``; the change since the last pass, None if none."""
        kept = self.last.get(obj)
        if kept is None:
            if values == self.zeros:  # never counted anything: nothing kept
                return None
            before = self.zeros
        else:
            before = kept
            if values == before:
                history = self.histories.get(obj)
                if history is not None:
                    if now - history.changed > MAX_AGE:  # flat for a day: its samples are its value
                        del self.histories[obj]
                    else:
                        history.add(now, kept)
                ring = self.rings.get(obj)
                if ring is not None:
                    ring.add(now, values)
                    if ring.flat():
                        del self.rings[obj]
                self.known += 1
                return None
        self.last[obj] = values
        self.known += 1
        ring = self.rings.get(obj)
        if ring is None and previous is not None:
            # born or woken since the last pass: it was `before` then (the node's first pass has
            # no rate to give, and makes no rings: a restart with 100k non-empty queues)
            ring = self.rings[obj] = Ring()
            ring.add(previous, before)
        if ring is not None:
            ring.add(now, values)
        history = self.histories.get(obj)
        if history is None and previous is not None and len(self.histories) < MAX_HISTORIES:
            # (not on the node's first pass: 100k non-empty queues after a restart are not changes)
            history = self.histories[obj] = History(len(values))
            history.add(previous, before)
            self.made += 1
        if history is not None:
            history.add(now, values)
            history.changed = now
        return tuple(b - a for a, b in zip(before, values, strict=True))

    def stale(self) -> bool:
        """Some kept object was not seen by this pass (it was deleted or closed)."""
        return len(self.last) > self.known

    def drop(self, objs: Iterable[K], gone: Callable[[K], bool]) -> None:
        for obj in objs:
            if gone(obj):
                self.last.pop(obj, None)
                self.rings.pop(obj, None)
                self.histories.pop(obj, None)

    def rates(self, obj: K, fields: Sequence[str]) -> dict[str, float]:
        ring = self.rings.get(obj)
        values = ring.rates(len(fields)) if ring else (0.0,) * len(fields)
        return dict(zip(fields, values, strict=True))


def queue_values(q: Queue) -> Values:
    """A queue's ``QUEUE_FIELDS`` now."""
    return (q.n_published, q.n_delivered, q.n_acked, q.n_redelivered, q.message_count,
            q.store.unacked_count, q.n_gets, q.n_gets_no_ack, q.n_get_empty)


def channel_values(c: ChannelView) -> Values:
    """A channel's ``CHANNEL_FIELDS`` now."""
    tags, gets, gets_no_ack, no_ack = c.next_tag - 1, c.n_get, c.n_get_no_ack, c.n_deliver_no_ack
    return (c.n_published, c.confirmed, tags, c.n_acked, tags - gets - gets_no_ack - no_ack, no_ack, gets,
            gets_no_ack, c.n_redelivered)


class RateSampler:
    def __init__(self, broker: BrokerView,
                 gauges: Callable[[], tuple[int, ...]] = lambda: (0,) * len(GAUGE_FIELDS),
                 clock: Callable[[], float] = time.monotonic, chunk: int = CHUNK,
                 connections: Callable[[], Collection[ConnectionView]] | None = None) -> None:
        self.broker = broker
        # every protocol's connections (``Mgmt.connections``); the AMQP broker's by default
        self.connections = connections if connections is not None else lambda: broker.connections
        self.gauges = gauges
        self.clock = clock
        self.chunk = chunk
        self._global = Ring()
        self._node = Ring()
        self._global_history = History(len(GLOBAL_FIELDS))
        self._node_history = History(len(GAUGE_FIELDS))
        self._vhost_histories: dict[VHost, History] = {}
        self._queues: Tracked[Queue] = Tracked(len(QUEUE_FIELDS))
        self._exchanges: Tracked[Exchange] = Tracked(len(EXCHANGE_FIELDS))
        self._connections: Tracked[ConnectionView] = Tracked(len(CONNECTION_FIELDS))
        self._channels: Tracked[ChannelView] = Tracked(len(CHANNEL_FIELDS))
        self._able: dict[Queue, Ring] = {}  # seconds a queue's consumers could take a delivery
        # per vhost: its own counters, then the running sums of its queues' QUEUE_FIELDS
        self._vhosts: dict[VHost, Ring] = {}
        self._sums: dict[VHost, list[float]] = {}
        self._redelivered = 0  # every queue's redeliveries, the deleted ones' included
        # queues whose store boot left unread (``unread``), as of the last pass and this one
        self._unread: set[Queue] = set()
        self._unread_now: set[Queue] = set()
        self._previous: float | None = None
        self._room = chunk  # objects the current pass may still read before it yields
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
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
            started = self.clock()
            try:
                for _ in self.steps():
                    await asyncio.sleep(0)  # the loop's other callbacks and its IO poll run here
            except Exception as exc:  # noqa: BLE001 - one bad pass must not end the sampling
                log.error("statistics pass failed: %r", exc)
            await asyncio.sleep(max(0.0, started + INTERVAL - self.clock()))

    def sample(self) -> None:
        """One whole pass at once (tests, and a caller that wants fresh numbers now)."""
        for _ in self.steps():
            pass

    def global_counters(self) -> tuple[int, ...]:
        """``GLOBAL_FIELDS`` now: the broker's counters and the ones derived from the model (the
        redelivered count as of the last pass, which sums it from the queues)."""
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
                self._redelivered)

    def steps(self) -> Iterator[None]:
        """One pass, yielding after each ``chunk`` objects read (the caller returns to the loop)."""
        now = self.clock()
        previous = self._previous
        self._room = self.chunk
        for tracked in (self._queues, self._exchanges, self._connections, self._channels):
            tracked.known = 0
        walked = list(self.broker.vhosts.values())
        exchanges: list[Exchange] = []
        for vh in walked:
            sums = self._sums.setdefault(vh, [0.0] * len(QUEUE_FIELDS))
            yield from self._paced(list(vh.queues.values()),
                                   partial(self._read_queues, sums=sums, now=now, previous=previous))
            exchanges.extend(vh.exchanges.values())
        yield from self._paced(exchanges, lambda part: [
            self._exchanges.see(ex, (ex.n_in, ex.n_out), now, previous) for ex in part])
        connections = set(self.connections())
        yield from self._paced(list(connections), lambda part: [
            self._connections.see(s, (s.recv_oct, s.send_oct), now, previous) for s in part])
        channels = {c for s in connections for c in s.chs.values()}
        yield from self._paced(list(channels), lambda part: [
            self._channels.see(c, channel_values(c), now, previous) for c in part])
        # forget what went away since the last pass: deleted queues and exchanges, closed
        # connections, and the utilisation of queues that lost their consumers
        vhosts = self.broker.vhosts
        if self._queues.stale():
            yield from self._paced(list(self._queues.last), partial(self._queues.drop, gone=lambda q: (
                (vh := vhosts.get(q.vhost)) is None or vh.queues.get(q.name) is not q)))
        if self._exchanges.stale():
            live = set(exchanges)
            yield from self._paced(list(self._exchanges.last),
                                   partial(self._exchanges.drop, gone=lambda ex: ex not in live))
        if self._connections.stale():
            yield from self._paced(list(self._connections.last), partial(
                self._connections.drop, gone=lambda s: s not in connections))
        if self._channels.stale():
            yield from self._paced(list(self._channels.last), partial(
                self._channels.drop, gone=lambda c: c not in channels))
        able = self._able
        yield from self._paced(list(able.items()), lambda part: [
            able.pop(q) for q, ring in part if ring.samples[-1][0] != now])
        self._end(walked, now, previous)

    def _end(self, walked: list[VHost], now: float, previous: float | None) -> None:
        """The few node- and vhost-level samples that close a pass."""
        rings: dict[VHost, Ring] = {}
        histories: dict[VHost, History] = {}
        for vh in walked:
            ring = self._vhosts.get(vh)
            if ring is None:
                ring = Ring()
                if previous is not None:
                    ring.add(previous, (0,) * (len(VHOST_FIELDS) + len(QUEUE_FIELDS)))
            values = (vh.n_confirmed, vh.n_unroutable, vh.n_returned, *self._sums[vh])
            ring.add(now, values)
            rings[vh] = ring
            history = histories[vh] = self._vhost_histories.get(vh) or History(len(values))
            history.add(now, values)
        self._vhosts = rings
        self._vhost_histories = histories
        self._sums = {vh: self._sums[vh] for vh in walked}
        self._unread, self._unread_now = self._unread_now, set()
        end = self.clock()
        counters, gauges = self.global_counters(), self.gauges()
        self._global.add(end, counters)
        self._node.add(end, gauges)
        self._global_history.add(end, counters)
        self._node_history.add(end, gauges)
        self._previous = now

    def _paced(self, items: list[T], read: Callable[[list[T]], object]) -> Iterator[None]:
        """``read`` the items in parts; yield each time ``chunk`` objects' work was done since
        the last: an object read counts one, a history made ``NEW_COST`` (the pass after 1,000
        queues and 2,000 channels began to count makes 3,000). A part is never more than the
        room left could take if every object in it made a history, so no step passes ``chunk``."""
        start = 0
        while start < len(items):
            if self._room < NEW_COST:
                self._room = self.chunk
                yield
            part = items[start:start + self._room // NEW_COST]
            start += len(part)
            made = self._made()
            read(part)
            self._room -= len(part) + (NEW_COST - 1) * (self._made() - made)

    def _made(self) -> int:
        return self._queues.made + self._exchanges.made + self._connections.made + self._channels.made

    def _read_queues(self, part: list[Queue], sums: list[float], now: float,
                     previous: float | None) -> None:
        queues = self._queues
        for q in part:
            if q.store.unread:  # its counts would read its directory: it has done nothing yet
                self._unread_now.add(q)
                continue
            late = q in self._unread  # read since the last pass: what it holds is no rate
            delta = queues.see(q, queue_values(q), now, None if late else previous)
            if delta is not None and not late:
                for i, d in enumerate(delta):
                    sums[i] += d
                self._redelivered += int(delta[REDELIVER])
            if q.consumers:
                self._see_able(q, now)

    def _see_able(self, q: Queue, now: float) -> None:
        ring = self._able.get(q)
        if ring is None:  # its first able time is counted from the next pass
            ring = self._able[q] = Ring()
            ring.add(now, (0.0,))
            return
        t, (able,) = ring.samples[-1]
        ring.add(now, (able + (now - t if any(c.ready() for c in q.consumers) else 0.0),))

    def global_rates(self) -> dict[str, float]:
        return dict(zip(GLOBAL_FIELDS, self._global.rates(len(GLOBAL_FIELDS)), strict=True))

    def node_rates(self) -> dict[str, float]:
        return dict(zip(GAUGE_FIELDS, self._node.rates(len(GAUGE_FIELDS)), strict=True))

    def queue_rates(self, q: Queue) -> dict[str, float]:
        """``QUEUE_FIELDS`` per second over the window, zeros before two samples."""
        return self._queues.rates(q, QUEUE_FIELDS)

    def queue_totals_rates(self, vhosts: Iterable[VHost]) -> dict[str, float]:
        """The sum of ``queue_rates`` over the queues of ``vhosts`` (a vhost's or the node's)."""
        total = [0.0] * len(QUEUE_FIELDS)
        for vh in vhosts:
            ring = self._vhosts.get(vh)
            if ring is not None:
                for i, r in enumerate(ring.rates(len(VHOST_FIELDS) + len(QUEUE_FIELDS))[len(VHOST_FIELDS):]):
                    total[i] += r
        return dict(zip(QUEUE_FIELDS, total, strict=True))

    def exchange_rates(self, ex: Exchange) -> dict[str, float]:
        return self._exchanges.rates(ex, EXCHANGE_FIELDS)

    def connection_rates(self, s: ConnectionView) -> dict[str, float]:
        """Bytes per second received and sent over the window."""
        return self._connections.rates(s, CONNECTION_FIELDS)

    def channel_rates(self, c: ChannelView) -> dict[str, float]:
        """``CHANNEL_FIELDS`` per second over the window."""
        return self._channels.rates(c, CHANNEL_FIELDS)

    def consumer_utilisation(self, q: Queue) -> float | None:
        if not q.consumers:
            return None
        ring = self._able.get(q)
        if ring is None or len(ring.samples) < 2:
            return 1.0 if any(c.ready() for c in q.consumers) else 0.0
        return min(1.0, max(0.0, ring.rates(1)[0]))

    def vhost_rates(self, vh: VHost) -> dict[str, float]:
        """``VHOST_FIELDS`` per second (the vhost's own counters; queue sums: ``queue_totals_rates``)."""
        ring = self._vhosts.get(vh)
        n = len(VHOST_FIELDS)
        values = ring.rates(n + len(QUEUE_FIELDS))[:n] if ring else (0.0,) * n
        return dict(zip(VHOST_FIELDS, values, strict=True))

    # ------------------------------------------------------------------ history
    def wall_offset(self) -> float:
        """Add to a time of the sampler's clock to get wall-clock seconds."""
        return time.time() - self.clock()

    def queue_history(self, q: Queue) -> History | None:
        """``QUEUE_FIELDS`` over the last day (None: the queue never changed, or past the cap)."""
        return self._queues.histories.get(q)

    def exchange_history(self, ex: Exchange) -> History | None:
        return self._exchanges.histories.get(ex)

    def connection_history(self, s: ConnectionView) -> History | None:
        return self._connections.histories.get(s)

    def channel_history(self, c: ChannelView) -> History | None:
        """``CHANNEL_FIELDS`` over the last day (None: it never counted, or past the cap)."""
        return self._channels.histories.get(c)

    def vhost_history(self, vh: VHost) -> History | None:
        """``VHOST_FIELDS`` then the vhost's ``QUEUE_FIELDS`` sums."""
        return self._vhost_histories.get(vh)

    def history_bytes(self) -> int:
        """What every history kept takes in its arrays (the node's ``mgmt_db`` memory)."""
        kept: list[History] = [self._global_history, self._node_history, *self._vhost_histories.values()]
        for tracked in (self._queues, self._exchanges, self._connections, self._channels):
            kept.extend(tracked.histories.values())
        return sum(h.nbytes() for h in kept)

    def global_history(self) -> History:
        return self._global_history

    def node_history(self) -> History:
        return self._node_history
