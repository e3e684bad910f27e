"""CC/BCC, priority queues (durable), single active consumer, consumer priority; policies file.

The module's tests share one broker (each names its own queues and exchanges); the two that
stop or restart theirs have one each.
"""

from __future__ import annotations

import json
from typing import Any

import pika

from ._support import Broker, connect, drain, queue_count, unique, wait_until


def test_cc_and_bcc_route_and_bcc_is_removed(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    ex = unique("x")
    ch.exchange_declare(ex, "direct")
    qs = [unique("q") for _ in range(4)]
    for i, q in enumerate(qs):
        ch.queue_declare(q)
        ch.queue_bind(q, ex, f"k{i}")
    ch.basic_publish(ex, "k0", b"m", pika.BasicProperties(headers={"CC": ["k1"], "BCC": ["k2"], "x": 1}))
    got = []
    for q in qs[:3]:
        m, props, body = ch.basic_get(q, auto_ack=True)
        assert m is not None and body == b"m", q
        got.append(props.headers)
    assert all(h.get("CC") == ["k1"] and "BCC" not in h and h.get("x") == 1 for h in got)
    assert queue_count(conn, qs[3]) == 0
    # Default exchange: CC names queues.
    ch.basic_publish("", qs[3], b"d", pika.BasicProperties(headers={"CC": [qs[0]]}))
    assert drain(ch, qs[3]) == [b"d"] and drain(ch, qs[0]) == [b"d"]
    conn.close()


def test_priority_queue_order_clamp_and_restart(broker: Broker) -> None:
    conn = connect(broker)
    ch = conn.channel()
    q = unique("prio")
    ch.queue_declare(q, durable=True, arguments={"x-max-priority": 5})
    ch.confirm_delivery()
    for body, prio in ((b"p0", None), (b"p9", 9), (b"p3", 3), (b"p5", 5), (b"p3b", 3)):
        ch.basic_publish("", q, body, pika.BasicProperties(priority=prio, delivery_mode=2))
    conn.close()
    broker.restart()
    conn = connect(broker)
    ch = conn.channel()
    assert queue_count(conn, q) == 5
    # 9 is clamped to the maximum 5: same level as p5, published before it.
    assert drain(ch, q) == [b"p9", b"p5", b"p3", b"p3b", b"p0"]
    conn.close()


def test_priority_requeue_keeps_order(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    q = unique("prio")
    ch.queue_declare(q, arguments={"x-max-priority": 10})
    ch.basic_publish("", q, b"low", pika.BasicProperties(priority=1))
    ch.basic_publish("", q, b"high", pika.BasicProperties(priority=8))
    m, _, body = ch.basic_get(q)
    assert body == b"high"
    ch.basic_nack(m.delivery_tag, requeue=True)
    m, _, body = ch.basic_get(q, auto_ack=True)
    assert body == b"high" and m.redelivered
    assert drain(ch, q) == [b"low"]
    conn.close()


def _collector(conn: pika.BlockingConnection, q: str, args: dict[str, Any] | None = None,
               prefetch: int = 0) -> tuple[Any, list[bytes]]:
    ch = conn.channel()
    if prefetch:
        ch.basic_qos(prefetch_count=prefetch)
    got: list[bytes] = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=not prefetch, arguments=args)
    return ch, got


def test_single_active_consumer(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    q = unique("sac")
    ch.queue_declare(q, arguments={"x-single-active-consumer": True})
    c1, got1 = _collector(conn, q)
    c2, got2 = _collector(conn, q)
    for i in range(10):
        ch.basic_publish("", q, b"%d" % i)
    wait_until(lambda: (conn.process_data_events(0.02), len(got1))[1] == 10, what="active gets all")
    assert got2 == []
    c1.close()
    ch.basic_publish("", q, b"next")
    wait_until(lambda: (conn.process_data_events(0.02), got2)[1] == [b"next"], what="failover")
    conn.close()


def test_consumer_priority(shared_broker: Broker) -> None:
    conn = connect(shared_broker)
    ch = conn.channel()
    q = unique("cp")
    ch.queue_declare(q)
    lo, got_lo = _collector(conn, q, {"x-priority": 1}, prefetch=100)
    hi, got_hi = _collector(conn, q, {"x-priority": 10}, prefetch=2)
    for i in range(5):
        ch.basic_publish("", q, b"%d" % i)
    wait_until(lambda: (conn.process_data_events(0.02), len(got_hi) + len(got_lo))[1] == 5,
               what="deliveries")
    # The high-priority consumer fills its prefetch first, the rest overflow to the low one.
    assert got_hi == [b"0", b"1"] and got_lo == [b"2", b"3", b"4"]
    conn.close()


def _policies_file(broker: Broker) -> Any:
    data_dir = broker.data_dir
    assert data_dir is not None
    matches = [
        p
        for p in data_dir.iterdir()
        if p.is_dir() and (p / ".vhost").exists() and (p / ".vhost").read_text() == "/"
    ]
    assert matches, "no vhost directory for '/'"
    return matches[0] / "policies.json"


def test_policy_file_applies_after_restart(broker: Broker) -> None:
    conn = connect(broker)
    ch = conn.channel()
    q = unique("pol")
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    for i in range(5):
        ch.basic_publish("", q, b"%d" % i, pika.BasicProperties(delivery_mode=2))
    conn.close()
    broker.stop()
    path = _policies_file(broker)
    path.write_text(json.dumps({"version": 1, "policies": [
        {"name": "cap", "pattern": "^skredtest\\.pol", "apply-to": "queues", "priority": 1,
         "definition": {"max-length": 2}}], "operator_policies": []}))
    broker.start()
    conn = connect(broker)
    ch = conn.channel()
    assert drain(ch, q) == [b"3", b"4"]  # existing messages trimmed to the policy's limit
    ch.basic_publish("", q, b"a")
    ch.basic_publish("", q, b"b")
    ch.basic_publish("", q, b"c")
    assert drain(ch, q) == [b"b", b"c"]
    conn.close()
