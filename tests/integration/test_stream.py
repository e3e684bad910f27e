"""Stream queues over AMQP (pika): offsets, headers, stored offsets, filters, restart."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pika
import pytest

from ._support import Broker, Cleanup, channel_error, connect

STREAM = {"x-queue-type": "stream"}


def _publish(ch: Any, q: str, bodies: list[bytes], headers: dict[str, Any] | None = None) -> None:
    ch.confirm_delivery()
    for b in bodies:
        ch.basic_publish("", q, b, pika.BasicProperties(delivery_mode=2, headers=headers))


def _consume(conn: pika.BlockingConnection, q: str, n: int, *, args: dict[str, Any] | None = None,
             tag: str = "", ack: bool = True, prefetch: int = 50,
             timeout: float = 10.0) -> list[tuple[int, bytes, dict[str, Any]]]:
    """Take ``n`` deliveries (offset, body, headers), acking each if ``ack``; then cancel.
    Deliveries past the n-th (the broker may send more before the cancel arrives) are kept in
    the result but never acked, so a consumer tag's stored offset is exactly n on."""
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    got: list[tuple[int, bytes, dict[str, Any]]] = []

    def on_msg(c: Any, m: Any, p: Any, b: bytes) -> None:
        headers = dict(p.headers or {})
        got.append((int(headers["x-stream-offset"]), b, headers))
        if ack and len(got) <= n:
            c.basic_ack(m.delivery_tag)

    ctag = ch.basic_consume(q, on_msg, arguments=args, consumer_tag=tag or None)
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    ch.basic_cancel(ctag)
    ch.close()
    return got


def test_declare_requires_durable(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    q = cleanup.queue()
    with channel_error(406):
        pika_conn.channel().queue_declare(q, durable=False, arguments=STREAM)
    with channel_error(406):
        pika_conn.channel().queue_declare(q, durable=True, exclusive=True, arguments=STREAM)
    with channel_error(406):
        pika_conn.channel().queue_declare(q, durable=True, arguments={**STREAM, "x-max-age": "7 days"})
    ok = pika_conn.channel().queue_declare(q, durable=True, arguments={**STREAM, "x-max-age": "7D"})
    assert ok.method.queue == q


def test_offsets_first_next_int_and_header(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    q = cleanup.queue()
    ch = pika_conn.channel()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    _publish(ch, q, [b"m%d" % i for i in range(20)], headers={"h": "v"})
    assert ch.queue_declare(q, passive=True).method.message_count == 20

    first = _consume(pika_conn, q, 20, args={"x-stream-offset": "first"})
    assert [o for o, _, _ in first] == list(range(20))
    assert [b for _, b, _ in first] == [b"m%d" % i for i in range(20)]
    assert all(h["h"] == "v" for _, _, h in first)
    # A stream is never consumed away: read it again, from an integer offset.
    again = _consume(pika_conn, q, 5, args={"x-stream-offset": 15})
    assert [o for o, _, _ in again] == [15, 16, 17, 18, 19]
    last = _consume(pika_conn, q, 1, args={"x-stream-offset": "last"})
    assert [o for o, _, _ in last] == [19]
    # "next" only sees what is published after it attached.
    ch2 = pika_conn.channel()
    ch2.basic_qos(prefetch_count=10)
    seen: list[int] = []
    ch2.basic_consume(q, lambda c, m, p, b: (seen.append(p.headers["x-stream-offset"]),
                                              c.basic_ack(m.delivery_tag)),
                      arguments={"x-stream-offset": "next"})
    pika_conn.process_data_events(time_limit=0.2)
    _publish(ch, q, [b"late"])
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        pika_conn.process_data_events(time_limit=0.05)
    assert seen == [20]


def test_timestamp_offset(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    q = cleanup.queue()
    ch = pika_conn.channel()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    _publish(ch, q, [b"old"])
    # Wait until the clock has moved past the first message's millisecond.
    t_old = time.time()
    while time.time() - t_old < 0.01:
        pika_conn.process_data_events(time_limit=0.005)
    cut = datetime.datetime.now(datetime.UTC)
    _publish(ch, q, [b"new1", b"new2"])
    got = _consume(pika_conn, q, 2, args={"x-stream-offset": cut})
    # AMQP timestamps have second resolution: "old" may share the second with the cut.
    assert [b for _, b, _ in got][-2:] == [b"new1", b"new2"]
    assert all(int(h["x-stream-timestamp"]) > 0 for _, _, h in got)


def test_prefetch_required_and_no_basic_get(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    q = cleanup.queue()
    pika_conn.channel().queue_declare(q, durable=True, arguments=STREAM)
    with channel_error(406):
        ch = pika_conn.channel()
        ch.basic_consume(q, lambda *a: None)  # no basic.qos
    with channel_error(406):
        pika_conn.channel().basic_get(q)
    with channel_error(406):
        pika_conn.channel().queue_purge(q)


def test_resume_by_tag_never_skips_unacked(shared_broker: Broker, cleanup: Cleanup) -> None:
    q = cleanup.queue()
    conn = connect(shared_broker)
    ch = conn.channel()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    _publish(ch, q, [b"%d" % i for i in range(10)])
    tag = "resumer"
    # Take 0..5, ack all but 2 (acks of 3..5 must not move the stored offset past 2).
    c2 = conn.channel()
    c2.basic_qos(prefetch_count=6)
    got: list[tuple[int, int]] = []
    c2.basic_consume(q, lambda c, m, p, b: got.append((int(p.headers["x-stream-offset"]), m.delivery_tag)),
                     consumer_tag=tag, arguments={"x-stream-offset": "first"})
    deadline = time.monotonic() + 10
    while len(got) < 6 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert [o for o, _ in got] == [0, 1, 2, 3, 4, 5]
    for off, dtag in got:
        if off != 2:
            c2.basic_ack(dtag)
    conn.close()  # message 2 was delivered but never acked

    conn = connect(shared_broker)
    resumed = _consume(conn, q, 8, tag=tag)
    assert [o for o, _, _ in resumed] == [2, 3, 4, 5, 6, 7, 8, 9]
    # All acked now: the next reconnect starts after the end.
    conn.channel().basic_publish("", q, b"10")
    more = _consume(conn, q, 1, tag=tag)
    assert [o for o, _, _ in more] == [10]
    conn.close()


def test_filtering(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    q = cleanup.queue()
    ch = pika_conn.channel()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    ch.confirm_delivery()
    for i, value in enumerate(["red", "blue", None, "red", "green"]):
        headers = {"x-stream-filter-value": value} if value else None
        ch.basic_publish("", q, b"%d" % i, pika.BasicProperties(headers=headers))
    reds = _consume(pika_conn, q, 2, args={"x-stream-offset": "first", "x-stream-filter": "red"})
    assert [b for _, b, _ in reds] == [b"0", b"3"]
    some = _consume(pika_conn, q, 4, args={"x-stream-offset": "first", "x-stream-filter": ["blue", "green"],
                                           "x-stream-match-unfiltered": True})
    assert [b for _, b, _ in some] == [b"1", b"2", b"4"]


def test_stream_survives_restart(broker: Broker) -> None:
    conn = connect(broker)
    ch = conn.channel()
    ch.queue_declare("events", durable=True, arguments={**STREAM, "x-max-length-bytes": 10_000_000})
    _publish(ch, "events", [b"a", b"b", b"c"])
    acked = _consume(conn, "events", 2, tag="keeper", args={"x-stream-offset": "first"}, prefetch=2)
    assert [o for o, _, _ in acked][:2] == [0, 1]
    conn.close()
    broker.restart()
    conn = connect(broker)
    ok = conn.channel().queue_declare("events", durable=True,
                                      arguments={**STREAM, "x-max-length-bytes": 10_000_000})
    assert ok.method.message_count == 3
    rest = _consume(conn, "events", 1, tag="keeper")
    assert [b for _, b, _ in rest] == [b"c"]
    everything = _consume(conn, "events", 3, args={"x-stream-offset": "first"})
    assert [b for _, b, _ in everything] == [b"a", b"b", b"c"]
    conn.close()


@pytest.mark.timeout(60)
def test_many_messages_two_consumers(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    q = cleanup.queue()
    ch = pika_conn.channel()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    n = 2000
    _publish(ch, q, [b"%d" % i for i in range(n)])
    a = _consume(pika_conn, q, n, args={"x-stream-offset": "first"}, prefetch=200, timeout=30)
    b = _consume(pika_conn, q, n, args={"x-stream-offset": 0}, prefetch=7, timeout=30)
    assert [o for o, _, _ in a] == list(range(n)) == [o for o, _, _ in b]


def test_fanout_to_a_stream_and_a_classic_queue(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    """One message routed to a stream and a classic queue (the full-disk reservation must
    leave a stream's store alone), one by one and as a pipelined run."""
    s, q, ex = cleanup.queue(), cleanup.queue(), cleanup.exchange()
    ch = pika_conn.channel()
    ch.exchange_declare(ex, "fanout", durable=True)
    ch.queue_declare(s, durable=True, arguments=STREAM)
    ch.queue_declare(q, durable=True)
    ch.queue_bind(s, ex)
    ch.queue_bind(q, ex)
    ch.confirm_delivery()
    ch.basic_publish(ex, "", b"one", pika.BasicProperties(delivery_mode=2))
    run = pika_conn.channel()  # no confirms: the publishes reach the broker in one read, as a run
    for i in range(50):
        run.basic_publish(ex, "", b"run-%d" % i, pika.BasicProperties(delivery_mode=2))
    ch.queue_declare(q, passive=True)  # a round trip after the run on the same connection
    expected = [b"one"] + [b"run-%d" % i for i in range(50)]
    assert [b for _o, b, _h in _consume(pika_conn, s, 51, args={"x-stream-offset": "first"})] == expected
    assert ch.queue_declare(q, passive=True).method.message_count == 51


def test_negative_offset_is_the_last_n(pika_conn: pika.BlockingConnection, cleanup: Cleanup) -> None:
    """LavinMQ: a negative ``x-stream-offset`` starts N messages before the end (never before
    the first)."""
    q = cleanup.queue()
    ch = pika_conn.channel()
    ch.queue_declare(q, durable=True, arguments=STREAM)
    _publish(ch, q, [b"n%d" % i for i in range(10)])
    last3 = _consume(pika_conn, q, 3, args={"x-stream-offset": -3})
    assert [o for o, _, _ in last3] == [7, 8, 9]
    assert [b for _, b, _ in last3] == [b"n7", b"n8", b"n9"]
    everything = _consume(pika_conn, q, 10, args={"x-stream-offset": -100})
    assert [o for o, _, _ in everything] == list(range(10))
