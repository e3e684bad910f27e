"""Queue variants are types chosen at declare or when a policy changes (broker/model/queue_featured.py):
the same object changes class in place, so whoever holds it keeps it, and a plain queue is a
``ClassicQueue`` that checks no feature per message."""

from __future__ import annotations

from pathlib import Path

import pytest
from pamqp import commands
from test_features_policy import _vhost

from broker import errors, properties
from broker.model.publish import PublishRequest
from broker.model.queue import ClassicQueue, Consumer, Queue
from broker.model.queue_featured import FeaturedQueue, QuorumQueue
from broker.model.stream import StreamQueue
from broker.store.priority_store import PriorityStore
from broker.store.queue_store import QueueStore


class _Sink(Consumer):
    __slots__ = ("got",)

    def __init__(self, queue: Queue, arguments: dict[str, int] | None = None) -> None:
        super().__init__("c", queue, True, False, dict(arguments or {}))
        self.got: list[bytes] = []

    def deliver(self, msgid: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes,
                redelivered: bool) -> None:
        self.got.append(body)


def test_declare_chooses_the_type(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    plain, _ = vh.declare_queue("plain", owner=None)
    ttl, _ = vh.declare_queue("ttl", owner=None, arguments={"x-message-ttl": 1000})
    prio, _ = vh.declare_queue("prio", owner=None, arguments={"x-max-priority": 3})
    quorum, _ = vh.declare_queue("q", owner=None, durable=True, arguments={"x-queue-type": "quorum"})
    stream, _ = vh.declare_queue("s", owner=None, durable=True, arguments={"x-queue-type": "stream"})
    assert type(plain) is ClassicQueue and plain.features is None
    assert type(ttl) is FeaturedQueue and ttl.features is not None
    assert type(prio) is FeaturedQueue and isinstance(prio.store, PriorityStore)
    assert type(quorum) is QuorumQueue and quorum.features is not None
    assert quorum.features.cfg.delivery_limit == 20  # RabbitMQ 4's quorum default
    assert type(stream) is StreamQueue
    assert isinstance(plain.store, QueueStore)


def test_a_policy_changes_the_type_in_place(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    q, _ = vh.declare_queue("orders", owner=None)
    assert type(q) is ClassicQueue
    vh.set_policy("cap", "^ord", {"max-length": 2}, apply_to="queues")
    assert vh.queues["orders"] is q and type(q) is FeaturedQueue  # same object, new type
    for i in range(4):
        q.publish(1, b"", b"orders", b"\x00\x00", b"%d" % i, False)
    assert q.message_count == 2  # the featured publish applies drop-head


def test_a_message_ttl_or_a_consumer_priority_makes_a_queue_featured(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    a, _ = vh.declare_queue("a", owner=None)
    b, _ = vh.declare_queue("b", owner=None)
    props = properties.encode(commands.Basic.Properties(expiration="60000"))
    vh.publish(PublishRequest("", "a", props, b"x", 1))
    assert type(a) is FeaturedQueue and a.features is not None and a.features.msg_ttl_seen
    c = _Sink(b, {"x-priority": 5})
    b.add_consumer(c)
    assert type(b) is FeaturedQueue and b.consumers == [c]
    b.publish(1, b"", b"b", b"\x00\x00", b"hello", False)
    assert c.got == [b"hello"]  # delivered by the same pass, through the featured hooks


def test_quorum_refuses_a_global_prefetch_stream_a_no_ack_consumer(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    quorum, _ = vh.declare_queue("q", owner=None, durable=True, arguments={"x-queue-type": "quorum"})
    stream, _ = vh.declare_queue("s", owner=None, durable=True, arguments={"x-queue-type": "stream"})
    plain, _ = vh.declare_queue("p", owner=None)
    with pytest.raises(errors.AMQPNotImplemented):
        quorum.check_consume(False, 0, 10, {})
    with pytest.raises(errors.PreconditionFailed):
        stream.check_consume(True, 10, 0, {})
    plain.check_consume(True, 0, 10, {})
    quorum.check_consume(False, 10, 0, {})


@pytest.mark.parametrize("qtype,kept", [("quorum", True), ("classic", False)])
def test_the_dead_letter_strategy_is_the_queue_types(tmp_path: Path, qtype: str, kept: bool) -> None:
    """``x-dead-letter-strategy: at-least-once`` is a quorum queue's: a dead letter that the target
    refuses stays in the source until a retry places it; a classic queue ignores the argument
    and drops it (at most once), as RabbitMQ does."""
    vh = _vhost(tmp_path)
    target, _ = vh.declare_queue("target", owner=None, durable=True,
                                 arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    target.publish(1, b"", b"target", b"\x00\x00", b"filler", False)
    src, _ = vh.declare_queue("src", owner=None, durable=True, arguments={
        "x-queue-type": qtype, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "target",
        "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
    src.publish(1, b"", b"src", b"\x00\x00", b"a", False)
    got = src.get()
    assert got is not None
    src.reject(got[0], False)  # the full target refuses the dead letter
    assert target.message_count == 1
    assert src.features is not None and bool(src.features.dl_pending) is kept
    assert (src.store.unacked_count == 1) is kept
