"""Publish runs and delivery runs against a real broker process.

Theory of operation: a raw client writes thousands of publishes that differ only in
their (equal-length) bodies with one ``sendall``, so the broker reads them as runs
(parsed, routed, stored and delivered as one). pika, a real client library, then
checks what a consumer observes: every body, in order, with the right flags, after
kill -9 for confirmed persistent messages, and on stream queues.
"""

from __future__ import annotations

import time

import pika
import pytest
from pamqp import commands

from ._raw import FRAME_BODY, FRAME_HEADER, RawConn, frame_bytes, header_payload, method_bytes
from ._support import Broker, connect, is_external, unique

N = 5000


def _bodies(n: int, tag: str = "m") -> list[bytes]:
    return [b"%s-%06d" % (tag.encode(), i) for i in range(n)]


def _burst(channel: int, exchange: str, rk: str, bodies: list[bytes],
           props: commands.Basic.Properties | None = None) -> bytes:
    pub = method_bytes(channel, commands.Basic.Publish(exchange=exchange, routing_key=rk))
    out = []
    for body in bodies:
        hp = header_payload(len(body), props or commands.Basic.Properties())
        out += [pub, frame_bytes(FRAME_HEADER, channel, hp), frame_bytes(FRAME_BODY, channel, body)]
    return b"".join(out)


def _raw(b: Broker) -> RawConn:
    c = RawConn(b.host, b.port, timeout=20)
    c.handshake()
    c.open_channel(1)
    return c


def _consume(b: Broker, queue: str, n: int, auto_ack: bool, prefetch: int = 0,
             arguments: dict[str, object] | None = None) -> list[tuple[bytes, bool]]:
    conn = connect(b)
    try:
        ch = conn.channel()
        if prefetch:
            ch.basic_qos(prefetch_count=prefetch)
        got: list[tuple[bytes, bool]] = []

        def on_msg(c: pika.adapters.blocking_connection.BlockingChannel, method: pika.spec.Basic.Deliver,
                   _p: pika.BasicProperties, body: bytes) -> None:
            got.append((bytes(body), bool(method.redelivered)))
            if not auto_ack:
                c.basic_ack(method.delivery_tag)

        ch.basic_consume(queue, on_msg, auto_ack=auto_ack, arguments=arguments)
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        return got
    finally:
        conn.close()


@pytest.mark.parametrize("auto_ack", [True, False])
def test_a_burst_reaches_a_waiting_consumer_in_order(shared_broker: Broker, auto_ack: bool) -> None:
    """The consumer is there first: the run goes straight to it (autoack) or fills its
    prefetch window and waits in the store (manual ack)."""
    q = unique("run")
    conn = connect(shared_broker)
    ch = conn.channel()
    ch.queue_declare(q)
    if not auto_ack:
        ch.basic_qos(prefetch_count=100)
    got: list[bytes] = []

    def on_msg(c: pika.adapters.blocking_connection.BlockingChannel, method: pika.spec.Basic.Deliver,
               _p: pika.BasicProperties, body: bytes) -> None:
        got.append(bytes(body))
        if not auto_ack:
            c.basic_ack(method.delivery_tag)

    ch.basic_consume(q, on_msg, auto_ack=auto_ack)
    raw = _raw(shared_broker)
    try:
        raw.send(_burst(1, "", q, _bodies(N)))
        deadline = time.monotonic() + 30
        while len(got) < N and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        assert got == _bodies(N)
        assert ch.queue_declare(q, passive=True).method.message_count == 0
    finally:
        raw.close()
        conn.close()


def test_a_stored_run_is_delivered_as_runs_and_requeued_in_order(shared_broker: Broker) -> None:
    """A backlog written as runs, read back as runs by a manual-ack consumer that leaves
    without acking: everything comes back, in order, redelivered."""
    q = unique("run")
    conn = connect(shared_broker)
    ch = conn.channel()
    ch.queue_declare(q)
    raw = _raw(shared_broker)
    try:
        raw.send(_burst(1, "", q, _bodies(N)))
        deadline = time.monotonic() + 20
        while ch.queue_declare(q, passive=True).method.message_count < N and time.monotonic() < deadline:
            time.sleep(0.05)
        c2 = connect(shared_broker)
        ch2 = c2.channel()
        ch2.basic_qos(prefetch_count=2000)
        seen: list[bytes] = []
        ch2.basic_consume(q, lambda _c, _m, _p, body: seen.append(bytes(body)), auto_ack=False)
        deadline = time.monotonic() + 20
        while len(seen) < 2000 and time.monotonic() < deadline:
            c2.process_data_events(time_limit=0.05)
        assert seen == _bodies(2000)
        c2.close()  # unacked: requeued
        got = _consume(shared_broker, q, N, auto_ack=True)
        assert [g[0] for g in got] == _bodies(N)
        assert [g[1] for g in got] == [True] * 2000 + [False] * (N - 2000)
    finally:
        raw.close()
        conn.close()


@pytest.mark.skipif(is_external(), reason="kills the Skred process")
def test_confirmed_persistent_runs_survive_kill9(broker: Broker) -> None:
    q = unique("prun")
    conn = connect(broker)
    conn.channel().queue_declare(q, durable=True)
    conn.close()
    raw = _raw(broker)
    raw.send_method(1, commands.Confirm.Select())
    raw.expect(commands.Confirm.SelectOk, 1)
    raw.send(_burst(1, "", q, _bodies(N), commands.Basic.Properties(delivery_mode=2)))
    confirmed = 0
    while confirmed < N:
        _ch, m = raw.read_method()
        assert isinstance(m, commands.Basic.Ack), m
        confirmed = max(confirmed, int(m.delivery_tag))
    broker.kill9()
    raw.close()
    broker.start()
    got = _consume(broker, q, N, auto_ack=False, prefetch=500)
    assert [g[0] for g in got] == _bodies(N)


def test_a_burst_to_a_stream_queue_keeps_every_message(shared_broker: Broker) -> None:
    q = unique("srun")
    conn = connect(shared_broker)
    conn.channel().queue_declare(q, durable=True, arguments={"x-queue-type": "stream"})
    conn.close()
    raw = _raw(shared_broker)
    try:
        raw.send(_burst(1, "", q, _bodies(2000)))
        got = _consume(shared_broker, q, 2000, auto_ack=False, prefetch=500,
                       arguments={"x-stream-offset": "first"})
        assert [g[0] for g in got] == _bodies(2000)
    finally:
        raw.close()
