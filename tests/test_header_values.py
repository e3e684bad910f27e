"""Every header field type a client can send survives the broker's header rewrites: a stream's
offset stamping (``with_offset_header``: spliced into the raw table, every other field byte for
byte) and the decode/re-encode route of dead-lettering, CC/BCC and the like
(``properties.encode``: each value as pamqp decodes it, though a type may widen). The tables are
built by hand, as py-amqp, pika and RabbitMQ write them, since pamqp cannot write some of them. No
sockets."""

from __future__ import annotations

import struct

import pytest

from broker import properties
from broker.model.stream import _STREAM_NAMES, with_offset_header


def _field(name: str, kind: str, value: bytes) -> bytes:
    return bytes((len(name),)) + name.encode() + kind.encode() + value


def _sized(kind: str, value: bytes) -> bytes:
    return kind.encode() + struct.pack(">I", len(value)) + value


def _table(*fields: bytes) -> bytes:
    body = b"".join(fields)
    return struct.pack(">I", len(body)) + body


# One field of every 0-9-1 (errata) type, some nested.
FIELDS = [
    _field("t", "t", b"\x01"), _field("b", "b", b"\xff"), _field("B", "B", b"\xff"),
    _field("s", "s", b"\x80\x00"), _field("u", "u", b"\xff\xff"),
    _field("I", "I", b"\x80\x00\x00\x00"), _field("i", "i", b"\xff\xff\xff\xff"),
    _field("l", "l", struct.pack(">q", -(1 << 40))), _field("L", "L", struct.pack(">Q", 1 << 40)),
    _field("f", "f", struct.pack(">f", 0.5)), _field("d", "d", struct.pack(">d", 0.1)),
    _field("D", "D", b"\x02" + struct.pack(">i", 12345)), _field("T", "T", struct.pack(">Q", 1_700_000_000)),
    _field("V", "V", b""), _field("text", "S", struct.pack(">I", 4) + b"t\xc3\xa9x"),
    _field("bin", "S", struct.pack(">I", 4) + b"\xff\xfe\x00\x80"),  # py-amqp's bytes: not UTF-8
    _field("x", "x", struct.pack(">I", 3) + b"\x00\xff\x01"),
    _field("arr", "A", _table(_sized("S", b"\x81\x82"), _sized("x", b"\x83"), b"b\x07")),  # no names
    _field("nested", "F", _table(_field("bin", "S", struct.pack(">I", 1) + b"\x84"),
                                 _field("deep", "F", _table(_field("d", "d", struct.pack(">d", 2.2))))))
]
CASES = {
    "all": b"\x20\x00" + _table(*FIELDS),
    "ct+all+dm": b"\xb0\x00\x04text" + _table(*FIELDS) + b"\x02",
    "publishers-offset": b"\x30\x00" + _table(_field("x-stream-offset", "S", struct.pack(">I", 4) + b"mine"),
                                              *FIELDS[:3]) + b"\x01",
}


@pytest.mark.parametrize("raw", CASES.values(), ids=list(CASES))
def test_stream_stamp_keeps_every_field(raw: bytes) -> None:
    assert properties.problem(raw) is None
    stamped = with_offset_header(raw, 1 << 33, 1_795_000_000_123)
    assert properties.problem(stamped) is None
    headers = properties.headers(stamped)
    assert (headers.pop("x-stream-offset"), headers.pop("x-stream-timestamp")) == (1 << 33, 1_795_000_000_123)
    want = properties.headers(raw)
    want.pop("x-stream-offset", None)
    assert headers == want
    cut = properties.with_header_fields(stamped, b"", _STREAM_NAMES)
    if b"x-stream-offset" not in raw:
        assert cut == raw  # the record's own bytes, every type as it came
    assert properties.with_header_fields(raw, b"", frozenset()) == raw


@pytest.mark.parametrize("raw", CASES.values(), ids=list(CASES))
def test_reencode_keeps_every_value(raw: bytes) -> None:
    """decode then ``properties.encode`` (dead-lettering, CC/BCC, reply-to): failed on pamqp's
    encoder with TypeError for the binary long strings, and narrowed the doubles to floats."""
    p = properties.decode(raw)
    again = properties.encode(p)
    assert properties.problem(again) is None
    assert properties.decode(again) == p  # 0.1 as a 32-bit float would not be 0.1


@pytest.mark.parametrize("value", [1 << 64, -(1 << 63) - 1, object(), {"k": {1: 2}}])
def test_unencodable_value_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError):
        properties.encode_table({"k": value})
