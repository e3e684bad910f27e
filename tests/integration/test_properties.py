"""Message properties and headers pass through unchanged (decoded and byte-exact)."""

from __future__ import annotations

import datetime
import struct
import time
from decimal import Decimal
from typing import Any

import pika
import pytest
from pamqp import commands

from ._raw import RawConn, header_payload
from ._support import Broker

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes

HEADERS: dict[str, Any] = {
    "str": "héllo wörld",
    "empty": "",
    "int_small": 7,
    "int_neg": -42,
    "int_big": 2**40,
    "int_min64": -(2**63),
    "bool_t": True,
    "bool_f": False,
    "decimal": Decimal("12.345"),
    "timestamp": datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
    "void": None,
    "array": [1, "two", True, [3, 4], {"in": "array"}],
    "nested": {"a": {"b": {"c": [Decimal("1.5"), "deep"]}}, "n": 1},
    "empty_table": {},
    "empty_array": [],
}
# pika cannot encode floats and pamqp cannot encode bytes: each library gets what it can say.
PIKA_HEADERS = {**HEADERS, "bytes": b"\x00\x01\xfe\xff"}
PAMQP_HEADERS = {**HEADERS, "float": 3.5, "neg_float": -0.25}


def _props() -> pika.BasicProperties:
    return pika.BasicProperties(
        content_type="application/x-test",
        content_encoding="gzip",
        headers=PIKA_HEADERS,
        delivery_mode=2,
        priority=5,
        correlation_id="corr-1",
        reply_to="reply.queue",
        expiration="600000",
        message_id="msg-1",
        timestamp=1_700_000_000,
        type="test.type",
        user_id="guest",  # must match the authenticated user (RabbitMQ validates it)
        app_id="skred-tests",
    )


def _roundtrip(
    conn: pika.BlockingConnection, props: pika.BasicProperties, body: bytes
) -> tuple[Any, pika.BasicProperties, bytes]:
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", q, body, props)
    m, p, b = ch.basic_get(q, auto_ack=True)
    assert m is not None
    return m, p, b


def test_all_basic_properties_roundtrip(pika_conn: pika.BlockingConnection) -> None:
    sent = _props()
    _, got, body = _roundtrip(pika_conn, sent, b"payload")
    assert body == b"payload"
    for name in (
        "content_type",
        "content_encoding",
        "delivery_mode",
        "priority",
        "correlation_id",
        "reply_to",
        "expiration",
        "message_id",
        "timestamp",
        "type",
        "user_id",
        "app_id",
    ):
        assert getattr(got, name) == getattr(sent, name), name
    assert got.headers == PIKA_HEADERS


def test_absent_properties_stay_absent(pika_conn: pika.BlockingConnection) -> None:
    _, got, body = _roundtrip(pika_conn, pika.BasicProperties(), b"")
    assert body == b""
    assert got.headers is None and got.content_type is None and got.delivery_mode is None


def test_consume_path_delivers_same_properties(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", q, b"x", _props())
    got: list[pika.BasicProperties] = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(p), auto_ack=True)
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        pika_conn.process_data_events(time_limit=0.05)
    assert got, "no delivery within 5 s"
    assert got[0].headers == PIKA_HEADERS and got[0].message_id == "msg-1"


def _shortstr(s: bytes) -> bytes:
    return bytes([len(s)]) + s


def _handmade_header(body_size: int) -> bytes:
    """A content-header payload built octet by octet, including present-but-empty fields.

    content_type present and empty (bit 15), headers present as an empty-ish table with a
    'T' timestamp, 'D' decimal and 'x' byte array (bit 13), priority 0 (bit 11),
    message_id of 255 octets (bit 7).
    """
    flags = (1 << 15) | (1 << 13) | (1 << 11) | (1 << 7)
    table = (
        _shortstr(b"ts")
        + b"T"
        + struct.pack(">Q", 0)
        + _shortstr(b"dec")
        + b"D"
        + struct.pack(">BI", 2, 0xFFFFFFFF)
        + _shortstr(b"raw")
        + b"x"
        + struct.pack(">I", 3)
        + b"\x00\xce\x01"
    )
    return (
        struct.pack(">HHQH", 60, 0, body_size, flags)
        + _shortstr(b"")
        + struct.pack(">I", len(table))
        + table
        + b"\x00"
        + _shortstr(b"m" * 255)
    )


@pytest.mark.parametrize("how", ["pamqp-all-properties", "handmade"])
@pytest.mark.parametrize("path", ["get", "consume"])
def test_content_header_bytes_pass_through_exactly(shared_broker: Broker, how: str, path: str) -> None:
    body = b"\xce" * 10 + b"body"
    if how == "handmade":
        hp = _handmade_header(len(body))
    else:
        p = _props()
        hp = header_payload(
            len(body),
            commands.Basic.Properties(
                content_type=p.content_type,
                content_encoding=p.content_encoding,
                headers=PAMQP_HEADERS,
                delivery_mode=2,
                priority=5,
                correlation_id=p.correlation_id,
                reply_to=p.reply_to,
                expiration=p.expiration,
                message_id=p.message_id,
                timestamp=datetime.datetime(2023, 11, 14, 22, 13, 20),
                message_type=p.type,
                user_id="guest",
                app_id=p.app_id,
            ),
        )
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake()
        c.open_channel(1)
        c.send_method(1, commands.Queue.Declare(queue="", exclusive=True))
        q = c.expect(commands.Queue.DeclareOk, 1).queue
        c.publish(1, "", q, body, raw_header_payload=hp)
        if path == "get":
            c.send_method(1, commands.Basic.Get(queue=q, no_ack=True))
            c.expect(commands.Basic.GetOk, 1)
        else:
            c.send_method(1, commands.Basic.Consume(queue=q, consumer_tag="ct", no_ack=True))
            c.expect(commands.Basic.ConsumeOk, 1)
            c.expect(commands.Basic.Deliver, 1)
        got_hp, got_body, _ = c.read_content()
    assert got_body == body
    assert got_hp == hp, "content header payload changed on its way through the broker"
