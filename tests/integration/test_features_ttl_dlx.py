"""TTL, queue expiry, dead-lettering, length limits and delivery limits, through pika.

One broker serves the module (every test names its own queues and exchanges); the restart
test has a broker of its own.
"""

from __future__ import annotations

import time
from typing import Any

import pika
import pytest

from ._support import Broker, channel_error, connect, drain, exists_queue, queue_count, unique, wait_until


def _conn(broker: Broker) -> pika.BlockingConnection:
    return connect(broker)


def _dlx_setup(ch: Any) -> tuple[str, str]:
    """A fanout dead-letter exchange bound to a collecting queue."""
    dlx, dead = unique("dlx"), unique("dead")
    ch.exchange_declare(dlx, "fanout")
    ch.queue_declare(dead)
    ch.queue_bind(dead, dlx)
    return dlx, dead


def _get(ch: Any, q: str, deadline: float = 5.0) -> tuple[Any, bytes]:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        m, props, body = ch.basic_get(q, auto_ack=True)
        if m is not None:
            return props, bytes(body)
        ch.connection.process_data_events(0.02)
    raise AssertionError(f"nothing arrived in {q}")


def test_queue_ttl_expires_and_dead_letters(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    dlx, dead = _dlx_setup(ch)
    q = unique("ttl")
    ch.queue_declare(q, arguments={"x-message-ttl": 100, "x-dead-letter-exchange": dlx})
    ch.basic_publish("", q, b"old", pika.BasicProperties(headers={"k": "v"}))
    # Expired by the per-queue timer with nobody consuming or polling the source queue.
    wait_until(lambda: queue_count(conn, dead) == 1, what="dead letter")
    assert queue_count(conn, q) == 0
    props, body = _get(ch, dead)
    assert body == b"old"
    death = props.headers["x-death"][0]
    assert death["reason"] == "expired" and death["queue"] == q and death["count"] == 1
    assert death["exchange"] == "" and death["routing-keys"] == [q]
    assert props.headers["x-first-death-reason"] == "expired"
    assert props.headers["x-first-death-queue"] == q
    assert props.headers["k"] == "v"
    conn.close()


def test_per_message_ttl_lower_wins_and_original_expiration(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    dlx, dead = _dlx_setup(ch)
    q = unique("ttl")
    ch.queue_declare(q, arguments={"x-message-ttl": 60_000, "x-dead-letter-exchange": dlx})
    ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="80"))
    wait_until(lambda: queue_count(conn, dead) == 1, what="per-message expiry")
    props, body = _get(ch, dead)
    assert body == b"short" and props.expiration is None
    assert props.headers["x-death"][0]["original-expiration"] == "80"
    # A message with a long expiration on a plain queue is still delivered.
    q2 = unique("plain")
    ch.queue_declare(q2)
    ch.basic_publish("", q2, b"keep", pika.BasicProperties(expiration="60000"))
    assert _get(ch, q2)[1] == b"keep"
    conn.close()


def test_ttl_zero_without_consumer_is_dropped_with_consumer_delivered(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    q = unique("ttl0")
    ch.queue_declare(q, arguments={"x-message-ttl": 0})
    ch.basic_publish("", q, b"gone")
    assert queue_count(conn, q) == 0
    got: list[bytes] = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=True)
    conn.process_data_events(0.1)
    ch.basic_publish("", q, b"taken")
    wait_until(lambda: (conn.process_data_events(0.02), got)[1] == [b"taken"], what="ttl 0 delivery")
    conn.close()


def test_invalid_expiration_is_406(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    q = unique("q")
    conn.channel().queue_declare(q)
    for bad in ("abc", "-5", "1.5"):
        ch = conn.channel()
        with channel_error(406):
            ch.basic_publish("", q, b"x", pika.BasicProperties(expiration=bad))
            ch.queue_declare(q, passive=True)  # round trip so the close arrives
    assert queue_count(conn, q) == 0
    conn.close()


def test_queue_expires_when_unused(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    q, kept = unique("exp"), unique("exp")
    ch.queue_declare(q, arguments={"x-expires": 300})
    ch.queue_declare(kept, arguments={"x-expires": 300})
    ch.basic_consume(kept, lambda *a: None)
    wait_until(lambda: not exists_queue(conn, q), what="queue expiry")
    conn.process_data_events(0.5)
    assert exists_queue(conn, kept)  # in use: a consumer keeps it alive
    conn.close()


@pytest.mark.parametrize("bad", [
    {"x-max-priority": 256}, {"x-max-priority": -1}, {"x-message-ttl": -1},
    {"x-message-ttl": "1000"}, {"x-expires": 0}, {"x-max-length": -1},
    {"x-overflow": "drop-tail"}, {"x-dead-letter-routing-key": "k"},
])
def test_invalid_queue_arguments_are_406(shared_broker: Broker, bad: dict[str, Any]) -> None:
    conn = _conn(shared_broker)
    q = unique("bad")
    with channel_error(406):
        conn.channel().queue_declare(q, arguments=bad)
    assert not exists_queue(conn, q)
    conn.close()


def test_reject_dead_letters_with_routing_key_and_counts(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    dlx = unique("dlx")
    ch.exchange_declare(dlx, "direct")
    dead = unique("dead")
    ch.queue_declare(dead)
    ch.queue_bind(dead, dlx, "failed")
    q = unique("src")
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "failed"})
    ch.basic_publish("", q, b"bad")
    m, _, _ = ch.basic_get(q)
    ch.basic_reject(m.delivery_tag, requeue=False)
    props, body = _get(ch, dead)
    assert body == b"bad"
    assert props.headers["x-death"][0]["reason"] == "rejected"
    # nack without requeue also dead-letters; back through the source queue counts up.
    ch.basic_publish("", q, b"again", pika.BasicProperties(headers=props.headers))
    m, _, _ = ch.basic_get(q)
    ch.basic_nack(m.delivery_tag, requeue=False)
    props, body = _get(ch, dead)
    assert body == b"again"
    deaths = props.headers["x-death"]
    assert len(deaths) == 1 and deaths[0]["count"] == 2
    conn.close()


def test_missing_dlx_drops_silently_and_cycle_is_dropped(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    q = unique("src")
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": unique("nope"), "x-message-ttl": 10})
    ch.basic_publish("", q, b"x")
    wait_until(lambda: queue_count(conn, q) == 0, what="expiry")
    # A queue dead-lettering into itself on expiry is a cycle: the message is dropped.
    loop = unique("loop")
    ch.queue_declare(loop, arguments={"x-dead-letter-exchange": "", "x-message-ttl": 20})
    ch.basic_publish("", loop, b"y")
    wait_until(lambda: queue_count(conn, loop) == 0, what="cycle drop")
    conn.process_data_events(0.2)
    assert queue_count(conn, loop) == 0
    assert ch.is_open
    conn.close()


def test_max_length_drop_head_dead_letters_oldest(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    dlx, dead = _dlx_setup(ch)
    q = unique("ml")
    ch.queue_declare(q, arguments={"x-max-length": 2, "x-dead-letter-exchange": dlx})
    for i in range(5):
        ch.basic_publish("", q, b"%d" % i)
    assert drain(ch, q) == [b"3", b"4"]
    assert drain(ch, dead) == [b"0", b"1", b"2"]
    z = unique("ml0")
    ch.queue_declare(z, arguments={"x-max-length": 0})
    ch.basic_publish("", z, b"never")
    assert queue_count(conn, z) == 0
    conn.close()


def test_max_length_bytes(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    q = unique("mlb")
    ch.queue_declare(q, arguments={"x-max-length-bytes": 10})
    for body in (b"aaaa", b"bbbb", b"cccc"):
        ch.basic_publish("", q, body)
    assert drain(ch, q) == [b"bbbb", b"cccc"]
    conn.close()


def test_reject_publish_nacks_under_confirms(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    dlx, dead = _dlx_setup(ch)
    q, qd = unique("rp"), unique("rpd")
    ch.queue_declare(q, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.queue_declare(qd, arguments={"x-max-length": 1, "x-overflow": "reject-publish-dlx",
                                    "x-dead-letter-exchange": dlx})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"first")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", q, b"second")
    ch.basic_publish("", q + ".none", b"unroutable-but-acked")  # still confirmed (ack)
    assert drain(ch, q) == [b"first"]
    ch.basic_publish("", q, b"third")  # room again
    assert drain(ch, q) == [b"third"]
    ch.basic_publish("", qd, b"a")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", qd, b"b")
    assert drain(ch, qd) == [b"a"]
    props, body = _get(ch, dead)
    assert body == b"b" and props.headers["x-death"][0]["reason"] == "maxlen"
    conn.close()


def test_delivery_limit_counts_and_dead_letters(shared_broker: Broker) -> None:
    conn = _conn(shared_broker)
    ch = conn.channel()
    dlx, dead = _dlx_setup(ch)
    q = unique("dl")
    ch.queue_declare(q, arguments={"x-delivery-limit": 2, "x-dead-letter-exchange": dlx})
    ch.basic_publish("", q, b"poison")
    counts = []
    for _ in range(3):
        m, props, _ = ch.basic_get(q)
        assert m is not None
        counts.append((props.headers or {}).get("x-delivery-count", 0))
        ch.basic_nack(m.delivery_tag, requeue=True)
    assert counts == [0, 1, 2]
    assert queue_count(conn, q) == 0
    props, body = _get(ch, dead)
    assert body == b"poison"
    assert props.headers["x-death"][0]["reason"] == "delivery_limit"
    assert "x-delivery-count" not in props.headers
    conn.close()


def test_xdeath_survives_restart(broker: Broker) -> None:
    conn = _conn(broker)
    ch = conn.channel()
    dlx = unique("dlx")
    ch.exchange_declare(dlx, "fanout", durable=True)
    dead = unique("dead")
    ch.queue_declare(dead, durable=True)
    ch.queue_bind(dead, dlx)
    q = unique("src")
    ch.queue_declare(q, durable=True, arguments={"x-message-ttl": 50, "x-dead-letter-exchange": dlx})
    ch.confirm_delivery()
    ch.basic_publish("", q, b"p", pika.BasicProperties(delivery_mode=2))
    wait_until(lambda: queue_count(conn, dead) == 1, what="dead letter")
    conn.close()
    broker.restart()
    conn = _conn(broker)
    ch = conn.channel()
    props, body = _get(ch, dead)
    assert body == b"p" and props.headers["x-death"][0]["reason"] == "expired"
    # The TTL queue keeps its arguments (and its timer) after the restart.
    ch.basic_publish("", q, b"p2", pika.BasicProperties(delivery_mode=2))
    wait_until(lambda: queue_count(conn, dead) == 1, what="dead letter after restart")
    conn.close()
