"""Malformed content-header properties are refused on publish, never stored or delivered.

A property list is ``flags u16 | the present properties in flag order``; the headers
property is a field table (``u32 length | (shortstr name, type octet, value)*``). Each
case below is a property list a client library cannot decode. The broker must answer
with connection.close 502 (syntax error, naming basic.publish 60/40; 501 when the
header frame is too short to hold the property flags), send no confirm
for it, store nothing, log no traceback, and keep serving a well-behaved client.

RabbitMQ 3.10 closes the connection with 541 INTERNAL_ERROR for most of these (and
confirms some); with ``SKRED_TEST_EXTERNAL_URL`` set the test accepts that.

Each case is sent three ways, because the connection parses publishes three ways:
publish, header and body in one write (one pass over the buffer), the three frames in
separate writes (content assembled frame by frame), and after a valid publish with the
same method frame in the same write (a publish run).
"""

from __future__ import annotations

import struct
import time

import pytest
from pamqp import commands

from ._raw import RawConn, frame_bytes, method_bytes
from ._support import Broker, SkredProcess, assert_healthy, connect, is_external, queue_count, unique

_U32 = struct.Struct(">I")


def _table(raw: bytes, length: int | None = None) -> bytes:
    """A headers-only property list whose table holds ``raw`` (length field may lie)."""
    return b"\x20\x00" + _U32.pack(len(raw) if length is None else length) + raw


def _nested(depth: int) -> bytes:
    """A table entry holding tables nested ``depth`` deep."""
    inner = b""
    for _ in range(depth):
        inner = b"\x01aF" + _U32.pack(len(inner)) + inner
    return inner


MALFORMED: list[tuple[str, bytes]] = [
    ("table-length-past-end", _table(b"\x01aSx", length=100)),
    ("unknown-field-type", _table(b"\x01aZ")),
    ("field-value-truncated", _table(b"\x01aS\x00\x00\x00\x09ab")),
    ("field-name-past-table-end", _table(b"\x09ab")),
    ("array-unknown-type", _table(b"\x01aA" + _U32.pack(1) + b"Z")),
    ("nested-table-unknown-type", _table(b"\x01aF" + _U32.pack(3) + b"\x01bZ")),
    ("nested-table-past-outer", _table(b"\x01aF" + _U32.pack(50) + b"\x01bV")),
    ("field-name-not-utf8", _table(b"\x01\xffV")),
    ("timestamp-field-beyond-year-9999", _table(b"\x01aT" + struct.pack(">Q", 2**63))),
    ("tables-nested-too-deep", _table(_nested(300))),
    ("shortstr-past-end", b"\x80\x00\x09ab"),
    ("shortstr-not-utf8", b"\x80\x00\x01\xff"),
    ("delivery-mode-missing", b"\x10\x00"),
    ("bytes-after-last-property", b"\x10\x00\x02\xff\xff"),
    ("continuation-flag", b"\x00\x01\x00\x00"),
    ("one-byte-property-list", b"\x80"),
    ("empty-property-list", b""),
    ("timestamp-property-beyond-year-9999", b"\x00\x40" + b"\xff" * 8),
]


def _hp(props: bytes, size: int) -> bytes:
    return struct.pack(">HHQ", 60, 0, size) + props


def _publish(queue: str, props: bytes, body: bytes) -> list[bytes]:
    """basic.publish, content header and body frame (channel 1) as separate byte strings."""
    return [
        method_bytes(1, commands.Basic.Publish(exchange="", routing_key=queue)),
        frame_bytes(2, 1, _hp(props, len(body))),
        frame_bytes(3, 1, body),
    ]


def _answer(c: RawConn) -> tuple[list[int], commands.Connection.Close | None]:
    """Confirms received (nacks negative) and the connection.close that follows (None on EOF)."""
    acks: list[int] = []
    while True:
        kind, m = c.next_answer()
        if kind == "ack":
            acks.append(int(m.delivery_tag))
        elif kind == "nack":
            acks.append(-int(m.delivery_tag))
        elif kind == "channel.close":
            raise AssertionError(f"channel.close {m.reply_code} {m.reply_text}, not connection.close")
        else:
            return acks, m


@pytest.mark.parametrize("how", ["one-write", "frame-by-frame", "in-a-run"])
@pytest.mark.parametrize("name,props", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_properties_refused(shared_broker: Broker, name: str, props: bytes, how: str) -> None:
    queue = unique("badprops")
    conn = connect(shared_broker)
    try:
        conn.channel().queue_declare(queue)
        with RawConn(shared_broker.host, shared_broker.port, timeout=5) as c:
            c.handshake()
            c.open_channel(1)
            c.send_method(1, commands.Confirm.Select())
            c.expect(commands.Confirm.SelectOk, 1)
            bad = _publish(queue, props, b"bad")
            good = _publish(queue, b"\x00\x00", b"good")
            if how == "one-write":
                c.send(b"".join(bad))
            elif how == "frame-by-frame":
                for part in bad:
                    c.send(part)
                    time.sleep(0.01)  # separate reads on the broker side; not a synchronisation
            else:
                c.send(b"".join(good + good + bad))
            acks, closed = _answer(c)
        stored = queue_count(conn, queue)
        before = 2 if how == "in-a-run" else 0
        if is_external():
            assert closed is None or closed.reply_code in (502, 541), closed
        else:
            assert closed is not None, f"{name}: the connection was dropped without connection.close"
            if len(props) < 2:  # the content header frame itself is short: a frame error
                assert closed.reply_code == 501, closed
            else:
                assert (closed.reply_code, closed.class_id, closed.method_id) == (502, 60, 40), closed
            assert before + 1 not in acks, f"{name}: the malformed publish was confirmed"
            assert stored == before, f"{name}: {stored} messages stored, expected {before}"
            assert isinstance(shared_broker, SkredProcess)
            assert "Traceback" not in shared_broker.log_text(), shared_broker.log_tail()
        conn.channel().queue_delete(queue)
    finally:
        if conn.is_open:
            conn.close()
    assert_healthy(shared_broker)


def test_every_valid_property_list_is_accepted(shared_broker: Broker) -> None:
    """Property lists that look odd but decode are kept byte for byte (reserved flag bit 1,
    every field type, empty strings and tables, the largest timestamps clients decode)."""
    queue = unique("okprops")
    table = b"".join([
        b"\x01tt\x01", b"\x01bb\x80", b"\x01BB\xff", b"\x01ss\x80\x00", b"\x01uu\xff\xff",
        b"\x01II\x80\x00\x00\x00", b"\x01ii\xff\xff\xff\xff", b"\x01ll" + b"\x80" + b"\x00" * 7,
        b"\x01LL" + b"\xff" * 8, b"\x01ff" + struct.pack(">f", 1.5), b"\x01dd" + struct.pack(">d", -2.5),
        b"\x01DD\x02\x00\x00\x01\x00", b"\x01SS" + _U32.pack(2) + b"\xff\xfe",
        b"\x01xx" + _U32.pack(1) + b"\x00", b"\x01TT" + struct.pack(">Q", 253402300799),
        b"\x01VV", b"\x01FF" + _U32.pack(0), b"\x01AA" + _U32.pack(3) + b"t\x01V", b"\x00V",
    ])
    lists = [
        b"\x00\x00",
        b"\x00\x02",  # reserved bit: RabbitMQ ignores it, so do clients
        b"\x20\x00" + _U32.pack(len(table)) + table,
        # every property but reply-to and expiration (those have rules of their own), empty
        # strings and table, the largest timestamp clients decode
        b"\xfc\xfc\x00\x00" + _U32.pack(0) + b"\x02\x09\x00\x00" + struct.pack(">Q", 253402300799999)
        + b"\x00\x05guest\x00\x00",
    ]
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.queue_declare(queue)
        with RawConn(shared_broker.host, shared_broker.port, timeout=5) as c:
            c.handshake()
            c.open_channel(1)
            c.send_method(1, commands.Confirm.Select())
            c.expect(commands.Confirm.SelectOk, 1)
            for i, props in enumerate(lists, 1):
                c.send(b"".join(_publish(queue, props, b"ok")))
                ack = c.expect(commands.Basic.Ack, 1)
                assert ack.delivery_tag == i
            for props in lists:
                c.send_method(1, commands.Basic.Get(queue=queue, no_ack=True))
                c.expect(commands.Basic.GetOk, 1)
                hp, body, _ = c.read_content()
                assert hp[12:] == props and body == b"ok"
        ch.queue_delete(queue)
    finally:
        if conn.is_open:
            conn.close()
