"""Encoders for the few AMQP 0-9-1 frames skred-perf sends.

Theory of operation: a frame is ``type:u8 channel:u16 size:u32 payload 0xCE``; a method payload
starts with ``class_id:u16 method_id:u16`` followed by its arguments in spec order, where
consecutive bit arguments share one octet (first bit = least significant). A message is one
basic.publish method frame, one content-header frame (class 60, weight 0, body size:u64, property
flags:u16, properties) and as many body frames as ``frame_max - 8`` requires.

The load generator encodes a message once (:func:`encode_message`) and sends the same bytes many
times, so this module favours clarity over speed; the receive hot path lives in ``scanner.py``.
Field tables are supported for the types brokers put in connection.start and the ones we send
(strings, integers, booleans, nested tables) — enough for a handshake, not a general codec.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Union

from broker.properties import FLAG_DELIVERY_MODE, FLAG_MESSAGE_ID

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
FRAME_END_BYTE = b"\xce"

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

# (class_id, method_id) of the methods we send or must recognise.
CONNECTION_START = (10, 10)
CONNECTION_START_OK = (10, 11)
CONNECTION_SECURE = (10, 20)
CONNECTION_TUNE = (10, 30)
CONNECTION_TUNE_OK = (10, 31)
CONNECTION_OPEN = (10, 40)
CONNECTION_OPEN_OK = (10, 41)
CONNECTION_CLOSE = (10, 50)
CONNECTION_CLOSE_OK = (10, 51)
CONNECTION_BLOCKED = (10, 60)
CONNECTION_UNBLOCKED = (10, 61)
CHANNEL_OPEN = (20, 10)
CHANNEL_OPEN_OK = (20, 11)
CHANNEL_FLOW = (20, 20)
CHANNEL_FLOW_OK = (20, 21)
CHANNEL_CLOSE = (20, 40)
CHANNEL_CLOSE_OK = (20, 41)
EXCHANGE_DECLARE = (40, 10)
EXCHANGE_DECLARE_OK = (40, 11)
EXCHANGE_DELETE = (40, 20)
EXCHANGE_DELETE_OK = (40, 21)
QUEUE_DECLARE = (50, 10)
QUEUE_DECLARE_OK = (50, 11)
QUEUE_BIND = (50, 20)
QUEUE_BIND_OK = (50, 21)
QUEUE_DELETE = (50, 40)
QUEUE_DELETE_OK = (50, 41)
BASIC_QOS = (60, 10)
BASIC_QOS_OK = (60, 11)
BASIC_CONSUME = (60, 20)
BASIC_CONSUME_OK = (60, 21)
BASIC_CANCEL = (60, 30)
BASIC_CANCEL_OK = (60, 31)
BASIC_PUBLISH = (60, 40)
BASIC_RETURN = (60, 50)
BASIC_DELIVER = (60, 60)
BASIC_ACK = (60, 80)
BASIC_NACK = (60, 120)
CONFIRM_SELECT = (85, 10)
CONFIRM_SELECT_OK = (85, 11)

# Content-header property flag bits: broker.properties' (the one vocabulary).
MESSAGE_ID_LEN = 12  # --message-ids: every message of a batch gets its own, of this length

_FRAME_HEAD = struct.Struct(">BHI")
_CLASS_METHOD = struct.Struct(">HH")
_CONTENT_HEADER = struct.Struct(">HHQH")

FieldValue = Union[str, bytes, int, bool, float, None, "FieldTable"]
FieldTable = Mapping[str, FieldValue]


class CodecError(Exception):
    """Bytes from the peer that this codec cannot decode."""


def frame(frame_type: int, channel: int, payload: bytes) -> bytes:
    """Wrap ``payload`` into one frame."""
    return _FRAME_HEAD.pack(frame_type, channel, len(payload)) + payload + FRAME_END_BYTE


def shortstr(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) > 255:
        raise ValueError(f"short string longer than 255 bytes: {raw[:40]!r}...")
    return bytes((len(raw),)) + raw


def longstr(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack(">I", len(raw)) + raw


def bits(*flags: bool) -> bytes:
    """Pack consecutive bit arguments into one octet, first flag in the lowest bit."""
    octet = 0
    for i, flag in enumerate(flags):
        if flag:
            octet |= 1 << i
    return bytes((octet,))


def _field_value(value: FieldValue) -> bytes:
    # bool before int: bool is a subclass of int.
    if isinstance(value, bool):
        return b"t" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        if -(2**31) <= value < 2**31:
            return b"I" + struct.pack(">i", value)
        return b"l" + struct.pack(">q", value)
    if isinstance(value, float):
        return b"d" + struct.pack(">d", value)
    if isinstance(value, (str, bytes)):
        return b"S" + longstr(value)
    if value is None:
        return b"V"
    return b"F" + table(value)


def table(values: FieldTable | None) -> bytes:
    """Encode a field table (length-prefixed)."""
    if not values:
        return b"\x00\x00\x00\x00"
    body = b"".join(shortstr(k) + _field_value(v) for k, v in values.items())
    return struct.pack(">I", len(body)) + body


def method(channel: int, class_method: tuple[int, int], args: bytes = b"") -> bytes:
    """One method frame."""
    return frame(FRAME_METHOD, channel, _CLASS_METHOD.pack(*class_method) + args)


# --- connection / channel -------------------------------------------------------------------


def start_ok(user: str, password: str, client_properties: FieldTable) -> bytes:
    response = b"\x00" + user.encode() + b"\x00" + password.encode()
    args = table(client_properties) + shortstr("PLAIN") + longstr(response) + shortstr("en_US")
    return method(0, CONNECTION_START_OK, args)


def tune_ok(channel_max: int, frame_max: int, heartbeat: int) -> bytes:
    return method(0, CONNECTION_TUNE_OK, struct.pack(">HIH", channel_max, frame_max, heartbeat))


def connection_open(vhost: str) -> bytes:
    return method(0, CONNECTION_OPEN, shortstr(vhost) + shortstr("") + bits(False))


def connection_close(code: int = 200, text: str = "Goodbye") -> bytes:
    return method(0, CONNECTION_CLOSE, struct.pack(">H", code) + shortstr(text) + b"\x00" * 4)


def connection_close_ok() -> bytes:
    return method(0, CONNECTION_CLOSE_OK)


def channel_open(channel: int) -> bytes:
    return method(channel, CHANNEL_OPEN, shortstr(""))


def channel_close_ok(channel: int) -> bytes:
    return method(channel, CHANNEL_CLOSE_OK)


def channel_flow_ok(channel: int, active: bool) -> bytes:
    return method(channel, CHANNEL_FLOW_OK, bits(active))


# --- declarations -----------------------------------------------------------------------------


def exchange_declare(
    channel: int,
    exchange: str,
    exchange_type: str,
    *,
    passive: bool = False,
    durable: bool = False,
    auto_delete: bool = False,
    nowait: bool = False,
    arguments: FieldTable | None = None,
) -> bytes:
    args = (
        b"\x00\x00"
        + shortstr(exchange)
        + shortstr(exchange_type)
        + bits(passive, durable, auto_delete, False, nowait)
        + table(arguments)
    )
    return method(channel, EXCHANGE_DECLARE, args)


def exchange_delete(channel: int, exchange: str, *, if_unused: bool = False) -> bytes:
    return method(channel, EXCHANGE_DELETE, b"\x00\x00" + shortstr(exchange) + bits(if_unused, False))


def queue_declare(
    channel: int,
    queue: str,
    *,
    passive: bool = False,
    durable: bool = False,
    exclusive: bool = False,
    auto_delete: bool = False,
    nowait: bool = False,
    arguments: FieldTable | None = None,
) -> bytes:
    args = (
        b"\x00\x00"
        + shortstr(queue)
        + bits(passive, durable, exclusive, auto_delete, nowait)
        + table(arguments)
    )
    return method(channel, QUEUE_DECLARE, args)


def queue_bind(channel: int, queue: str, exchange: str, routing_key: str) -> bytes:
    args = (
        b"\x00\x00" + shortstr(queue) + shortstr(exchange) + shortstr(routing_key) + bits(False) + table(None)
    )
    return method(channel, QUEUE_BIND, args)


def queue_delete(channel: int, queue: str, *, nowait: bool = False) -> bytes:
    return method(channel, QUEUE_DELETE, b"\x00\x00" + shortstr(queue) + bits(False, False, nowait))


# --- basic / confirm --------------------------------------------------------------------------


def basic_qos(channel: int, prefetch_count: int) -> bytes:
    return method(channel, BASIC_QOS, struct.pack(">IH", 0, prefetch_count) + bits(False))


def basic_consume(channel: int, queue: str, consumer_tag: str, *, no_ack: bool) -> bytes:
    args = (
        b"\x00\x00"
        + shortstr(queue)
        + shortstr(consumer_tag)
        + bits(False, no_ack, False, False)
        + table(None)
    )
    return method(channel, BASIC_CONSUME, args)


def basic_ack(channel: int, delivery_tag: int, *, multiple: bool) -> bytes:
    return method(channel, BASIC_ACK, struct.pack(">Q", delivery_tag) + bits(multiple))


def confirm_select(channel: int) -> bytes:
    return method(channel, CONFIRM_SELECT, bits(False))


def content_header(body_size: int, *, persistent: bool, message_id: bytes = b"") -> bytes:
    """Content-header payload for class basic: delivery-mode and, if given, message-id."""
    flags = (FLAG_DELIVERY_MODE if persistent else 0) | (FLAG_MESSAGE_ID if message_id else 0)
    return b"".join((_CONTENT_HEADER.pack(60, 0, body_size, flags), b"\x02" if persistent else b"",
                     shortstr(message_id) if message_id else b""))


def encode_message(
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    frame_max: int,
    *,
    persistent: bool = False,
    message_id: bytes = b"",
) -> bytes:
    """basic.publish + content header + body frame(s), concatenated, ready to send as is."""
    publish = method(
        channel, BASIC_PUBLISH, b"\x00\x00" + shortstr(exchange) + shortstr(routing_key) + bits(False, False)
    )
    parts = [publish, frame(FRAME_HEADER, channel, content_header(len(body), persistent=persistent,
                                                                    message_id=message_id))]
    chunk = frame_max - 8  # frame_max counts the 7-byte frame header and the end octet
    for offset in range(0, len(body), chunk):
        parts.append(frame(FRAME_BODY, channel, body[offset : offset + chunk]))
    return b"".join(parts)


def body_offset(channel: int, exchange: str, routing_key: str, *, persistent: bool,
                message_id_len: int = 0) -> int:
    """Where the first body byte sits inside :func:`encode_message`'s output."""
    publish_len = 7 + 4 + 2 + 1 + len(exchange.encode()) + 1 + len(routing_key.encode()) + 1 + 1
    header_len = 7 + _CONTENT_HEADER.size + (1 if persistent else 0) + 1
    if message_id_len:
        header_len += 1 + message_id_len
    return publish_len + header_len + 7


# --- decoding (handshake / rpc replies; not the hot path) ------------------------------------


class Reader:
    """Sequential reader over one method payload's arguments."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def _take(self, fmt: str) -> tuple[int, ...]:
        # (floats come back through here too; callers that ask for "f"/"d" get a float)
        st = struct.Struct(fmt)
        if self.pos + st.size > len(self.data):
            raise CodecError("method arguments truncated")
        values = st.unpack_from(self.data, self.pos)
        self.pos += st.size
        return values

    def octet(self) -> int:
        return self._take(">B")[0]

    def short(self) -> int:
        return self._take(">H")[0]

    def long(self) -> int:
        return self._take(">I")[0]

    def longlong(self) -> int:
        return self._take(">Q")[0]

    def shortstr(self) -> str:
        n = self.octet()
        raw = self.data[self.pos : self.pos + n]
        if len(raw) != n:
            raise CodecError("short string truncated")
        self.pos += n
        return raw.decode("utf-8", "replace")

    def longstr(self) -> bytes:
        n = self.long()
        raw = self.data[self.pos : self.pos + n]
        if len(raw) != n:
            raise CodecError("long string truncated")
        self.pos += n
        return bytes(raw)

    def table(self) -> dict[str, FieldValue]:
        end = self.pos + self.long()
        if end > len(self.data):
            raise CodecError("field table truncated")
        out: dict[str, FieldValue] = {}
        while self.pos < end:
            key = self.shortstr()
            out[key] = self.field_value()
        return out

    def field_value(self) -> FieldValue:
        kind = chr(self.octet())
        simple = _SIMPLE_FIELDS.get(kind)
        if simple is not None:
            number: int | float = self._take(simple)[0]
            return bool(number) if kind == "t" else number
        if kind == "S":
            return self.longstr().decode("utf-8", "replace")
        if kind == "x":
            return self.longstr()
        if kind == "F":
            return self.table()
        if kind == "A":
            end = self.pos + self.long()
            items: list[FieldValue] = []
            while self.pos < end:
                items.append(self.field_value())
            return str(items)  # arrays only appear in properties we never inspect
        if kind == "D":
            scale, raw = self._take(">Bi")
            return float(raw) / float(10**scale)
        if kind == "V":
            return None
        raise CodecError(f"unsupported field type {kind!r}")


_SIMPLE_FIELDS = {
    "t": ">B",
    "b": ">b",
    "B": ">B",
    "s": ">h",  # RabbitMQ's errata: 's' is a signed short, not a short string
    "u": ">H",
    "I": ">i",
    "i": ">I",
    "L": ">q",
    "l": ">q",
    "f": ">f",
    "d": ">d",
    "T": ">Q",
}


def class_method(payload: bytes) -> tuple[int, int]:
    if len(payload) < 4:
        raise CodecError("method frame shorter than 4 bytes")
    cm: tuple[int, int] = _CLASS_METHOD.unpack_from(payload, 0)
    return cm
