"""Policies over HTTP applied live, delayed messages, consumer timeout, consistent hash,
deduplication, vhost limits and the disk alarm (real broker, pika).

Tests that restart their broker or start it with options of their own have one each; the
rest share the module's broker (each names its own queues, exchanges and policies)."""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pika
import pytest

from ._support import Broker, connect, drain, is_external, queue_count, unique, wait_until
from .test_mgmt_api import Api

pytestmark = pytest.mark.skipif(is_external(), reason="needs Skred's management API / process control")


def http(b: Broker, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    status, parsed, _headers = Api(b.mgmt_port).call(method, path, body)  # type: ignore[union-attr]
    return status, parsed


def wait_http(b: Broker) -> None:
    def up() -> bool:
        try:
            return http(b, "GET", "/api/overview")[0] == 200
        except OSError:
            return False
    wait_until(up, 10, "management API")


def qs(name: str) -> str:
    return urllib.parse.quote(name, safe="")


# ------------------------------------------------------------------ 1. policies over HTTP
def test_http_policy_applies_live_and_survives_restart(broker: Broker) -> None:
    wait_http(broker)
    conn = connect(broker)
    ch = conn.channel()
    q = unique("pol")
    ch.queue_declare(q, durable=True)
    for i in range(5):
        ch.basic_publish("", q, f"m{i}".encode())
    assert queue_count(conn, q) == 5
    # A max-length policy set over HTTP trims the existing queue at once (drop-head).
    st, _ = http(broker, "PUT", "/api/policies/%2F/lim",
                 {"pattern": "^" + q.replace(".", "\\.") + "$", "definition": {"max-length": 2},
                  "apply-to": "queues"})
    assert st == 201
    assert queue_count(conn, q) == 2
    for i in range(5, 8):
        ch.basic_publish("", q, f"m{i}".encode())
    assert queue_count(conn, q) == 2
    assert http(broker, "GET", "/api/policies/%2F/lim")[1]["definition"] == {"max-length": 2}
    # An operator policy caps lower; the model rejects max-priority in a policy (400).
    assert http(broker, "PUT", "/api/operator-policies/%2F/op",
                {"pattern": "^skredtest", "definition": {"max-length": 1}})[0] == 201
    assert queue_count(conn, q) == 1
    # The queue shows which policies apply to it.
    shown = http(broker, "GET", "/api/queues/%2F/" + q)[1]
    assert (shown["policy"], shown["operator_policy"]) == ("lim", "op")
    assert http(broker, "PUT", "/api/policies/%2F/bad",
                {"pattern": ".", "definition": {"max-priority": 3}})[0] == 400
    conn.close()
    broker.restart()
    wait_http(broker)
    conn = connect(broker)
    ch = conn.channel()
    assert [p["name"] for p in http(broker, "GET", "/api/policies/%2F")[1]] == ["lim"]
    assert [p["name"] for p in http(broker, "GET", "/api/operator-policies/%2F")[1]] == ["op"]
    assert http(broker, "DELETE", "/api/operator-policies/%2F/op")[0] == 204
    for i in range(3):
        ch.basic_publish("", q, f"n{i}".encode())
    assert queue_count(conn, q) == 2
    # Removing the policy lifts the limit live.
    assert http(broker, "DELETE", "/api/policies/%2F/lim")[0] == 204
    assert http(broker, "GET", "/api/policies/%2F/lim")[0] == 404
    for i in range(3):
        ch.basic_publish("", q, f"k{i}".encode())
    assert queue_count(conn, q) == 5
    # Definitions export carries the policy; import applies it.
    doc = {"policies": [{"vhost": "/", "name": "imp", "pattern": "^" + q.replace(".", "\\.") + "$",
                         "definition": {"max-length": 3}, "priority": 0, "apply-to": "queues"}]}
    assert http(broker, "POST", "/api/definitions", doc)[0] in (200, 201, 204)
    assert queue_count(conn, q) == 3
    assert any(p["name"] == "imp" for p in http(broker, "GET", "/api/definitions")[1]["policies"])
    conn.close()


def test_policy_ttl_expires_on_a_queue_a_priority_consumer_made_featured(shared_broker: Broker) -> None:
    """A consumer with x-priority turns a plain queue into a featured one; a message-ttl policy
    set later must then expire and dead-letter with nobody consuming (the queue's timer), not
    only when something reads the queue."""
    wait_http(shared_broker)
    conn = connect(shared_broker)
    ch = conn.channel()
    dlx, dead, q = unique("dlx"), unique("dead"), unique("prio-ttl")
    ch.exchange_declare(dlx, "fanout")
    ch.queue_declare(dead)
    ch.queue_bind(dead, dlx)
    ch.queue_declare(q)
    tag = ch.basic_consume(q, lambda *_: None, arguments={"x-priority": 5})
    ch.basic_cancel(tag)
    st, _ = http(shared_broker, "PUT", "/api/policies/%2F/prio-ttl",
                 {"pattern": "^" + q.replace(".", "\\.") + "$",
                  "definition": {"message-ttl": 100, "dead-letter-exchange": dlx}, "apply-to": "queues"})
    assert st == 201
    ch.basic_publish("", q, b"old")
    wait_until(lambda: queue_count(conn, dead) == 1, 5, "the policy's TTL dead-lettering the message")
    assert queue_count(conn, q) == 0
    assert http(shared_broker, "DELETE", "/api/policies/%2F/prio-ttl")[0] == 204
    conn.close()


# ------------------------------------------------------------------ 2. delayed messages
def test_delayed_exchange_requires_type(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        ch.exchange_declare(unique("dx"), "x-delayed-message")
    assert ei.value.reply_code == 406
    conn.close()


def test_delayed_messages_order_and_survive_restart(broker: Broker) -> None:
    conn = connect(broker)
    ch = conn.channel()
    ch.confirm_delivery()
    ex, q = unique("dx"), unique("dq")
    ch.exchange_declare(ex, "x-delayed-message", durable=True, arguments={"x-delayed-type": "direct"})
    ch.queue_declare(q, durable=True)
    ch.queue_bind(q, ex, "k")
    t0 = time.monotonic()
    ch.basic_publish(ex, "k", b"late", pika.BasicProperties(headers={"x-delay": 2500}, delivery_mode=2))
    ch.basic_publish(ex, "k", b"soon", pika.BasicProperties(headers={"x-delay": 600}, delivery_mode=2))
    ch.basic_publish(ex, "k", b"now", pika.BasicProperties(delivery_mode=2))  # no x-delay: at once
    ch.basic_publish(ex, "other", b"x", pika.BasicProperties(headers={"x-delay": 300}))  # unroutable later
    assert drain(ch, q) == [b"now"]
    wait_until(lambda: queue_count(conn, q) == 1, 5, "first delayed message")
    assert time.monotonic() - t0 >= 0.5
    assert drain(ch, q) == [b"soon"]
    conn.close()
    broker.restart()  # "late" is held by the exchange, durably
    conn = connect(broker)
    ch = conn.channel()
    wait_until(lambda: queue_count(conn, q) == 1, 10, "delayed message after restart")
    assert time.monotonic() - t0 >= 2.4
    m, props, body = ch.basic_get(q, auto_ack=True)
    assert body == b"late" and props.headers.get("x-delay") == 2500
    # Deleting the exchange drops what it holds.
    ch.basic_publish(ex, "k", b"gone", pika.BasicProperties(headers={"x-delay": 300}))
    ch.exchange_delete(ex)
    time.sleep(0.6)  # the 300 ms delay must pass to show nothing arrives (no event to poll for)
    assert queue_count(conn, q) == 0
    # Declared again under the same name: its confirmed held message survives kill -9 (the
    # boot's replay of the delete record removed the new exchange's files and lost it).
    ch.confirm_delivery()
    ch.exchange_declare(ex, "x-delayed-message", durable=True, arguments={"x-delayed-type": "direct"})
    ch.queue_bind(q, ex, "k")
    t1 = time.monotonic()
    ch.basic_publish(ex, "k", b"again", pika.BasicProperties(headers={"x-delay": 3000}, delivery_mode=2))
    held = queue_count(conn, q) == 0 and time.monotonic() - t1 < 2.5  # still held at the kill
    conn.close()
    broker.kill9()
    broker.start()
    conn = connect(broker)
    ch = conn.channel()
    wait_until(lambda: queue_count(conn, q) == 1, 10, "the exchange declared again fires after kill -9")
    assert not held or time.monotonic() - t1 >= 2.9
    assert ch.basic_get(q, auto_ack=True)[2] == b"again"
    conn.close()


def test_delayed_topic_routes_with_underlying_type(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    ex, q = unique("dx"), unique("dq")
    ch.exchange_declare(ex, "x-delayed-message", arguments={"x-delayed-type": "topic"})
    ch.queue_declare(q)
    ch.queue_bind(q, ex, "a.*")
    ch.basic_publish(ex, "a.b", b"1", pika.BasicProperties(headers={"x-delay": 200}))
    ch.basic_publish(ex, "z.b", b"2", pika.BasicProperties(headers={"x-delay": 200}))
    wait_until(lambda: queue_count(conn, q) == 1, 5, "delayed topic message")
    assert drain(ch, q) == [b"1"]
    conn.close()


# ------------------------------------------------------------------ 4. consistent hash
def test_consistent_hash_weights_and_stability(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    ex = unique("ch")
    ch.exchange_declare(ex, "x-consistent-hash")
    qs = [unique("h") for _ in range(3)]
    for q, w in zip(qs, ("1", "2", "1"), strict=True):
        ch.queue_declare(q)
        ch.queue_bind(q, ex, w)
    n = 2000
    for i in range(n):
        ch.basic_publish(ex, f"key-{i}", b"x")
    counts = [queue_count(conn, q) or 0 for q in qs]
    assert sum(counts) == n
    # weights 1:2:1 -> about 500/1000/500
    assert 0.6 * 500 < counts[0] < 1.4 * 500 and 0.6 * 500 < counts[2] < 1.4 * 500, counts
    assert 0.7 * 1000 < counts[1] < 1.3 * 1000, counts
    for q in qs:
        ch.queue_purge(q)
    for _ in range(20):  # the same key always lands on the same queue
        ch.basic_publish(ex, "same-key", b"s")
    assert sorted(queue_count(conn, q) for q in qs) == [0, 0, 20]
    conn.close()


def test_consistent_hash_on_header_and_property(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    exh, exp = unique("chh"), unique("chp")
    ch.exchange_declare(exh, "x-consistent-hash", arguments={"hash-header": "shard"})
    ch.exchange_declare(exp, "x-consistent-hash", arguments={"hash-property": "message_id"})
    qs = [unique("h") for _ in range(4)]
    for q in qs:
        ch.queue_declare(q)
        ch.queue_bind(q, exh, "1")
        ch.queue_bind(q, exp, "1")
    for i in range(40):  # routing keys vary, the header does not
        ch.basic_publish(exh, f"rk{i}", b"h", pika.BasicProperties(headers={"shard": "A"}))
    assert sorted(queue_count(conn, q) for q in qs) == [0, 0, 0, 40]
    ch.basic_publish(exh, "rk", b"none")  # no header: not routed
    assert sum(queue_count(conn, q) or 0 for q in qs) == 40
    for q in qs:
        ch.queue_purge(q)
    for i in range(40):
        ch.basic_publish(exp, f"rk{i}", b"p", pika.BasicProperties(message_id="m-7"))
    assert sorted(queue_count(conn, q) for q in qs) == [0, 0, 0, 40]
    conn.close()


# ------------------------------------------------------------------ 5. deduplication
def test_exchange_deduplication(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    ex, q = unique("dd"), unique("ddq")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        ch.exchange_declare(ex, "direct", arguments={"x-message-deduplication": True})
    assert ei.value.reply_code == 406  # x-cache-size is required
    ch = conn.channel()
    ch.exchange_declare(ex, "direct", arguments={"x-message-deduplication": True, "x-cache-size": 2,
                                                 "x-cache-ttl": 60000})
    ch.queue_declare(q)
    ch.queue_bind(q, ex, "k")

    def pub(body: bytes, key: str | None, ttl: int | None = None) -> None:
        headers: dict[str, Any] = {}
        if key is not None:
            headers["x-deduplication-header"] = key
        if ttl is not None:
            headers["x-cache-ttl"] = ttl
        ch.basic_publish(ex, "k", body, pika.BasicProperties(headers=headers))

    pub(b"a1", "a")
    pub(b"a2", "a")  # duplicate
    pub(b"n1", None)
    pub(b"n2", None)  # no header: never deduplicated
    pub(b"b1", "b")
    pub(b"c1", "c")  # cache size 2: "a" is evicted
    pub(b"a3", "a")
    pub(b"d1", "d", ttl=100)
    assert drain(ch, q) == [b"a1", b"n1", b"n2", b"b1", b"c1", b"a3", b"d1"]
    time.sleep(0.2)  # let the per-message cache TTL (100 ms) pass; nothing to poll for
    pub(b"d2", "d")
    assert drain(ch, q) == [b"d2"]
    conn.close()


# ------------------------------------------------------------------ 3. consumer timeout
def test_consumer_timeout_closes_channel_with_406(broker_factory: Any) -> None:
    b = broker_factory(["--consumer-timeout", "0"])  # off by config; on per consumer/queue
    conn = connect(b)
    ch = conn.channel()
    q, q2 = unique("ct"), unique("ct2")
    ch.queue_declare(q)
    ch.queue_declare(q2, arguments={"x-consumer-timeout": 1000})
    ch.basic_publish("", q, b"m")
    ch.basic_publish("", q2, b"m2")

    def closed_reason(channel: Any) -> list[Any]:
        reasons: list[Any] = []
        channel._impl.add_on_close_callback(lambda c, reason: reasons.append(reason))
        return reasons

    got: list[bytes] = []
    reasons = closed_reason(ch)
    ch.basic_consume(q, lambda c, m, p, body: got.append(body), arguments={"x-consumer-timeout": 1000})
    t0 = time.monotonic()
    wait_until(lambda: (conn.process_data_events(0.05), bool(reasons))[1], 10, "channel close")
    assert got == [b"m"] and reasons[0].reply_code == 406
    assert "delivery acknowledgement on channel" in reasons[0].reply_text
    assert time.monotonic() - t0 >= 0.9
    assert queue_count(conn, q) == 1  # requeued with the channel
    # Queue argument, basic.get delivery.
    ch = conn.channel()
    reasons = closed_reason(ch)
    m, _, _ = ch.basic_get(q2)
    assert m is not None
    wait_until(lambda: (conn.process_data_events(0.05), bool(reasons))[1], 10, "channel close (queue arg)")
    assert reasons[0].reply_code == 406
    # Acked in time: the channel stays open.
    ch = conn.channel()
    m, _, _ = ch.basic_get(q2)
    assert m is not None
    ch.basic_ack(m.delivery_tag)
    conn.process_data_events(2.5)  # longer than timeout + one tick
    assert ch.is_open
    # Without any timeout set (config 0), an unacked delivery is left alone.
    ch.basic_publish("", q, b"x")
    m, _, _ = ch.basic_get(q)
    assert m is not None
    conn.process_data_events(2.5)
    assert ch.is_open
    conn.close()


# ------------------------------------------------------------------ 6. vhost limits, disk alarm
def test_vhost_limits_over_http(broker: Broker) -> None:
    wait_http(broker)
    assert http(broker, "PUT", "/api/vhost-limits/%2F/max-queues", {"value": 2})[0] == 204
    assert http(broker, "PUT", "/api/vhost-limits/%2F/max-connections", {"value": 2})[0] == 204
    assert http(broker, "PUT", "/api/vhost-limits/%2F/bogus", {"value": 2})[0] == 400
    c1 = connect(broker)
    ch = c1.channel()
    ch.queue_declare(unique("l1"), durable=True)
    ch.queue_declare(unique("l2"), durable=True)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        ch.queue_declare(unique("l3"))
    assert ei.value.reply_code == 406 and "queue limit" in ei.value.reply_text
    c2 = connect(broker)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        connect(broker)  # third connection: over max-connections
    c2.close()
    c1.close()
    broker.restart()
    wait_http(broker)
    assert http(broker, "GET", "/api/vhost-limits/%2F")[1] == [
        {"vhost": "/", "value": {"max-queues": 2, "max-connections": 2}}]
    c1 = connect(broker)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        c1.channel().queue_declare(unique("l4"))
    assert http(broker, "DELETE", "/api/vhost-limits/%2F/max-queues")[0] == 204
    c1.channel().queue_declare(unique("l4"))
    c1.close()


def test_disk_alarm_blocks_publishers(broker_factory: Any) -> None:
    b = broker_factory(["--free-disk-min", str(10**18)])  # more than any disk: alarm on
    conn = connect(b)
    blocked: list[Any] = []
    conn.add_on_connection_blocked_callback(lambda c, m: blocked.append(m))
    wait_until(lambda: (conn.process_data_events(0.05), bool(blocked))[1], 5, "connection.blocked")
    assert blocked[0].method.reason == "low on disk"
    q = unique("alarm")
    ch = conn.channel()
    ch.queue_declare(q)
    other = connect(b)
    ch.basic_publish("", q, b"1")  # read before the pause takes hold
    wait_until(lambda: queue_count(other, q) == 1, 5, "first publish")
    ch.basic_publish("", q, b"2")
    ch.basic_publish("", q, b"3")
    time.sleep(1.0)  # nothing to poll for: the point is that the broker does not read these
    assert queue_count(other, q) == 1
    # A consumer on another connection still gets what is there.
    assert drain(other.channel(), q) == [b"1"]
    assert http(b, "GET", "/api/health/checks/alarms")[0] == 503
    # Lowering the threshold at runtime clears the alarm: connection.unblocked, and the
    # parked publisher is read again.
    unblocked: list[Any] = []
    conn.add_on_connection_unblocked_callback(lambda c, m: unblocked.append(m))
    assert http(b, "PUT", "/api/disk-free-limit", {"limit": 0})[0] == 204
    wait_until(lambda: (conn.process_data_events(0.05), bool(unblocked))[1], 5, "connection.unblocked")
    wait_until(lambda: queue_count(other, q) == 2, 5, "parked publishes delivered")
    assert http(b, "GET", "/api/disk-free-limit")[1]["alarm"] is False
    assert http(b, "GET", "/api/health/checks/alarms")[0] == 200
    assert http(b, "PUT", "/api/disk-free-limit", {"limit": "lots"})[0] == 400
    other.close()
