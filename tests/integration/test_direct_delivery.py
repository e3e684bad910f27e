"""The direct hand-over: a publish to an empty plain queue goes straight to a waiting consumer.

Theory of operation: with nothing ready in the queue and a consumer with room,
``ClassicQueue.publish`` delivers at once. For an autoack consumer the message never
touches the store; for a manual-ack consumer it is stored and taken in the
same step, so it must still survive kill -9 until acked, come back on channel
close, and keep its order against a backlog. These tests drive that path with
pika against a real broker process and check what a client can observe.
"""

from __future__ import annotations

import time

import pika
import pytest

from ._support import Broker, SkredProcess, connect, is_external, unique
from .test_mgmt_api import Api


def _consume_into(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str, auto_ack: bool,
                  got: list[tuple[bytes, bool, int]]) -> str:
    def on_msg(_ch: object, method: pika.spec.Basic.Deliver, _props: pika.BasicProperties,
               body: bytes) -> None:
        got.append((bytes(body), bool(method.redelivered), int(method.delivery_tag)))

    return str(ch.basic_consume(queue, on_msg, auto_ack=auto_ack))


def _pump(conn: pika.BlockingConnection, got: list[tuple[bytes, bool, int]], n: int,
          timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(got) == n, f"received {len(got)} of {n}"


def test_autoack_direct_keeps_order_behind_a_backlog(shared_broker: Broker) -> None:
    q = unique("dq")
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        for i in range(300):  # a backlog: no consumer yet, so these are stored
            ch.basic_publish("", q, b"old-%d" % i)
        got: list[tuple[bytes, bool, int]] = []
        _consume_into(ch, q, True, got)
        for i in range(300):  # arrive while the backlog is being delivered, or after it
            ch.basic_publish("", q, b"new-%d" % i)
        _pump(conn, got, 600)
        want = [b"old-%d" % i for i in range(300)] + [b"new-%d" % i for i in range(300)]
        assert [g[0] for g in got] == want
        assert not any(g[1] for g in got)
        assert ch.queue_declare(q, passive=True).method.message_count == 0
    finally:
        conn.close()


def test_manual_ack_direct_requeues_on_channel_close(shared_broker: Broker) -> None:
    q = unique("dq")
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        got: list[tuple[bytes, bool, int]] = []
        _consume_into(ch, q, False, got)
        pub = conn.channel()
        for i in range(50):
            pub.basic_publish("", q, b"m-%d" % i)
        _pump(conn, got, 50)
        assert [g[0] for g in got] == [b"m-%d" % i for i in range(50)]
        ch.basic_ack(got[9][2], multiple=True)  # the first 10 are done
        ch.close()
        back = []
        for _ in range(50):
            m, _props, body = pub.basic_get(q, auto_ack=True)
            if m is None:
                break
            back.append((bytes(body), bool(m.redelivered)))
        assert back == [(b"m-%d" % i, True) for i in range(10, 50)]
    finally:
        conn.close()


@pytest.mark.skipif(is_external(), reason="kills the Skred process")
def test_manual_ack_direct_delivery_survives_kill9_until_acked(broker: Broker) -> None:
    q = unique("dq")
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare(q, durable=True)
    got: list[tuple[bytes, bool, int]] = []
    _consume_into(ch, q, False, got)
    pconn = connect(broker)
    pub = pconn.channel()
    pub.confirm_delivery()
    for i in range(200):  # each publish returns once confirmed
        pub.basic_publish("", q, b"p-%d" % i, pika.BasicProperties(delivery_mode=2))
    _pump(conn, got, 200)
    ch.basic_ack(got[49][2], multiple=True)  # 50 acked, 150 delivered but not acked
    conn.process_data_events(time_limit=0.2)
    # the ack reached the broker once a later round trip on the same connection completed
    ch.queue_declare(q, passive=True)
    broker.kill9()
    broker.start()
    c2 = connect(broker)
    try:
        ch2 = c2.channel()
        bodies = []
        for _ in range(250):
            m, _props, body = ch2.basic_get(q, auto_ack=True)
            if m is None:
                break
            bodies.append(bytes(body))
        # Every unacked message is back, in order. Acks reach their file at the next
        # flush, so after kill -9 some of the 50 acked ones may be back too
        # (at-least-once), in order and ahead of the rest.
        unacked = [b"p-%d" % i for i in range(50, 200)]
        assert bodies[len(bodies) - 150:] == unacked
        assert bodies[: len(bodies) - 150] == [b"p-%d" % i for i in range(50 - (len(bodies) - 150), 50)]
    finally:
        c2.close()


@pytest.mark.skipif(is_external(), reason="reads Skred's management API")
def test_autoack_direct_counts_publish_and_delivery(shared_broker: Broker) -> None:
    """The queue's counters move for messages that never touched the store."""
    assert isinstance(shared_broker, SkredProcess)
    q = unique("dq")
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        got: list[tuple[bytes, bool, int]] = []
        _consume_into(ch, q, True, got)
        for i in range(40):
            ch.basic_publish("", q, b"%d" % i)
        _pump(conn, got, 40)
        ok = ch.queue_declare(q, passive=True)
        assert ok.method.message_count == 0 and ok.method.consumer_count == 1
        status, info, _ = Api(shared_broker.mgmt_port).call("GET", f"/api/queues/%2F/{q}")
        assert status == 200
        assert info["message_stats"]["publish"] == 40
        assert info["message_stats"]["deliver_get"] == 40
    finally:
        conn.close()


def test_one_consumer_gets_every_field_right_when_deliveries_vary(shared_broker: Broker) -> None:
    """A consumer re-encodes only what changed since its previous delivery. Each message
    here differs from the one before in exactly one field (properties of the same or
    another size, exchange, routing key, body size, redelivered) or in none but the body;
    every field must be exact."""
    q = unique("dq")
    x = q + ".x"
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        ch.exchange_declare(x, "topic", auto_delete=True)
        ch.queue_bind(q, x, "#")
        got: list[tuple[str, str, str | None, bytes, bool, int]] = []

        def on_msg(_ch: object, method: pika.spec.Basic.Deliver, props: pika.BasicProperties,
                   body: bytes) -> None:
            got.append((method.exchange, method.routing_key, props.message_id, bytes(body),
                        bool(method.redelivered), int(method.delivery_tag)))

        ch.basic_consume(q, on_msg, auto_ack=False)
        sent = [
            ("", q, None, b"aa"),
            ("", q, "m1", b"aa"),  # properties differ
            ("", q, "m1", b"bb"),  # only the body differs
            ("", q, "m2", b"bb"),  # properties of the same size
            ("", q, "m22", b"bb"),  # properties of another size
            ("", q, "m1", b"bb"),
            (x, "k.1", "m1", b"cc"),  # exchange and routing key
            (x, "k.2", "m1", b"dd"),  # routing key of the same length
            (x, "k.2", "m1", b"eee"),  # body size
        ]
        for ex, rk, mid, body in sent:
            ch.basic_publish(ex, rk, body, pika.BasicProperties(message_id=mid))
        deadline = time.monotonic() + 10
        while len(got) < len(sent) and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        assert [g[:5] for g in got] == [(*s_, False) for s_ in sent]
        # the last one again, now redelivered: only that flag differs from the delivery before
        ch.basic_reject(got[-1][5], requeue=True)
        deadline = time.monotonic() + 10
        while len(got) < len(sent) + 1 and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        assert got[-1][:5] == (*sent[-1], True)
    finally:
        conn.close()
