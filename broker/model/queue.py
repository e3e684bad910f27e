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

Fairness: a pass runs inside one loop turn, and no other connection's frame
is read until it ends, so the budget (``_PASS_BUDGET`` deliveries,
``_PASS_BYTES`` body bytes) is the longest any client waits behind a backlog
being drained: a synchronous publisher's next publish, its confirm, a
heartbeat. The rescheduled pass runs on a later turn, after the loop has
polled the sockets. The bound is a count, not a clock, so it holds the same
on a loaded machine; it is sized so a pass is about a millisecond of work
(an autoack delivery is about 6,000 instructions) while its fixed cost
(scheduling, the store's end of pass, one write to the consumer's socket)
stays a few per cent of the deliveries' (issue 31: 4,096 per pass left a
publisher waiting behind 4,096 deliveries).

A consumer is anything with ``ready()`` and ``deliver(...)``: the AMQP
session implements it; MQTT or HTTP could too.

One engine, several types. ``Queue`` is what every queue is to the rest of the
broker (identity, consumers, counters, the operations a protocol calls);
``ClassicQueue`` is the engine on an ordered ``MessageStore``
(broker/store/api.py): publish with direct hand-over and runs, the delivery pass,
get and settlement. Variants are subclasses chosen when the queue is declared or
a policy changes (broker/model/queue_featured.py): ``FeaturedQueue`` adds
admission and after-effects to publish (limits, deduplication, TTL) and per-message
hooks to the same delivery pass and settlement; ``QuorumQueue`` its type's
defaults; a priority queue is a featured queue on a ``PriorityStore``; a stream
(broker/model/stream.py) reads an append-only log by offset. A plain queue checks
nothing per message: the variant is its class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal, Protocol

from broker.model.fastpaths import FastPaths
from broker.store.api import MessageStore, QueueCounters
from broker.store.queue_store import QueueStore
from broker.store.segment import short_pair

Taken = tuple[int, bytes, bytes, bytes, bytes, bool]  # msgid, exchange, routing key, props, body, redelivered

_PASS_BUDGET = 512  # deliveries per pass before yielding to the loop (see Fairness above)
_PASS_BYTES = 512 * 1024  # body bytes per pass: flushes run before the next pass


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

    def deliver_many(self, msgids: list[int] | None, exrk: bytes, props: list[bytes],
                     bodies: list[bytes]) -> None:
        """``deliver_raw`` for first-time deliveries with one exchange and routing key, in
        order: ``msgids[i]`` goes with ``props[i]`` and ``bodies[i]`` (None: msgid 0, a publish
        run never stored, autoack)."""
        for msgid, p, body in zip(msgids or [0] * len(bodies), props, bodies, strict=True):
            self.deliver_raw(msgid, exrk, p, body, False)

    def cancelled_by_server(self) -> None:
        """The queue went away; tell the client if it wants to know."""


class Variants(Protocol):
    """How a classic queue becomes its featured variant (broker/model/queue_featured.py
    ``Promotion``) when it meets a feature no declare or policy asked for. Whoever builds the
    queue hands it in (the vhost): the engine imports none of its variants."""

    def expiration_seen(self, q: ClassicQueue) -> None:
        """A message with an ``expiration`` property reached ``q``: check its head's expiry."""

    def priority_consumer(self, q: ClassicQueue) -> None:
        """A consumer with ``x-priority`` joined ``q``: order its consumers by priority."""


class Queue:
    """What every queue type is to the rest of the broker (see the module doc)."""

    __slots__ = (
        "vhost", "name", "durable", "exclusive_owner", "auto_delete", "arguments", "store",
        "consumers", "_schedule", "_scheduled", "_rr", "deleted", "had_consumers", "on_unused",
        "name_bytes", "on_dirty", "n_published", "n_delivered", "n_acked", "n_redelivered", "n_gets",
        "n_gets_no_ack", "n_get_empty",
        "features", "fast", "variants", "paused",
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
        store: QueueCounters,
        schedule: Callable[[Callable[[], None]], object],
        on_unused: Callable[[Queue], None],
        on_dirty: Callable[[Any], None],
        fast: FastPaths | None = None,
        variants: Variants | None = None,
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
        self.n_gets = 0  # of n_delivered: basic.get
        self.n_gets_no_ack = 0  # of n_gets: without acknowledgement (counted by the protocol)
        self.n_get_empty = 0  # a get that found the queue empty
        # TTL, limits, DLX, priorities...: a FeaturedQueue's state (broker/model/features.py
        # ``QueueFeatures``; the engine only keeps it, its variants read it)
        self.features: object | None = None
        # direct hand-over and delivery runs on (the vhost's switch; tests turn it off)
        self.fast = fast if fast is not None else FastPaths()
        # how a classic queue becomes featured (None: it stays what it is)
        self.variants = variants
        # Paused (LavinMQ's pause): publishes are taken, nothing is delivered or got until
        # resumed. Set by ``VHost.pause_queue``, which logs it with the queue's definition.
        self.paused = False

    @property
    def dead_letters(self) -> bool:
        """Whether a message this queue refuses goes to a dead-letter exchange (its features'
        DLX), rather than being dropped."""
        return bool(getattr(self.features, "dead_letters", False))

    @property
    def consumer_count(self) -> int:
        return len(self.consumers)

    # ------------------------------------------------------------- consumers
    def add_consumer(self, consumer: Consumer) -> None:
        self.consumers.append(consumer)
        self.had_consumers = True
        self._consumers_changed(consumer)
        self.schedule_delivery()

    def remove_consumer(self, consumer: Consumer) -> None:
        try:
            self.consumers.remove(consumer)
        except ValueError:
            return
        self._consumers_changed(None)
        if not self.consumers and self.auto_delete and self.had_consumers and not self.deleted:
            self.on_unused(self)

    def check_consume(self, no_ack: bool, prefetch: int, global_prefetch: int,
                      arguments: dict[str, Any]) -> None:
        """Refuse a consumer this queue type does not take (before it is accepted)."""

    def _consumers_changed(self, added: Consumer | None) -> None:
        """A consumer came (``added``) or went: a type that orders consumers hears of it."""

    def touch(self) -> None:
        """A use that restarts an ``x-expires`` queue's idle clock (a redeclare)."""

    def expiration_seen(self) -> None:
        """A message with an ``expiration`` property reached this queue."""

    def schedule_delivery(self) -> None:
        if not self._scheduled and self.consumers and not self.deleted and not self.paused:
            self._scheduled = True
            self._schedule(self._deliver)

    # ------------------------------------------- what each type implements
    def publish(self, ts: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes | memoryview,
                persistent: bool, exrk: bytes | None = None) -> bool | None:
        """Append (and wake consumers); False when the queue refused the message."""
        raise NotImplementedError

    def publish_run(self, ts: int, exchange: bytes, routing_key: bytes, props: list[bytes],
                    bodies: list[bytes], persistent: bool, exrk: bytes, same: bool) -> None:
        """``publish`` for each message of a run (a type with a faster way overrides it)."""
        for p, body in zip(props, bodies, strict=True):
            self.publish(ts, exchange, routing_key, p, body, persistent, exrk)

    @property
    def message_count(self) -> int:
        return self.store.ready_count

    def _deliver(self) -> None:
        raise NotImplementedError

    def get(self) -> tuple[int, bytes, bytes, bytes, bytes, bool] | None:
        raise NotImplementedError

    def ack(self, msgid: int) -> None:
        raise NotImplementedError

    def ack_many(self, msgids: list[int]) -> None:
        for msgid in msgids:
            self.ack(msgid)

    def reject(self, msgid: int, requeue: bool) -> None:
        raise NotImplementedError

    def purge(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        self.store.close()

    def delete(self) -> None:
        raise NotImplementedError


class ClassicQueue(Queue):
    """The engine on an ordered store: a plain classic queue, and the base of its variants."""

    __slots__ = ()
    store: MessageStore
    # The type honours ``x-dead-letter-strategy: at-least-once`` (quorum queues, as in RabbitMQ);
    # the others dead-letter at most once whatever the argument says (broker/model/features.py).
    at_least_once_dead_letters: ClassVar[bool] = False

    # ------------------------------------------------------------ publishing
    def publish(self, ts: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes | memoryview,
                persistent: bool, exrk: bytes | None = None) -> bool | None:
        """Append (and wake consumers).

        ``exrk``: exchange and routing key as two AMQP short strings, if the
        caller has them already (saves building them for a direct delivery).
        """
        store = self.store
        if self.consumers and not store.ready_count and self.fast.on and not self.paused:
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
        ``same``: one properties object and one body length for all): what consumers
        take now is handed over directly, the rest is appended to the store as one run.
        ``persistent``: any of them is. Whatever of it is stored has room made for all of it
        first (a full disk: DiskFull before anything is stored)."""
        store = self.store
        i = 0
        k = len(bodies)
        consumers = self.consumers
        single = None  # the one consumer that may take some of it now
        room = 0
        if consumers and not store.ready_count and len(consumers) == 1 and not self.paused:
            single = consumers[0]
            room = single.capacity()
            if room > 0 and single.no_ack:
                # autoack: delivered and settled at once, never stored
                self.n_published += k
                self.n_delivered += k
                if same:
                    single.deliver_same(None, exrk, props[0], bodies)
                else:
                    single.deliver_many(None, exrk, props, bodies)
                return
        # some of it is stored: room for all of it first
        store.make_room(QueueStore.run_size(exrk, props, bodies, same), props[0], ts)
        if single is not None and room > 0:
            # manual ack: store what the consumer has room for and hand it over at once;
            # nothing else was ready, so those are the records a delivery run takes (as
            # runs, without a pass of its own)
            c = single
            i = min(room, k)
            handed_p, handed_b = props[:i], bodies[:i]
            fast = self.fast.on
            taken = None
            if fast:  # their msgids, unless they stay ready for deliver_run
                taken = store.append_run_taken(ts, exrk, handed_p, handed_b, same)
            else:
                store.append_run(ts, exrk, handed_p, handed_b, same)
            self.n_published += i
            if persistent and self.durable:
                self.on_dirty(store)
            if taken is not None:  # handed over with the bytes in hand
                self.n_delivered += i
                c.deliver_many(taken, exrk, handed_p, handed_b)
            else:
                self.n_delivered += store.deliver_run(i, False, c.deliver_raw, 1 << 62,
                                                      c.deliver_same if fast else None,
                                                      c.deliver_many if fast else None)[0]
            if i == k:
                return
        elif len(consumers) > 1 and not store.ready_count:
            # one by one while consumers take them; once one is stored (nobody had room),
            # the rest follows it into the store as a run
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

    _pick = _next_consumer  # the consumer for the next message (a variant may order them)

    # ------------------------------------------------------------- delivery
    @property
    def per_message(self) -> bool:
        """Whether deliveries need per-message work (``_take``); a plain queue's never do."""
        return False

    def _pass_started(self) -> int:
        """A delivery pass begins: the time its expiry checks use (ms; 0 when none)."""
        return 0

    def _take(self, autoack: bool, now: int) -> Taken | Literal[False] | None:
        """The head for a delivery with per-message work (only when ``per_message``)."""
        raise NotImplementedError

    def _pass_done(self, more: bool) -> None:
        """A delivery pass ended (``more``: it ran out of budget and rescheduled itself)."""

    def _deliver(self) -> None:
        """One delivery pass, for every classic queue type. Without per-message work (a
        plain queue, or features that only matter at publish or settlement) a single
        consumer takes runs straight from the store and several take turns; with it
        (expiry, delivery counts, deduplication, single active consumer, consumer
        priorities) the type picks the consumer (``_pick``) and takes each message
        (``_take``)."""
        self._scheduled = False
        if self.deleted or self.paused:
            return
        store = self.store
        plain = not self.per_message
        consumers = self.consumers
        budget = _PASS_BUDGET
        nbytes = 0  # body bytes handed out in this pass: bounds the output buffers
        delivered = redelivered_n = 0
        now = self._pass_started()
        try:
            while budget > 0 and consumers and store.ready_count:
                if plain and len(consumers) == 1:
                    # One consumer: ask its capacity once and hand it a run of messages.
                    c = consumers[0]
                    k = min(c.capacity(), budget)
                    if k <= 0:
                        return  # no capacity; whoever frees some reschedules us
                    fast = self.fast.on
                    got_n, red_n, nb = store.deliver_run(k, c.no_ack, c.deliver_raw, _PASS_BYTES - nbytes,
                                                         c.deliver_same if fast else None,
                                                         c.deliver_many if fast else None)
                    delivered += got_n
                    redelivered_n += red_n
                    nbytes += nb
                    if got_n < k and nbytes <= _PASS_BYTES:
                        return  # the queue is empty
                    budget -= got_n
                else:
                    # Round-robin (or by the features' rules), one message each.
                    rr = self._pick()
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
                        m = self._take(rr.no_ack, now)
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
            self._pass_done(budget <= 0)

    # ------------------------------------------------------- get and settlement
    # One implementation for every classic queue type; a variant adds its bookkeeping
    # around these (broker/model/queue_featured.py).
    def get(self) -> tuple[int, bytes, bytes, bytes, bytes, bool] | None:
        store = self.store
        msgid = store.shift()
        if msgid is None:
            self.n_get_empty += 1
            return None
        _ts, exchange, routing_key, props, body = store.read(msgid)
        redelivered = store.is_redelivered(msgid)
        self.n_delivered += 1
        self.n_gets += 1
        self.n_redelivered += redelivered
        return msgid, exchange, routing_key, props, body, redelivered

    def ack(self, msgid: int) -> None:
        if self.deleted:
            return
        self.store.ack(msgid)
        self.n_acked += 1
        if self.durable:
            self.on_dirty(self.store)

    def ack_many(self, msgids: list[int]) -> None:
        if self.deleted:
            return
        self.store.ack_many(msgids)
        self.n_acked += len(msgids)
        if self.durable:
            self.on_dirty(self.store)

    def reject(self, msgid: int, requeue: bool) -> None:
        """basic.reject/nack: requeue, or settle it."""
        if self.deleted:
            return
        if requeue:
            self.store.requeue(msgid)
            self.schedule_delivery()
            return
        self.ack(msgid)

    def purge(self) -> int:
        n = self.store.purge()
        if self.durable:
            self.on_dirty(self.store)
        return n

    def delete(self) -> None:
        """Remove the queue and its files; consumers get a server-side cancel."""
        self.deleted = True
        consumers, self.consumers = self.consumers, []
        for c in consumers:
            c.cancelled_by_server()
        self.store.delete()

    def expiration_seen(self) -> None:
        # per-message TTLs: the featured engine checks the head's expiry from now on
        if self.variants is not None:
            self.variants.expiration_seen(self)

    def _consumers_changed(self, added: Consumer | None) -> None:
        if added is not None and "x-priority" in added.arguments and self.variants is not None:
            # consumer priorities order the consumers: the featured engine does that
            self.variants.priority_consumer(self)
