"""Queues and consumers: the protocol-neutral delivery core.

Theory of operation
-------------------
A queue is a ``QueueStore`` (its messages live on disk; RAM holds positions)
plus a list of consumers. Publishing appends to the store and, if anybody
consumes, schedules one delivery pass on the event loop (coalesced: many
publishes in one read batch cost one pass). A pass hands messages round-robin
to consumers that have capacity (``Consumer.ready()``: prefetch, channel
flow, the connection's write buffer) until the queue is empty, nobody has
capacity, or a per-pass budget is spent, in which case it reschedules itself
so other queues and connections get their turn. Whoever frees capacity (an
ack, a cancel, a drained socket) calls ``schedule_delivery()`` again.

A consumer is anything with ``ready()`` and ``deliver(...)``: the AMQP
session implements it; MQTT or HTTP could too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broker.model.fastpaths import FastPaths
from broker.store.queue_store import QueueStore
from broker.store.segment import short_pair

if TYPE_CHECKING:
    from broker.model.features import QueueFeatures

_PASS_BUDGET = 4096  # deliveries per pass before yielding to the loop
_PASS_BYTES = 4 * 1024 * 1024  # body bytes per pass: flushes run before the next pass


class Consumer:
    """Base consumer. Subclasses override ``ready`` and ``deliver``."""

    __slots__ = ("tag", "queue", "no_ack", "exclusive", "arguments")

    def __init__(self, tag: str, queue: Queue, no_ack: bool, exclusive: bool,
                 arguments: dict[str, Any] | None = None) -> None:
        self.tag = tag
        self.queue = queue
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.arguments = arguments or {}

    def ready(self) -> bool:
        return True

    def deliver(self, msgid: int, exchange: bytes, routing_key: bytes, props: bytes,
                body: bytes, redelivered: bool) -> None:
        raise NotImplementedError

    def capacity(self) -> int:
        """How many deliveries this consumer takes right now (``ready()`` as a count)."""
        return 1 if self.ready() else 0

    def deliver_raw(self, msgid: int, exrk: bytes, props: bytes, body: bytes | memoryview,
                    redelivered: bool) -> None:
        """``deliver`` with exchange and routing key as the stored short-string pair."""
        ln = exrk[0]
        self.deliver(msgid, exrk[1 : 1 + ln], exrk[2 + ln :], props, bytes(body), redelivered)

    def deliver_same(self, msgids: range | None, exrk: bytes, props: bytes, bodies: list[bytes]) -> None:
        """``deliver_raw`` for a run of first-time deliveries that differ only in their
        bodies, all of one length: ``msgids[i]`` goes with ``bodies[i]``. ``msgids``
        None: autoack deliveries of a publish run that was never stored (msgid 0)."""
        if msgids is None:
            for body in bodies:
                self.deliver_raw(0, exrk, props, body, False)
        else:
            for msgid, body in zip(msgids, bodies, strict=True):
                self.deliver_raw(msgid, exrk, props, body, False)

    def deliver_unstored(self, exrk: bytes, props: list[bytes], bodies: list[bytes]) -> None:
        """Autoack deliveries of a publish run that was never stored (msgid 0), in order."""
        for p, body in zip(props, bodies, strict=True):
            self.deliver_raw(0, exrk, p, body, False)

    def cancelled_by_server(self) -> None:
        """The queue went away; tell the client if it wants to know."""


class Queue:
    __slots__ = (
        "vhost", "name", "durable", "exclusive_owner", "auto_delete", "arguments", "store",
        "consumers", "_schedule", "_scheduled", "_rr", "deleted", "had_consumers", "on_unused",
        "name_bytes", "on_dirty", "n_published", "n_delivered", "n_acked", "n_redelivered",
        "features", "fast",
    )

    def __init__(
        self,
        vhost: str,
        name: str,
        *,
        durable: bool,
        exclusive_owner: object | None,
        auto_delete: bool,
        arguments: dict[str, Any] | None,
        store: QueueStore,
        schedule: Callable[[Callable[[], None]], object],
        on_unused: Callable[[Queue], None],
        on_dirty: Callable[[QueueStore], None],
        fast: FastPaths | None = None,
    ) -> None:
        self.vhost = vhost
        self.name = name
        self.name_bytes = name.encode()
        self.durable = durable
        self.exclusive_owner = exclusive_owner
        self.auto_delete = auto_delete
        self.arguments = dict(arguments or {})
        self.store = store
        self.consumers: list[Consumer] = []
        self._schedule = schedule
        self._scheduled = False
        self._rr = 0
        self.deleted = False
        self.had_consumers = False
        self.on_unused = on_unused
        self.on_dirty = on_dirty
        # Monotonic counters read by the management API and /metrics at scrape time.
        self.n_published = 0
        self.n_delivered = 0
        self.n_acked = 0
        self.n_redelivered = 0
        # TTL, limits, DLX, priorities...: None on a plain queue (see broker/model/features.py).
        self.features: QueueFeatures | None = None
        # direct hand-over and delivery runs on (the vhost's switch; tests turn it off)
        self.fast = fast if fast is not None else FastPaths()

    # ------------------------------------------------------------ publishing
    def publish(self, ts: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes | memoryview,
                persistent: bool, exrk: bytes | None = None) -> bool | None:
        """Append (and wake consumers); False when a length limit refused the message.

        ``exrk``: exchange and routing key as two AMQP short strings, if the
        caller has them already (saves building them for a direct delivery).
        """
        if self.features is not None:
            if type(body) is memoryview:  # a large body as a view of the read buffer
                body = bytes(body)
            return self.features.publish(ts, exchange, routing_key, props, body, persistent)
        store = self.store
        if self.consumers and not store.ready_count and self.fast.on:
            # Nothing waits: hand the message straight to a consumer with capacity.
            c = self._next_consumer()
            if c is not None:
                if exrk is None:
                    exrk = short_pair(exchange, routing_key)
                if c.no_ack:
                    # Delivered and settled at once: the store never needs to see it.
                    msgid = 0
                else:
                    # Stored as usual (it may be requeued or the broker may crash before
                    # the ack), then taken at once: no delivery pass, no re-read.
                    msgid = store.append_taken(ts, exchange, routing_key, props, body)
                    if persistent and self.durable:
                        self.on_dirty(store)
                self.n_published += 1
                self.n_delivered += 1
                c.deliver_raw(msgid, exrk, props, body, False)
                return None
        store.append(ts, exchange, routing_key, props, body)
        self.n_published += 1
        if persistent and self.durable:
            self.on_dirty(self.store)
        if self.consumers and not self._scheduled:
            self._scheduled = True
            self._schedule(self._deliver)
        return None

    def publish_run(self, ts: int, exchange: bytes, routing_key: bytes, props: list[bytes],
                    bodies: list[bytes], persistent: bool, exrk: bytes, same: bool) -> None:
        """``publish`` for a run of messages to this queue (``props[i]``, ``bodies[i]``;
        ``same``: one properties object and one body length for all), on a queue without
        features: what consumers take now is handed over directly, the rest is appended
        to the store as one run. ``persistent``: any of them is."""
        store = self.store
        i = 0
        k = len(bodies)
        if self.consumers and not store.ready_count:
            consumers = self.consumers
            if len(consumers) == 1:
                c = consumers[0]
                room = c.capacity()
                if room > 0 and c.no_ack:
                    # autoack: delivered and settled at once, never stored
                    self.n_published += k
                    self.n_delivered += k
                    if same:
                        c.deliver_same(None, exrk, props[0], bodies)
                    else:
                        c.deliver_unstored(exrk, props, bodies)
                    return
                if room > 0:
                    # manual ack: store what the consumer has room for and hand it over at
                    # once; nothing else was ready, so those are the records a delivery
                    # run takes (as runs, without a pass of its own)
                    i = min(room, k)
                    store.append_run(ts, exrk, props[:i], bodies[:i], same)
                    self.n_published += i
                    if persistent and self.durable:
                        self.on_dirty(store)
                    self.n_delivered += store.deliver_run(i, False, c.deliver_raw, 1 << 62, c.deliver_same)[0]
                    if i == k:
                        return
            else:
                # one by one while consumers take them; once one is stored (nobody had
                # room), the rest follows it into the store as a run
                while i < k and not store.ready_count:
                    self.publish(ts, exchange, routing_key, props[i], bodies[i], persistent, exrk)
                    i += 1
                if i == k:
                    return
        if i:
            props = props[i:]
            bodies = bodies[i:]
        store.append_run(ts, exrk, props, bodies, same)
        self.n_published += len(bodies)
        if persistent and self.durable:
            self.on_dirty(store)
        if self.consumers and not self._scheduled:
            self._scheduled = True
            self._schedule(self._deliver)

    def _next_consumer(self) -> Consumer | None:
        """The next consumer, round-robin, that takes a delivery now, or None."""
        consumers = self.consumers
        n = len(consumers)
        if n == 1:
            c = consumers[0]
            return c if c.capacity() > 0 else None
        start = self._rr
        for i in range(n):
            c = consumers[(start + i) % n]
            if c.ready():
                self._rr = (start + i + 1) % n
                return c
        return None

    @property
    def message_count(self) -> int:
        return self.store.ready_count

    @property
    def consumer_count(self) -> int:
        return len(self.consumers)

    # ------------------------------------------------------------- consumers
    def add_consumer(self, consumer: Consumer) -> None:
        self.consumers.append(consumer)
        self.had_consumers = True
        if self.features is not None or "x-priority" in consumer.arguments:
            from broker.model import features
            features.ensure(self).consumers_changed()
        self.schedule_delivery()

    def remove_consumer(self, consumer: Consumer) -> None:
        try:
            self.consumers.remove(consumer)
        except ValueError:
            return
        if self.features is not None:
            self.features.consumers_changed()
        if not self.consumers and self.auto_delete and self.had_consumers and not self.deleted:
            self.on_unused(self)

    def schedule_delivery(self) -> None:
        if not self._scheduled and self.consumers and not self.deleted:
            self._scheduled = True
            self._schedule(self._deliver)

    def _deliver(self) -> None:
        """One delivery pass, for every classic queue. Without per-message work (no
        features, or features that only matter at publish or settlement) a single consumer
        takes runs straight from the store and several take turns; with it (expiry,
        delivery counts, deduplication, priorities, single active consumer, consumer
        priorities) the features pick the consumer and take each message (``take``)."""
        self._scheduled = False
        if self.deleted:
            return
        f = self.features
        store = self.store
        plain = f is None or not f.per_message
        consumers = self.consumers
        budget = _PASS_BUDGET
        nbytes = 0  # body bytes handed out in this pass: bounds the output buffers
        delivered = redelivered_n = 0
        now = f.pass_started() if f is not None else 0
        try:
            while budget > 0 and consumers and store.ready_count:
                if plain and len(consumers) == 1:
                    # One consumer: ask its capacity once and hand it a run of messages.
                    c = consumers[0]
                    k = min(c.capacity(), budget)
                    if k <= 0:
                        return  # no capacity; whoever frees some reschedules us
                    same = c.deliver_same if self.fast.on else None
                    got_n, red_n, nb = store.deliver_run(k, c.no_ack, c.deliver_raw, _PASS_BYTES - nbytes,
                                                         same)
                    delivered += got_n
                    redelivered_n += red_n
                    nbytes += nb
                    if got_n < k and nbytes <= _PASS_BYTES:
                        return  # the queue is empty
                    budget -= got_n
                else:
                    # Round-robin (or by the features' rules), one message each.
                    rr = self._next_consumer() if f is None else f.pick()
                    if rr is None:
                        return  # nobody has capacity; whoever frees some reschedules us
                    budget -= 1
                    if plain:
                        got = store.next_delivery(rr.no_ack)
                        if got is None:
                            return
                        delivered += 1
                        redelivered_n += got[4]
                        nbytes += len(got[3])
                        rr.deliver_raw(*got)
                    else:
                        assert f is not None
                        m = f.take(rr.no_ack, now)
                        if m is None:
                            return
                        if m is False:
                            continue  # an expired head, dead-lettered
                        delivered += 1
                        redelivered_n += m[5]
                        nbytes += len(m[4])
                        rr.deliver(*m)
                if nbytes > _PASS_BYTES:
                    budget = 0  # let the output drain first
            if budget <= 0:
                self.schedule_delivery()
        finally:
            if plain:
                store.end_pass()
            self.n_delivered += delivered
            self.n_redelivered += redelivered_n
            if f is not None:
                f.pass_done(budget <= 0)

    # ------------------------------------------------------- get and settlement
    # One implementation for every queue; a queue with features contributes hooks
    # (broker/model/features.py): expiry before a get, x-delivery-count and deduplication
    # bookkeeping when a message is taken, forgotten or requeued, the delivery limit and
    # dead-lettering when one is rejected.
    def get(self) -> tuple[int, bytes, bytes, bytes, bytes, bool] | None:
        f = self.features
        if f is not None:
            f.before_get()
        store = self.store
        msgid = store.shift()
        if msgid is None:
            return None
        _ts, exchange, routing_key, props, body = store.read(msgid)
        redelivered = store.is_redelivered(msgid)
        if f is not None:
            props = f.taken(msgid, props)
        self.n_delivered += 1
        self.n_redelivered += redelivered
        return msgid, exchange, routing_key, props, body, redelivered

    def ack(self, msgid: int) -> None:
        if self.deleted:
            return
        self.store.ack(msgid)
        self.n_acked += 1
        if self.features is not None:
            self.features.forget(msgid)
        if self.durable:
            self.on_dirty(self.store)

    def ack_many(self, msgids: list[int]) -> None:
        if self.deleted:
            return
        f = self.features
        if f is not None and f.pstore is not None:  # one store per priority: acked one by one
            for msgid in msgids:
                self.ack(msgid)
            return
        self.store.ack_many(msgids)
        self.n_acked += len(msgids)
        if f is not None:
            for msgid in msgids:
                f.forget(msgid)
        if self.durable:
            self.on_dirty(self.store)

    def reject(self, msgid: int, requeue: bool) -> None:
        """basic.reject/nack: requeue, or settle it (dead-lettered when the queue has a
        dead-letter exchange); over ``x-delivery-limit`` a requeue becomes a dead letter."""
        if self.deleted:
            return
        f = self.features
        reason = "rejected"
        if requeue and f is not None and not f.may_requeue(msgid):
            requeue = False
            reason = "delivery_limit"
        if requeue:
            self.store.requeue(msgid)
            if f is not None:
                f.requeued(msgid)
            self.schedule_delivery()
            return
        if f is not None and f.dead_letters:
            _ts, exchange, routing_key, props, body = self.store.read(msgid)
            f.dead_letter(msgid, exchange, routing_key, props, body, reason, self.ack)
        else:
            self.ack(msgid)

    def purge(self) -> int:
        n = self.store.purge()
        if self.features is not None:
            self.features.purged()  # e.g. deduplication forgets the purged messages
        if self.durable:
            self.on_dirty(self.store)
        return n

    def close(self) -> None:
        self.store.close()

    def delete(self) -> None:
        """Remove the queue and its files; consumers get a server-side cancel."""
        self.deleted = True
        if self.features is not None:
            self.features.close()
        consumers, self.consumers = self.consumers, []
        for c in consumers:
            c.cancelled_by_server()
        self.store.delete()
