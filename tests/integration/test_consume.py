"""Consumers, basic.get, acknowledgements, recover, qos and mandatory returns, through pika."""

from __future__ import annotations

import time
from typing import Any

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from ._support import Broker, channel_error, connect, drain, queue_count, unique, wait_until

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes

Delivery = tuple[Any, Any, bytes]


class Collector:
    """basic.consume callback that records (method, properties, body)."""

    def __init__(self) -> None:
        self.items: list[Delivery] = []

    def __call__(self, ch: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
        self.items.append((method, props, body))

    @property
    def bodies(self) -> list[bytes]:
        return [b for _, _, b in self.items]


def pump(conn: pika.BlockingConnection, pred: Any, timeout: float = 5.0, what: str = "deliveries") -> None:
    """Process I/O until pred() holds, with a deadline."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        conn.process_data_events(time_limit=0.02)


def settle(conn: pika.BlockingConnection, window: float = 0.3) -> None:
    """Process I/O for a short window; used only to check that nothing MORE arrives."""
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.02)


def fill(ch: BlockingChannel, q: str, n: int, prefix: str = "m") -> list[bytes]:
    bodies = [f"{prefix}{i}".encode() for i in range(n)]
    for b in bodies:
        ch.basic_publish("", q, b)
    return bodies


def _q(ch: BlockingChannel) -> str:
    return str(ch.queue_declare("", exclusive=True).method.queue)


def test_consume_and_cancel(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    col = Collector()
    tag = ch.basic_consume(q, col, auto_ack=True, consumer_tag="my-tag")
    assert tag == "my-tag"
    sent = fill(ch, q, 5)
    pump(pika_conn, lambda: len(col.items) == 5)
    assert col.bodies == sent
    assert all(m.consumer_tag == "my-tag" and not m.redelivered for m, _, _ in col.items)
    assert [m.delivery_tag for m, _, _ in col.items] == [1, 2, 3, 4, 5]
    ch.basic_cancel(tag)
    ch.basic_publish("", q, b"after-cancel")
    settle(pika_conn)
    assert len(col.items) == 5
    assert drain(ch, q) == [b"after-cancel"]


def test_server_generated_consumer_tag(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    t1 = ch.basic_consume(q, Collector())
    t2 = ch.basic_consume(q, Collector())
    assert t1 and t2 and t1 != t2


def test_round_robin_between_consumers(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    a, b = Collector(), Collector()
    ch.basic_consume(q, a, auto_ack=True)
    ch.basic_consume(q, b, auto_ack=True)
    fill(ch, q, 10)
    pump(pika_conn, lambda: len(a.items) + len(b.items) == 10)
    assert len(a.items) == 5 and len(b.items) == 5
    assert sorted(a.bodies + b.bodies) == sorted(f"m{i}".encode() for i in range(10))


def test_server_cancel_when_queue_deleted(pika_conn: pika.BlockingConnection, shared_broker: Broker) -> None:
    # pika advertises consumer_cancel_notify in its client capabilities.
    ch = pika_conn.channel()
    q = unique("cancelme")
    ch.queue_declare(q)
    cancelled: list[Any] = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame))
    tag = ch.basic_consume(q, Collector())
    other = connect(shared_broker)
    try:
        other.channel().queue_delete(q)
    finally:
        other.close()
    pump(pika_conn, lambda: bool(cancelled), what="server-sent basic.cancel")
    assert cancelled[0].method.consumer_tag == tag
    assert ch.is_open and pika_conn.is_open
    ch.queue_declare("", exclusive=True)  # channel still usable


def test_basic_get_empty_and_message_count(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    assert ch.basic_get(q, auto_ack=True) == (None, None, None)
    fill(ch, q, 3)
    counts = []
    for i in range(3):
        m, props, body = ch.basic_get(q, auto_ack=True)
        assert body == f"m{i}".encode()
        assert m.routing_key == q and m.exchange == "" and not m.redelivered
        counts.append(m.message_count)
    assert counts == [2, 1, 0]
    assert ch.basic_get(q, auto_ack=True) == (None, None, None)


def test_ack_multiple(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    sent = fill(ch, q, 5)
    col = Collector()
    ch.basic_consume(q, col)
    pump(pika_conn, lambda: len(col.items) == 5)
    ch.basic_ack(col.items[2][0].delivery_tag, multiple=True)  # acks 1..3
    ch.close()
    ch2 = pika_conn.channel()
    wait_until(lambda: queue_count(pika_conn, q) == 2, what="2 unacked requeued on channel close")
    got = []
    for _ in range(2):
        m, _, body = ch2.basic_get(q, auto_ack=True)
        assert m.redelivered
        got.append(body)
    assert got == sent[3:]


def test_nack_multiple_requeue_in_order_redelivered(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    sent = fill(ch, q, 5)
    tags = [ch.basic_get(q, auto_ack=False)[0].delivery_tag for _ in range(5)]
    ch.basic_nack(tags[-1], multiple=True, requeue=True)
    again = [ch.basic_get(q, auto_ack=False) for _ in range(5)]
    assert [b for _, _, b in again] == sent
    assert all(m.redelivered for m, _, _ in again)
    ch.basic_nack(0, multiple=True, requeue=False)  # tag 0 + multiple = everything outstanding
    assert queue_count(pika_conn, q) == 0
    settle(pika_conn, 0.1)
    assert ch.basic_get(q, auto_ack=True) == (None, None, None)


def test_reject_requeue_and_discard(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    fill(ch, q, 3)
    m0 = ch.basic_get(q, auto_ack=False)[0]
    m1 = ch.basic_get(q, auto_ack=False)[0]
    ch.basic_reject(m0.delivery_tag, requeue=True)
    ch.basic_reject(m1.delivery_tag, requeue=False)  # discarded (no dead-letter exchange)
    m, _, body = ch.basic_get(q, auto_ack=True)
    assert body == b"m0" and m.redelivered
    m, _, body = ch.basic_get(q, auto_ack=True)
    assert body == b"m2" and not m.redelivered
    assert ch.basic_get(q, auto_ack=True) == (None, None, None)


def test_requeued_message_redelivered_to_consumer_in_order(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    sent = fill(ch, q, 4)
    col = Collector()
    ch.basic_consume(q, col)
    pump(pika_conn, lambda: len(col.items) == 4)
    ch.basic_nack(col.items[-1][0].delivery_tag, multiple=True, requeue=True)
    pump(pika_conn, lambda: len(col.items) == 8)
    redelivered = col.items[4:]
    assert [b for _, _, b in redelivered] == sent
    assert all(m.redelivered for m, _, _ in redelivered)
    for m, _, _ in redelivered:
        ch.basic_ack(m.delivery_tag)


def test_requeue_restores_original_position(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    fill(ch, q, 4)
    got = [ch.basic_get(q, auto_ack=False)[0] for _ in range(3)]  # m0 m1 m2 unacked
    ch.basic_reject(got[1].delivery_tag, requeue=True)  # m1 back first ...
    ch.basic_reject(got[0].delivery_tag, requeue=True)  # ... then m0, yet m0 is ahead again
    order = [ch.basic_get(q, auto_ack=True) for _ in range(3)]
    assert [b for _, _, b in order] == [b"m0", b"m1", b"m3"]
    assert [m.redelivered for m, _, _ in order] == [True, True, False]


def test_unknown_delivery_tag_is_406(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    ch.basic_ack(999)
    with channel_error(406):
        ch.queue_declare(q, passive=True)
    assert pika_conn.is_open


def test_basic_recover_requeue(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    sent = fill(ch, q, 3)
    col = Collector()
    ch.basic_consume(q, col)
    pump(pika_conn, lambda: len(col.items) == 3)
    assert not any(m.redelivered for m, _, _ in col.items)
    ch.basic_recover(requeue=True)
    pump(pika_conn, lambda: len(col.items) == 6)
    assert [b for _, _, b in col.items[3:]] == sent
    assert all(m.redelivered for m, _, _ in col.items[3:])


def test_prefetch_per_consumer_exactly_n(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    ch.basic_qos(prefetch_count=3)
    fill(ch, q, 10)
    col = Collector()
    ch.basic_consume(q, col)
    pump(pika_conn, lambda: len(col.items) >= 3)
    wait_until(lambda: queue_count(pika_conn, q) == 7, what="7 messages left ready")
    settle(pika_conn)
    assert len(col.items) == 3, "more than prefetch_count unacked deliveries"
    ch.basic_ack(col.items[0][0].delivery_tag)
    pump(pika_conn, lambda: len(col.items) >= 4)
    settle(pika_conn)
    assert len(col.items) == 4
    ch.basic_ack(col.items[-1][0].delivery_tag, multiple=True)
    pump(pika_conn, lambda: len(col.items) >= 7)
    settle(pika_conn)
    assert len(col.items) == 7
    assert [b for _, _, b in col.items] == [f"m{i}".encode() for i in range(7)]


def test_prefetch_applies_to_each_consumer(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q1, q2 = _q(ch), _q(ch)
    ch.basic_qos(prefetch_count=2)  # global=False: per consumer (RabbitMQ semantics)
    fill(ch, q1, 5)
    fill(ch, q2, 5)
    a, b = Collector(), Collector()
    ch.basic_consume(q1, a)
    ch.basic_consume(q2, b)
    pump(pika_conn, lambda: len(a.items) == 2 and len(b.items) == 2)
    settle(pika_conn)
    assert (len(a.items), len(b.items)) == (2, 2)


def test_prefetch_global_shared_by_channel(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q1, q2 = _q(ch), _q(ch)
    ch.basic_qos(prefetch_count=3, global_qos=True)
    fill(ch, q1, 5)
    fill(ch, q2, 5)
    a, b = Collector(), Collector()
    ch.basic_consume(q1, a)
    ch.basic_consume(q2, b)
    pump(pika_conn, lambda: len(a.items) + len(b.items) >= 3)
    settle(pika_conn)
    assert len(a.items) + len(b.items) == 3
    ch.basic_ack(0, multiple=True)
    pump(pika_conn, lambda: len(a.items) + len(b.items) >= 6)
    settle(pika_conn)
    assert len(a.items) + len(b.items) == 6


def test_prefetch_zero_means_unlimited_and_no_ack_ignores_it(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    ch.basic_qos(prefetch_count=1)
    fill(ch, q, 20)
    col = Collector()
    ch.basic_consume(q, col, auto_ack=True)
    pump(pika_conn, lambda: len(col.items) == 20)


def test_unacked_requeued_on_channel_close_with_redelivered(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    sent = fill(ch, q, 3)
    col = Collector()
    ch.basic_consume(q, col)
    pump(pika_conn, lambda: len(col.items) == 3)
    ch.close()
    ch2 = pika_conn.channel()
    wait_until(lambda: queue_count(pika_conn, q) == 3, what="requeue after channel close")
    again = [ch2.basic_get(q, auto_ack=True) for _ in range(3)]
    assert [b for _, _, b in again] == sent
    assert all(m.redelivered for m, _, _ in again)


def test_mandatory_unroutable_basic_return_312(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    returned: list[tuple[Any, Any, bytes]] = []
    ch.add_on_return_callback(lambda c, m, p, b: returned.append((m, p, b)))
    props = pika.BasicProperties(message_id="abc", headers={"k": "v"})
    key = unique("nowhere")
    ch.basic_publish("amq.direct", key, b"bounce", props, mandatory=True)
    ch.basic_publish("amq.direct", key, b"silently-dropped", props, mandatory=False)
    pump(pika_conn, lambda: bool(returned), what="basic.return")
    settle(pika_conn, 0.2)
    assert len(returned) == 1
    m, p, body = returned[0]
    assert m.reply_code == 312 and m.reply_text == "NO_ROUTE"
    assert m.exchange == "amq.direct" and m.routing_key == key
    assert body == b"bounce" and p.message_id == "abc" and p.headers == {"k": "v"}


def test_mandatory_routable_not_returned(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = _q(ch)
    returned: list[Any] = []
    ch.add_on_return_callback(lambda *a: returned.append(a))
    ch.basic_publish("", q, b"fine", mandatory=True)
    assert drain(ch, q) == [b"fine"]
    settle(pika_conn, 0.1)
    assert returned == []


def test_direct_reply_to_rpc(pika_conn: pika.BlockingConnection, shared_broker: Broker) -> None:
    server = connect(shared_broker)
    try:
        sch = server.channel()
        rpc_q = sch.queue_declare("", exclusive=True).method.queue
        cch = pika_conn.channel()
        replies = Collector()
        cch.basic_consume("amq.rabbitmq.reply-to", replies, auto_ack=True)
        cch.basic_publish(
            "", rpc_q, b"ping", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to", correlation_id="c1")
        )
        req: list[Delivery] = []
        sch.basic_consume(rpc_q, lambda c, m, p, b: req.append((m, p, b)), auto_ack=True)
        pump(server, lambda: bool(req), what="rpc request")
        _, rp, rbody = req[0]
        assert rp.reply_to.startswith("amq.rabbitmq.reply-to.")  # rewritten by the broker
        sch.basic_publish(
            "", rp.reply_to, b"pong:" + rbody, pika.BasicProperties(correlation_id=rp.correlation_id)
        )
        pump(pika_conn, lambda: bool(replies.items), what="rpc reply")
        m, p, body = replies.items[0]
        assert body == b"pong:ping" and p.correlation_id == "c1"
    finally:
        server.close()


def test_direct_reply_to_requires_no_ack_consumer_first(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    # publishing with reply-to before consuming from the pseudo-queue is refused (RabbitMQ: 406)
    ch.basic_publish("", "whatever", b"x", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
    with channel_error(406):
        ch.queue_declare("", exclusive=True)
    assert pika_conn.is_open
