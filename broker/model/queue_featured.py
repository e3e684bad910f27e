"""Classic queue variants: the types a queue becomes at declare or when a policy changes.

Theory of operation
-------------------
Every classic queue starts as a ``ClassicQueue`` (broker/model/queue.py). ``attach``
computes its effective config from its arguments and the vhost's policies, at declare
(so also at boot) and after every policy change; a queue whose config asks for any
feature (TTL, limits, dead-lettering, delivery limit, priorities, single active
consumer, deduplication), a queue of a type with defaults of its own (quorum), one
that received a message with an ``expiration`` or a consumer with ``x-priority``
becomes one of these types, for the rest of its life:

- ``FeaturedQueue``: publish is admission (deduplication, reject-publish limits) +
  the append + after-effects (drop-head, TTL); the delivery pass and settlement are
  ``ClassicQueue``'s, with the per-message hooks of its ``QueueFeatures``
  (broker/model/features.py). A priority queue is a featured queue whose store is a
  ``PriorityStore`` (chosen at declare by ``x-max-priority``, which no policy sets).
- ``QuorumQueue``: a featured queue (its delivery limit of 20 unless set makes it one,
  broker/model/queue_types.py) with its type's consumer rule (no global prefetch) and
  its dead-letter strategy (``at-least-once`` is honoured).

The engine imports none of this: a classic queue that meets a message with an
``expiration`` or a consumer with ``x-priority`` asks the ``queue.Variants`` its vhost
handed it (``Promotion`` here) to make it featured.

A type change is a class change of the same object (``__class__``; the types share
one slot layout), so sessions, consumers and bindings that hold the queue keep it.
Delayed messages are an exchange's behaviour (broker/model/exchange_features.py), not
a queue type; streams are ``StreamQueue`` (broker/model/stream.py).
"""

from __future__ import annotations

from typing import Any, Literal, cast

from broker.model import queue_types
from broker.model.features import CallLater, QueueConfig, QueueFeatures, effective_config
from broker.model.publish_api import Republisher
from broker.model.queue import ClassicQueue, Consumer, Taken


class FeaturedQueue(ClassicQueue):
    __slots__ = ()
    features: QueueFeatures

    # ------------------------------------------------------------ publishing
    # (publish_run hands a featured queue no runs: admission and after-effects are per message)
    def publish(self, ts: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes | memoryview,
                persistent: bool, exrk: bytes | None = None) -> bool | None:
        """Append unless the features refuse or drop it; False when refused."""
        f = self.features
        if type(body) is memoryview:  # a large body as a view of the read buffer
            body = bytes(body)
        verdict, key = f.admit(exchange, routing_key, props, body)
        if verdict is not None:
            return verdict
        store = self.store
        msgid = store.append(ts, exchange, routing_key, props, body)
        self.n_published += 1
        if persistent and self.durable:
            self.on_dirty(store)
        f.appended(msgid, key, props)
        if self.consumers:
            self.schedule_delivery()
        return True

    # ------------------------------------------------ hooks of the delivery pass
    @property
    def per_message(self) -> bool:
        return self.features.per_message

    def _pass_started(self) -> int:
        return self.features.pass_started()

    def _pick(self) -> Consumer | None:
        return self.features.pick()

    def _take(self, autoack: bool, now: int) -> Taken | Literal[False] | None:
        return self.features.take(autoack, now)

    def _pass_done(self, more: bool) -> None:
        self.features.pass_done(more)

    def _consumers_changed(self, added: Consumer | None) -> None:
        self.features.consumers_changed()

    def touch(self) -> None:
        self.features.touch()

    # ------------------------------------------------------- get and settlement
    def get(self) -> tuple[int, bytes, bytes, bytes, bytes, bool] | None:
        f = self.features
        f.before_get()
        got = ClassicQueue.get(self)
        if got is None:
            return None
        msgid, exchange, routing_key, props, body, redelivered = got
        return msgid, exchange, routing_key, f.taken(msgid, props), body, redelivered

    def ack(self, msgid: int) -> None:
        ClassicQueue.ack(self, msgid)
        self.features.forget(msgid)

    def ack_many(self, msgids: list[int]) -> None:
        ClassicQueue.ack_many(self, msgids)
        forget = self.features.forget
        for msgid in msgids:
            forget(msgid)

    def reject(self, msgid: int, requeue: bool) -> None:
        """Requeue, or settle it: dead-lettered when the queue has a dead-letter exchange;
        over ``x-delivery-limit`` a requeue becomes a dead letter."""
        if self.deleted:
            return
        f = self.features
        reason = "rejected"
        if requeue and not f.may_requeue(msgid):
            requeue = False
            reason = "delivery_limit"
        if requeue:
            ClassicQueue.reject(self, msgid, True)
            f.requeued(msgid)
        elif f.dead_letters:
            _ts, exchange, routing_key, props, body = self.store.read(msgid)
            f.dead_letter(msgid, exchange, routing_key, props, body, reason, self.ack)
        else:
            self.ack(msgid)

    def purge(self) -> int:
        n = ClassicQueue.purge(self)
        self.features.purged()  # e.g. deduplication forgets the purged messages
        return n

    def delete(self) -> None:
        self.features.close()
        ClassicQueue.delete(self)


class QuorumQueue(FeaturedQueue):
    __slots__ = ()
    at_least_once_dead_letters = True  # x-dead-letter-strategy: at-least-once applies

    def check_consume(self, no_ack: bool, prefetch: int, global_prefetch: int,
                      arguments: dict[str, Any]) -> None:
        queue_types.check_consume(self.arguments, global_prefetch, self.name, self.vhost)  # 540


def _featured_type(q: ClassicQueue) -> type[FeaturedQueue]:
    return QuorumQueue if queue_types.type_of(q.arguments) == queue_types.QUORUM else FeaturedQueue


def _become_featured(q: ClassicQueue, publisher: Republisher | None, cfg: QueueConfig,
                     call_later: CallLater | None) -> QueueFeatures:
    f = QueueFeatures(q, publisher, cfg, call_later)
    q.features = f
    if not isinstance(q, FeaturedQueue):
        q.__class__ = _featured_type(q)
    f.start()
    return f


def attach(publisher: Republisher | None, q: ClassicQueue, args_cfg: QueueConfig,
           policy: dict[str, Any] | None, operator: dict[str, Any] | None,
           call_later: CallLater | None) -> None:
    """(Re)compute a queue's effective config; make it a featured type when it needs any.
    ``publisher``: the publish operation its dead letters go through (the vhost)."""
    cfg = effective_config(args_cfg, policy, operator)
    f = cast("QueueFeatures | None", q.features)
    if f is None:
        if cfg.is_plain():
            return
        _become_featured(q, publisher, cfg, call_later)
    else:
        if publisher is not None:
            f.publisher = publisher
        if call_later is not None and f.call_later is None:
            f.call_later = call_later
        f.reconfigure(cfg)


def featured(q: ClassicQueue, publisher: Republisher | None = None,
             call_later: CallLater | None = None) -> QueueFeatures:
    """The queue's features, after making it a featured type (plain config) if it was not."""
    f = cast("QueueFeatures | None", q.features)
    if f is None:
        return _become_featured(q, publisher, QueueConfig(), call_later)
    if publisher is not None and f.publisher is None:
        f.publisher = publisher
    if call_later is not None and f.call_later is None:
        f.call_later = call_later
    return f


class Promotion:
    """``queue.Variants`` for the classic queues of one vhost: ``publisher`` and ``call_later``
    are what the vhost hands a queue's features (its publish operation, its timers)."""

    __slots__ = ("publisher", "call_later")

    def __init__(self, publisher: Republisher, call_later: CallLater | None) -> None:
        self.publisher = publisher
        self.call_later = call_later

    def expiration_seen(self, q: ClassicQueue) -> None:
        featured(q, self.publisher, self.call_later).msg_ttl_seen = True

    def priority_consumer(self, q: ClassicQueue) -> None:
        featured(q, self.publisher, self.call_later).consumers_changed()
