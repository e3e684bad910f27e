"""A follower's answers when there is no leader, and the etcd outage log (no sockets).

``AmqpRefusal`` is driven by pamqp's own encoder as the client would be; ``Outage`` gets a
fake clock. The tunnel hello carries the follower's id and keepalive (codec version 6).
"""

from __future__ import annotations

import json
import logging

import pytest
from pamqp import commands, frame

from broker.cluster import codec, unavailable
from broker.cluster.etcd import EtcdError, Outage


def _frames(data: bytes) -> list[object]:
    out: list[object] = []
    while data:
        used, _channel, value = frame.unmarshal(data)
        out.append(value)
        data = data[used:]
    return out


def test_amqp_refusal_walks_the_handshake_then_closes_with_320() -> None:
    r = unavailable.AmqpRefusal("no cluster leader yet")
    first = r.receive(unavailable.PROTOCOL_HEADER[:3])
    assert first == b""
    (start,) = _frames(r.receive(unavailable.PROTOCOL_HEADER[3:]))
    assert isinstance(start, commands.Connection.Start)
    start_ok = frame.marshal(commands.Connection.StartOk(
        client_properties={}, mechanism="PLAIN", response="\0guest\0guest", locale="en_US"), 0)
    (tune,) = _frames(r.receive(start_ok))
    assert isinstance(tune, commands.Connection.Tune)
    # tune-ok and open in one read, as pika sends them
    (close,) = _frames(r.receive(frame.marshal(commands.Connection.TuneOk(1, 131072, 0), 0)
                                  + frame.marshal(commands.Connection.Open("/"), 0)))
    assert isinstance(close, commands.Connection.Close)
    assert close.reply_code == 320 and close.reply_text == "CONNECTION_FORCED - no cluster leader yet"
    assert not r.done
    assert r.receive(frame.marshal(commands.Channel.Open(), 1)) == b""  # ignored while closing
    assert r.receive(frame.marshal(commands.Connection.CloseOk(), 0)) == b""
    assert r.done


def test_amqp_refusal_answers_another_protocol_with_ours_and_bounds_its_input() -> None:
    r = unavailable.AmqpRefusal("x")
    assert r.receive(b"GET / HTTP/1.1\r\n") == unavailable.PROTOCOL_HEADER
    assert r.done
    r = unavailable.AmqpRefusal("x")
    r.receive(unavailable.PROTOCOL_HEADER)
    assert r.receive(b"\x01\x00\x00" + (10**6).to_bytes(4, "big")) == b""  # a frame we will not read
    assert r.done
    r = unavailable.AmqpRefusal("x")
    r.receive(unavailable.PROTOCOL_HEADER)
    assert r.receive(frame.marshal(commands.Connection.Close(200, "bye", 0, 0), 0)) \
        == frame.marshal(commands.Connection.CloseOk(), 0)
    assert r.done


def test_amqp_refusal_text_fits_a_short_string() -> None:
    assert len(unavailable.amqp_text("é" * 300).encode()) <= 255


def test_http_refusal_is_a_503_with_a_json_reason() -> None:
    raw = unavailable.http_response("no cluster leader yet")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in head
    assert json.loads(body) == {"error": "service_unavailable", "reason": "no cluster leader yet"}
    assert f"Content-Length: {len(body)}".encode() in head


def test_an_etcd_outage_is_one_warning_then_a_reminder_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    outage = Outage(every=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="broker.cluster.etcd"):
        for i in range(152):  # 0.2 s apart: 30 s of retries
            now[0] = i * 0.2
            outage.failed(EtcdError("refused"))
        outage.answered()
        outage.answered()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["etcd: refused", "etcd still failing after 30s (150 more failures, the last: refused)",
                     "etcd answers again after 30.2s"]


def test_tunnel_hello_names_the_follower_and_its_keepalive() -> None:
    raw = codec.encode_tunnel_hello(b"s" * 32, codec.AMQP_PORT, ("10.0.0.1", 5000), node_id="f-1",
                                    keepalive_ms=6000)
    for cut in range(len(raw)):
        assert codec.parse_opening(raw[:cut]) is None
    hello, used = codec.parse_opening(raw + b"tail") or (None, 0)
    assert used == len(raw)
    assert hello == codec.TunnelHello(codec.VERSION, b"s" * 32, codec.AMQP_PORT, ("10.0.0.1", 5000),
                                      "f-1", 6000)
    old = codec.encode_tunnel_hello(b"s" * 32, codec.AMQP_PORT, ("10.0.0.1", 5000), version=codec.VERSION - 1)
    old = old[:-5]  # a version-5 proxy sends no id and no keepalive
    parsed = codec.parse_opening(old)
    assert parsed is not None and parsed[0].version == codec.VERSION - 1  # refused by version, not hung


def test_mqtt_refusal_is_a_connack_of_the_clients_version() -> None:
    from broker.mqtt import packets as P

    for level, answer in ((4, bytes((0x20, 2, 0, P.SERVER_UNAVAILABLE))),
                          (3, bytes((0x20, 2, 0, P.SERVER_UNAVAILABLE))),
                          (5, bytes((0x20, 3, 0, P.RC_SERVER_UNAVAILABLE, 0)))):
        name = "MQIsdp" if level == 3 else "MQTT"
        props = {} if level == 5 else None
        raw = P.encode_connect(P.Connect(name, level, True, 30, "c", None, "u", b"p", props or {}))
        level_at = raw.index(name.encode()) + len(name)
        for cut in range(level_at + 1):
            assert unavailable.mqtt_connack(raw[:cut]) is None  # the level has not come yet
        assert unavailable.mqtt_connack(raw[:level_at + 1]) == answer
        assert unavailable.mqtt_connack(raw) == answer
    assert unavailable.mqtt_connack(b"GET / HTTP/1.1\r\n") == b""  # not MQTT: just closed
    assert unavailable.mqtt_connack(b"\x10\xff\xff\xff\xff") == b""  # a remaining length of 5 bytes
