"""Queue-level deduplication (``x-message-deduplication`` on a queue), real broker, pika.

The module's tests share one broker (each names its own queues); the restart test has its own.
"""

from __future__ import annotations

from typing import Any

import pika
import pytest

from ._support import Broker, channel_error, connect, drain, is_external, queue_count, unique, wait_until

pytestmark = pytest.mark.skipif(is_external(), reason="Skred's queue deduplication (plugin in RabbitMQ)")

DEDUP = {"x-message-deduplication": True}


def pub(ch: Any, q: str, body: bytes, key: Any = None, persistent: bool = False) -> None:
    headers: dict[str, Any] = {"other": 1}
    if key is not None:
        headers["x-deduplication-header"] = key
    ch.basic_publish("", q, body, pika.BasicProperties(headers=headers,
                                                      delivery_mode=2 if persistent else 1))


def test_argument_must_be_boolean(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    for bad in ("yes", 1):
        with channel_error(406):
            conn.channel().queue_declare(unique("ddq"), arguments={"x-message-deduplication": bad})
    ch = conn.channel()
    q = unique("ddq")
    ch.queue_declare(q, arguments={"x-message-deduplication": False})  # off: a plain queue
    pub(ch, q, b"1", "k")
    pub(ch, q, b"2", "k")
    assert queue_count(conn, q) == 2
    conn.close()


def test_duplicate_dropped_while_in_queue_and_confirmed(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    ch.confirm_delivery()  # a nack would raise NackError: the duplicate must be acked
    q = unique("ddq")
    ch.queue_declare(q, arguments=DEDUP)
    pub(ch, q, b"a1", "a")
    pub(ch, q, b"a2", "a")  # duplicate of a ready message: dropped, still confirmed
    pub(ch, q, b"n1")
    pub(ch, q, b"n2")  # no header: never a duplicate
    pub(ch, q, b"b1", "b")
    pub(ch, q, b"a3", b"a")  # same value as a longstr
    assert queue_count(conn, q) == 4
    # Delivered but unacked still counts as "in the queue".
    m, _, body = ch.basic_get(q, auto_ack=False)
    assert m is not None and body == b"a1"
    pub(ch, q, b"a4", "a")
    assert queue_count(conn, q) == 3
    # A requeued message is back in the queue: still a duplicate.
    ch.basic_nack(m.delivery_tag, requeue=True)
    pub(ch, q, b"a5", "a")
    m, _, body = ch.basic_get(q, auto_ack=False)
    assert m is not None and body == b"a1"
    ch.basic_ack(m.delivery_tag)  # gone: the value may come again
    pub(ch, q, b"a6", "a")
    pub(ch, q, b"a7", "a")
    # Rejected without requeue (no DLX: dropped) also frees the value.
    m, _, body = ch.basic_get(q, auto_ack=False)
    assert m is not None and body == b"n1"
    ch.basic_reject(m.delivery_tag, requeue=False)
    assert drain(ch, q) == [b"n2", b"b1", b"a6"]  # no-ack gets: gone as well
    pub(ch, q, b"a8", "a")
    pub(ch, q, b"b2", "b")
    assert drain(ch, q) == [b"a8", b"b2"]
    conn.close()


def test_no_ack_consumer_and_purge_free_values(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    q = unique("ddq")
    ch.queue_declare(q, arguments=DEDUP)
    pub(ch, q, b"p1", "p")
    pub(ch, q, b"u1", "u")
    m, _, body = ch.basic_get(q, auto_ack=False)
    assert m is not None and body == b"p1"
    # p1 is unacked, u1 ready: purge removes u1 only.
    assert ch.queue_purge(q).method.message_count == 1
    pub(ch, q, b"u2", "u")  # accepted: u1 was purged
    pub(ch, q, b"p2", "p")  # dropped: p1 is still unacked
    assert queue_count(conn, q) == 1
    ch.basic_ack(m.delivery_tag)
    pub(ch, q, b"p3", "p")
    assert queue_count(conn, q) == 2
    # Deliveries to a no-ack consumer leave the queue at once.
    got: list[bytes] = []
    ch.basic_consume(q, lambda _c, _m, _p, b: got.append(bytes(b)), auto_ack=True)
    wait_until(lambda: (conn.process_data_events(0.02), len(got) == 2)[1], 5, "two deliveries")
    assert got == [b"u2", b"p3"]
    pub(ch, q, b"p4", "p")
    pub(ch, q, b"u3", "u")
    wait_until(lambda: (conn.process_data_events(0.02), len(got) == 4)[1], 5, "two more deliveries")
    assert got == [b"u2", b"p3", b"p4", b"u3"]
    conn.close()


def test_expired_and_dead_lettered_free_values(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    q, dlq = unique("ddq"), unique("dlq")
    ch.queue_declare(dlq, arguments=DEDUP)
    ch.queue_declare(q, arguments={**DEDUP, "x-message-ttl": 300, "x-dead-letter-exchange": "",
                                   "x-dead-letter-routing-key": dlq})
    pub(ch, q, b"e1", "e")
    pub(ch, q, b"e2", "e")  # dropped
    wait_until(lambda: queue_count(conn, dlq) == 1, 5, "expiry to the DLQ")
    assert queue_count(conn, q) == 0
    pub(ch, q, b"e3", "e")  # accepted: e1 left the queue
    assert queue_count(conn, q) == 1
    wait_until(lambda: queue_count(conn, q) == 0, 5, "e3 expires")
    # The dead-letter queue deduplicates too: e3 arrives with the value of e1.
    assert drain(ch, dlq) == [b"e1"]
    conn.close()


def test_values_rebuilt_after_restart(broker: Broker) -> None:
    conn = connect(broker)
    ch = conn.channel()
    ch.confirm_delivery()
    q, pq = unique("ddq"), unique("ddpq")
    ch.queue_declare(q, durable=True, arguments=DEDUP)
    ch.queue_declare(pq, durable=True, arguments={**DEDUP, "x-max-priority": 5})
    pub(ch, q, b"r1", "r1", persistent=True)
    pub(ch, q, b"r2", "r2", persistent=True)
    pub(ch, q, b"t1", "t", persistent=False)  # transient: lost at the restart
    pub(ch, q, b"x1", "x", persistent=True)
    m, _, body = ch.basic_get(q, auto_ack=False)
    assert m is not None and body == b"r1"
    ch.basic_ack(m.delivery_tag)  # r1 acked before the restart: its value is free
    ch.basic_publish("", pq, b"h1", pika.BasicProperties(
        headers={"x-deduplication-header": "h"}, priority=4, delivery_mode=2))
    ch.basic_publish("", pq, b"l1", pika.BasicProperties(
        headers={"x-deduplication-header": "l"}, delivery_mode=2))
    conn.close()
    broker.restart()
    conn = connect(broker)
    ch = conn.channel()
    ch.confirm_delivery()
    assert queue_count(conn, q) == 2  # r2, x1
    pub(ch, q, b"r2b", "r2", persistent=True)  # duplicate of a recovered message
    pub(ch, q, b"x1b", "x", persistent=True)
    pub(ch, q, b"t2", "t", persistent=True)  # t1 did not survive
    pub(ch, q, b"r1b", "r1", persistent=True)
    assert drain(ch, q) == [b"r2", b"x1", b"t2", b"r1b"]
    for body, key in ((b"h2", "h"), (b"l2", "l"), (b"z1", "z")):
        ch.basic_publish("", pq, body, pika.BasicProperties(
            headers={"x-deduplication-header": key}, priority=4, delivery_mode=2))
    assert drain(ch, pq) == [b"h1", b"z1", b"l1"]
    conn.close()
