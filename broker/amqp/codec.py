"""AMQP 0-9-1 frame codec: the hand-written hot path plus pamqp for the rest.

Theory of operation
-------------------
A frame is ``type u8 | channel u16 | size u32 | payload | 0xCE``. The hot
methods (basic.publish, basic.ack, and on the way out basic.deliver, basic.ack
for confirms) are encoded and decoded here with precompiled ``struct.Struct``
objects working in place on a memoryview; message properties stay the raw
bytes of the content header (property flags + property list) and are never
decoded unless a feature needs a header (``broker/properties.py`` reads them). Every other method goes through
pamqp, which is slower but complete, so the long tail of the spec costs no
code of ours. ``tests/test_codec.py`` checks both halves against pamqp.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Any

from pamqp import base as pbase
from pamqp import commands
from pamqp import frame as pframe
from pamqp.base import Frame as PFrame

from broker import properties

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
FRAME_END_BYTE = b"\xce"
FRAME_OVERHEAD = 8  # 7 header bytes + frame end
FRAME_MIN_SIZE = 4096  # spec: the frame_max floor and the limit before tune
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

BASIC_CLASS = 60
PUBLISH = 0x003C0028  # basic.publish (60, 40)
ACK = 0x003C0050  # basic.ack (60, 80)

FRAME_HDR = struct.Struct(">BHI")
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
METHOD_ID = struct.Struct(">I")
HEADER_PREFIX = struct.Struct(">HHQ")  # class, weight, body size
ACK_ARGS = struct.Struct(">QB")
CONFIRM_ACK = struct.Struct(">BHIIQBB")  # full basic.ack frame incl. frame end
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"

EMPTY_PROPS = properties.EMPTY


# pamqp finds each argument's type with ``getattr(cls, '_' + attr)``: a new string per argument
# per call, and CPython's type attribute cache keeps the last such string of each of its slots
# alive. Made while 1,000 connections opened, a couple of thousand of these small strings outlived
# them and pinned about 25 MiB of the allocator's arenas after they closed (issue 31: memory
# after deletes). So each (class, argument) is looked up once and the answer kept (the spec's
# methods and properties: a few hundred entries); no name is built per call.
_AMQP_TYPES: dict[tuple[type, str], str] = {}


def _amqp_type(cls: type, attr: str) -> str:
    try:
        return _AMQP_TYPES[cls, attr]
    except KeyError:
        found: str = getattr(cls, "_" + attr)
        _AMQP_TYPES[cls, attr] = found
        return found


setattr(pbase._AMQData, "amqp_type", classmethod(_amqp_type))  # noqa: B010  (a patch of pamqp: see above)


def encode_method(channel: int, method: PFrame) -> bytes:
    """Encode any method with pamqp (the cold path)."""
    return pframe.marshal(method, channel)


class Truncated(ValueError):
    """Method arguments that end before their fields do: a frame error (501), as RabbitMQ
    answers; other undecodable values (a timestamp out of range, bad UTF-8) stay 502."""


def decode_method(payload: bytes) -> PFrame:
    """Decode a method payload (class id, method id, arguments) with pamqp.

    Raises KeyError for an unknown class/method and ValueError for bad
    arguments (``Truncated`` when they end early); the connection turns those into 540,
    501 (truncated, RabbitMQ's frame error) and 502.
    """
    index = METHOD_ID.unpack_from(payload, 0)[0]
    cls = commands.INDEX_MAPPING[index]
    method: PFrame = cls()
    try:
        method.unmarshal(payload[4:])
    except (struct.error, IndexError) as exc:
        raise Truncated(f"malformed {method.name}: {exc}") from exc
    except (ValueError, TypeError, UnicodeDecodeError, KeyError, RecursionError) as exc:
        if str(exc).startswith("Could not unpack"):  # pamqp's words for a value cut short
            raise Truncated(f"malformed {method.name}: {exc}") from exc
        raise ValueError(f"malformed {method.name}: {exc}") from exc
    return method


def shortstr(value: bytes) -> bytes:
    return bytes((len(value),)) + value


def encode_delivery(
    channel: int,
    method_args_prefix: bytes,
    delivery_tag: int,
    redelivered: bool,
    exchange: bytes,
    routing_key: bytes,
    props: bytes,
    body: bytes | memoryview,
    frame_max: int,
) -> bytes:
    """Method + header + body frames for basic.deliver or basic.get-ok.

    ``method_args_prefix`` is the pre-encoded ``class,method`` id and the
    arguments before the delivery tag (the consumer tag for deliver); it is
    built once per consumer, so per message we only pack numbers.
    """
    method_payload_len = len(method_args_prefix) + 9 + 2 + len(exchange) + len(routing_key)
    body_len = len(body)
    parts: list[bytes | memoryview] = [
        FRAME_HDR.pack(FRAME_METHOD, channel, method_payload_len),
        method_args_prefix,
        U64.pack(delivery_tag),
        b"\x01" if redelivered else b"\x00",
        bytes((len(exchange),)),
        exchange,
        bytes((len(routing_key),)),
        routing_key,
        b"\xce",
        FRAME_HDR.pack(FRAME_HEADER, channel, 12 + len(props)),
        HEADER_PREFIX.pack(BASIC_CLASS, 0, body_len),
        props,
        b"\xce",
    ]
    max_payload = frame_max - FRAME_OVERHEAD
    if body_len <= max_payload:
        if body_len:
            parts += (FRAME_HDR.pack(FRAME_BODY, channel, body_len), body, b"\xce")
    else:
        view = memoryview(body)
        for start in range(0, body_len, max_payload):
            chunk = view[start : start + max_payload]
            parts += (FRAME_HDR.pack(FRAME_BODY, channel, len(chunk)), bytes(chunk), b"\xce")
    return b"".join(parts)


# The size-dependent pieces of a one-body-frame delivery (``delivery_template``): the end of
# the method frame and the header frame's head (props size, body size), and the end of the
# header frame and the body frame's head (body size).
HEADER_AFTER_METHOD = struct.Struct(">BBHIHHQ")  # frame end, header frame hdr, class, weight, size
BODY_AFTER_HEADER = struct.Struct(">BBHI")  # frame end, body frame hdr


@functools.cache
def tag_to_body_size(between: int) -> Callable[..., bytes]:
    """``pack(tag, between_bytes, *HEADER_AFTER_METHOD fields)``: a delivery's tag, the
    ``between`` octets after it (redelivered, exchange, routing key) and the sizes that follow,
    in one call (a run of deliveries of differing sizes packs this once per message)."""
    return struct.Struct(f">Q{between}sBBHIHHQ").pack


def encode_delivery_raw(
    channel: int,
    prefix: bytes,
    delivery_tag: int,
    redelivered: bool,
    exrk: bytes,
    props: bytes,
    body: bytes | memoryview,
    frame_max: int,
) -> bytes:
    """basic.deliver + content from a stored record's raw pieces.

    ``exrk`` is the exchange and routing key as the two short strings the
    store keeps them as, which is exactly their encoding in basic.deliver.
    One join of precompiled-struct pieces; no per-field slicing.
    """
    body_len = len(body)
    if body_len > frame_max - FRAME_OVERHEAD:
        ln = exrk[0]
        return encode_delivery(channel, prefix, delivery_tag, redelivered, exrk[1 : 1 + ln],
                               exrk[2 + ln :], props, body, frame_max)
    head, before, after, tail = delivery_template(channel, prefix, redelivered, exrk, len(props), body_len)
    return b"".join((head, U64.pack(delivery_tag), before, props, after, body, tail))


def delivery_template(channel: int, prefix: bytes, redelivered: bool, exrk: bytes, props_len: int,
                      body_len: int) -> tuple[bytes, bytes, bytes, bytes]:
    """(head, before_props, after_props, tail) of a one-body-frame basic.deliver.

    ``head + U64.pack(delivery_tag) + before_props + props + after_props + body + tail``
    is the delivery of ``props`` (``props_len`` bytes) and a body of ``body_len`` bytes
    that fits one frame (``encode_delivery_raw`` is that join). A consumer delivering
    the same exchange and routing key with properties and body of the same sizes again
    keeps the parts and packs only the tag: properties that differ per message (a
    message-id, a timestamp) do not cost a new template.
    """
    head = FRAME_HDR.pack(FRAME_METHOD, channel, len(prefix) + 9 + len(exrk)) + prefix
    before = b"".join((
        b"\x01" if redelivered else b"\x00", exrk,
        HEADER_AFTER_METHOD.pack(FRAME_END, FRAME_HEADER, channel, 12 + props_len, BASIC_CLASS, 0, body_len),
    ))
    after = BODY_AFTER_HEADER.pack(FRAME_END, FRAME_BODY, channel, body_len) if body_len else FRAME_END_BYTE
    return head, before, after, FRAME_END_BYTE if body_len else b""


def encode_content(channel: int, method: bytes, props: bytes, body: bytes, frame_max: int) -> bytes:
    """A method payload followed by its content header and body frames."""
    out = [FRAME_HDR.pack(FRAME_METHOD, channel, len(method)), method, b"\xce"]
    out.append(FRAME_HDR.pack(FRAME_HEADER, channel, 12 + len(props)))
    out.append(HEADER_PREFIX.pack(BASIC_CLASS, 0, len(body)))
    out.append(props)
    out.append(b"\xce")
    max_payload = frame_max - FRAME_OVERHEAD
    for start in range(0, len(body), max_payload):
        chunk = body[start : start + max_payload]
        out += (FRAME_HDR.pack(FRAME_BODY, channel, len(chunk)), chunk, b"\xce")
    return b"".join(out)


def encode_get_ok(
    channel: int,
    delivery_tag: int,
    redelivered: bool,
    exchange: bytes,
    routing_key: bytes,
    message_count: int,
    props: bytes,
    body: bytes,
    frame_max: int,
) -> bytes:
    """basic.get-ok: like deliver but without a consumer tag and with a count."""
    method = (
        METHOD_ID.pack(0x003C0047)
        + U64.pack(delivery_tag)
        + (b"\x01" if redelivered else b"\x00")
        + shortstr(exchange)
        + shortstr(routing_key)
        + U32.pack(message_count)
    )
    return encode_content(channel, method, props, body, frame_max)


def encode_return(
    channel: int,
    reply_code: int,
    reply_text: bytes,
    exchange: bytes,
    routing_key: bytes,
    props: bytes,
    body: bytes,
    frame_max: int,
) -> bytes:
    """basic.return + content, for mandatory messages nobody could take."""
    method = (
        METHOD_ID.pack(0x003C0032)
        + U16.pack(reply_code)
        + shortstr(reply_text)
        + shortstr(exchange)
        + shortstr(routing_key)
    )
    return encode_content(channel, method, props, body, frame_max)


def encode_confirm(channel: int, delivery_tag: int, multiple: bool, nack: bool = False) -> bytes:
    """basic.ack (or basic.nack) from server to a publisher in confirm mode."""
    if nack:
        return CONFIRM_ACK.pack(1, channel, 13, 0x003C0078, delivery_tag, 1 if multiple else 0, FRAME_END)
    return CONFIRM_ACK.pack(1, channel, 13, ACK, delivery_tag, 1 if multiple else 0, FRAME_END)


def method_name(method: Any) -> str:
    return str(getattr(method, "name", type(method).__name__))


def method_label(class_id: int, method_id: int) -> str:
    """A method's name as RabbitMQ logs it (``queue.declare``, ``basic.recover_async``), or ''
    when the ids name none (0/0: the connection as a whole)."""
    cls = commands.INDEX_MAPPING.get((class_id << 16) | method_id)
    if cls is None:
        return ""
    klass, _, method = str(getattr(cls, "name", "")).partition(".")
    snake = "".join(f"_{ch.lower()}" if ch.isupper() else ch for ch in method).lstrip("_")
    return f"{klass.lower()}.{snake}"
