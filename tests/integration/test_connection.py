"""Connection negotiation: heartbeats, frame_max, channel_max, channel.flow."""

from __future__ import annotations

import time
from typing import Any

import pika
import pytest
from pamqp import commands

from ._raw import FRAME_HEARTBEAT, RawConn, frame_bytes
from ._support import Broker, assert_healthy, connect, drain, is_external, unique

BIG = bytes(range(256)) * 400  # 102,400 bytes, every byte value present


def test_heartbeat_1s_idle_connection_survives(shared_broker: Broker) -> None:
    conn = connect(shared_broker, heartbeat=1)
    try:
        assert conn._impl.params.heartbeat == 1  # negotiated min(client, server)
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        conn.sleep(3.0)  # idle but servicing I/O (pika sends its heartbeats here)
        assert conn.is_open
        ch.basic_publish("", q, b"alive")
        assert drain(ch, q) == [b"alive"]
    finally:
        if conn.is_open:
            conn.close()


def test_server_sends_heartbeats(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake(heartbeat=1)
        seen = 0
        deadline = time.monotonic() + 3.5
        next_beat = time.monotonic()
        c.sock.settimeout(0.25)
        while time.monotonic() < deadline and seen < 2:
            if time.monotonic() >= next_beat:
                c.send(frame_bytes(FRAME_HEARTBEAT, 0, b""))
                next_beat += 0.5
            try:
                ftype, channel, payload = c.read_frame()
            except TimeoutError:
                continue
            if ftype == FRAME_HEARTBEAT:
                assert channel == 0 and payload == b""
                seen += 1
        assert seen >= 2, "server sent fewer than 2 heartbeats in 3.5 s with heartbeat=1"


def test_silent_client_is_disconnected(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake(heartbeat=1)
        # We never send a heartbeat: the server must drop us after ~2 missed intervals.
        assert c.wait_eof(timeout=10.0), "server kept a silent heartbeat=1 connection open"
    assert_healthy(shared_broker)


def test_frame_max_4096_large_body_intact(shared_broker: Broker) -> None:
    conn = connect(shared_broker, frame_max=4096)
    try:
        assert conn._impl.params.frame_max == 4096
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, BIG)
        got: list[bytes] = []
        ch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=True)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            conn.process_data_events(0.05)
        assert got == [BIG]
    finally:
        conn.close()


def test_server_respects_client_frame_max_on_the_wire(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake(frame_max=4096)
        c.open_channel(1)
        c.send_method(1, commands.Queue.Declare(queue="", exclusive=True))
        q = c.expect(commands.Queue.DeclareOk, 1).queue
        c.publish(1, "", q, BIG)  # split by RawConn into frames of at most 4096 bytes
        c.send_method(1, commands.Basic.Get(queue=q, no_ack=True))
        c.expect(commands.Basic.GetOk, 1)
        _, body, sizes = c.read_content()
        assert body == BIG
        assert len(sizes) >= len(BIG) // 4088
        assert max(sizes) <= 4096, f"server sent a {max(sizes)}-byte frame with frame_max 4096"


def test_tune_offers_limits(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.send(b"AMQP\x00\x00\x09\x01")
        start = c.expect(commands.Connection.Start, 0)
        assert (start.version_major, start.version_minor) == (0, 9)
        assert "PLAIN" in str(start.mechanisms).split()
        caps = start.server_properties.get("capabilities", {})
        for cap in (
            "publisher_confirms",
            "basic.nack",
            "consumer_cancel_notify",
            "exchange_exchange_bindings",
            "per_consumer_qos",
            "direct_reply_to",
        ):
            assert caps.get(cap) is True, f"capability {cap} not advertised"
        c.send_method(
            0,
            commands.Connection.StartOk(
                client_properties={}, mechanism="PLAIN", response="\0guest\0guest", locale="en_US"
            ),
        )
        tune = c.expect(commands.Connection.Tune, 0)
        assert tune.frame_max == 0 or tune.frame_max >= 4096
        assert 0 <= tune.channel_max <= 65535


def test_channel_max_negotiated_by_client(shared_broker: Broker) -> None:
    conn = connect(shared_broker, channel_max=3)
    try:
        assert conn._impl.params.channel_max == 3
        chans = [conn.channel() for _ in range(3)]
        assert sorted(c.channel_number for c in chans) == [1, 2, 3]
        with pytest.raises(pika.exceptions.NoFreeChannels):
            conn.channel()
    finally:
        conn.close()


def test_channel_max_bounds_open_channels(shared_broker: Broker) -> None:
    """As RabbitMQ: the negotiated channel_max counts open channels, not channel numbers."""
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake(channel_max=2)
        c.open_channel(2)
        c.open_channel(3)  # a number above channel_max, the second open channel: fine
        c.send_method(1, commands.Channel.Open())
        closed = c.wait_connection_close()
        assert closed is not None and closed[0] == 530, closed  # NOT_ALLOWED
    assert_healthy(shared_broker)


def test_many_channels_are_independent(pika_conn: pika.BlockingConnection) -> None:
    chans = [pika_conn.channel() for _ in range(20)]
    qs = [c.queue_declare("", exclusive=True).method.queue for c in chans]
    for i, (c, q) in enumerate(zip(chans, qs, strict=False)):
        c.basic_publish("", q, b"%d" % i)
    chans[5].close()
    for i, (c, q) in enumerate(zip(chans, qs, strict=False)):
        if i != 5:
            assert drain(c, q) == [b"%d" % i]


def test_channel_flow(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    assert ch.flow(True) is True
    try:
        active = ch.flow(False)
    except pika.exceptions.ConnectionClosedByBroker as exc:
        # RabbitMQ 3.10 deviates from the spec: it answers channel.flow(active=false)
        # with connection.close 540 NOT_IMPLEMENTED. Skred must implement it.
        assert is_external() and exc.reply_code == 540
        return
    assert active is False
    got: list[Any] = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(b), auto_ack=True)
    pika_conn.channel().basic_publish("", q, b"held")
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # check that nothing is delivered while paused
        pika_conn.process_data_events(0.05)
    assert got == [], "delivered to a consumer on a channel with flow=false"
    assert ch.flow(True) is True
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        pika_conn.process_data_events(0.05)
    assert got == [b"held"]


def test_client_close_then_reconnect(shared_broker: Broker) -> None:
    q = unique("q")
    conn = connect(shared_broker)
    conn.channel().queue_declare(q, auto_delete=False)
    conn.close()
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        assert ch.queue_declare(q, passive=True).method.queue == q
        ch.queue_delete(q)
    finally:
        conn.close()


def test_body_frames_reassembled_from_tiny_pieces(shared_broker: Broker) -> None:
    # 1 KB body sent as 1024 one-byte body frames must arrive as one message.
    body = bytes(i % 251 for i in range(1024))
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake()
        c.open_channel(1)
        c.send_method(1, commands.Queue.Declare(queue="", exclusive=True))
        q = c.expect(commands.Queue.DeclareOk, 1).queue
        c.frame_max = 9  # RawConn.publish splits into frame_max - 8 = 1-byte pieces
        c.publish(1, "", q, body)
        c.send_method(1, commands.Basic.Get(queue=q, no_ack=True))
        c.expect(commands.Basic.GetOk, 1)
        _, got, _ = c.read_content()
        assert got == body
