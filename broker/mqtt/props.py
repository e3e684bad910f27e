"""MQTT 5 properties (section 2.2.2): the table of identifiers and types, a reader and a writer.

A property list is a variable byte integer length, then identifier-value pairs. ``read`` returns a
``Props`` dict by identifier (user properties as a list of pairs, the one property that may
repeat along with a server's subscription identifiers) and checks what the spec makes a protocol
error: an unknown identifier, one not allowed in the packet at hand, a repeated one, a value
of the wrong shape. ``write`` encodes a dict the same way. No IO.
"""

from __future__ import annotations

import struct
from typing import Any, Final

PAYLOAD_FORMAT: Final = 0x01
MESSAGE_EXPIRY: Final = 0x02
CONTENT_TYPE: Final = 0x03
RESPONSE_TOPIC: Final = 0x08
CORRELATION_DATA: Final = 0x09
SUBSCRIPTION_ID: Final = 0x0B
SESSION_EXPIRY: Final = 0x11
ASSIGNED_CLIENT_ID: Final = 0x12
SERVER_KEEP_ALIVE: Final = 0x13
AUTH_METHOD: Final = 0x15
AUTH_DATA: Final = 0x16
REQUEST_PROBLEM_INFO: Final = 0x17
WILL_DELAY: Final = 0x18
REQUEST_RESPONSE_INFO: Final = 0x19
RESPONSE_INFO: Final = 0x1A
SERVER_REFERENCE: Final = 0x1C
REASON_STRING: Final = 0x1F
RECEIVE_MAXIMUM: Final = 0x21
TOPIC_ALIAS_MAXIMUM: Final = 0x22
TOPIC_ALIAS: Final = 0x23
MAXIMUM_QOS: Final = 0x24
RETAIN_AVAILABLE: Final = 0x25
USER_PROPERTY: Final = 0x26
MAXIMUM_PACKET_SIZE: Final = 0x27
WILDCARD_AVAILABLE: Final = 0x28
SUBSCRIPTION_ID_AVAILABLE: Final = 0x29
SHARED_AVAILABLE: Final = 0x2A

# identifier -> value type: b byte, h two-byte integer, i four-byte integer, v variable byte
# integer, s UTF-8 string, d binary data, p string pair
TYPES: Final = {
    PAYLOAD_FORMAT: "b", MESSAGE_EXPIRY: "i", CONTENT_TYPE: "s", RESPONSE_TOPIC: "s", CORRELATION_DATA: "d",
    SUBSCRIPTION_ID: "v", SESSION_EXPIRY: "i", ASSIGNED_CLIENT_ID: "s", SERVER_KEEP_ALIVE: "h",
    AUTH_METHOD: "s", AUTH_DATA: "d", REQUEST_PROBLEM_INFO: "b", WILL_DELAY: "i",
    REQUEST_RESPONSE_INFO: "b", RESPONSE_INFO: "s", SERVER_REFERENCE: "s", REASON_STRING: "s",
    RECEIVE_MAXIMUM: "h", TOPIC_ALIAS_MAXIMUM: "h", TOPIC_ALIAS: "h", MAXIMUM_QOS: "b",
    RETAIN_AVAILABLE: "b", USER_PROPERTY: "p", MAXIMUM_PACKET_SIZE: "i", WILDCARD_AVAILABLE: "b",
    SUBSCRIPTION_ID_AVAILABLE: "b", SHARED_AVAILABLE: "b",
}

# what a client may send in each place (section 3.x.2.x)
CONNECT_PROPS: Final = frozenset({SESSION_EXPIRY, RECEIVE_MAXIMUM, MAXIMUM_PACKET_SIZE, TOPIC_ALIAS_MAXIMUM,
                                  REQUEST_RESPONSE_INFO, REQUEST_PROBLEM_INFO, USER_PROPERTY, AUTH_METHOD,
                                  AUTH_DATA})
WILL_PROPS: Final = frozenset({WILL_DELAY, PAYLOAD_FORMAT, MESSAGE_EXPIRY, CONTENT_TYPE, RESPONSE_TOPIC,
                               CORRELATION_DATA, USER_PROPERTY})
PUBLISH_PROPS: Final = frozenset({PAYLOAD_FORMAT, MESSAGE_EXPIRY, TOPIC_ALIAS, RESPONSE_TOPIC,
                                  CORRELATION_DATA, USER_PROPERTY, CONTENT_TYPE})
ACK_PROPS: Final = frozenset({REASON_STRING, USER_PROPERTY})
SUBSCRIBE_PROPS: Final = frozenset({SUBSCRIPTION_ID, USER_PROPERTY})
UNSUBSCRIBE_PROPS: Final = frozenset({USER_PROPERTY})
DISCONNECT_PROPS: Final = frozenset({SESSION_EXPIRY, REASON_STRING, USER_PROPERTY, SERVER_REFERENCE})
AUTH_PROPS: Final = frozenset({AUTH_METHOD, AUTH_DATA, REASON_STRING, USER_PROPERTY})

Props = dict[int, Any]
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")


class PropertyError(ValueError):
    """A property list the spec calls malformed or a protocol error."""


def read_varint(b: bytes, pos: int) -> tuple[int, int]:
    """A variable byte integer at ``pos``: (value, position after it)."""
    value, shift = 0, 0
    while True:
        if pos >= len(b):
            raise PropertyError("a variable byte integer ends early")
        byte = b[pos]
        pos += 1
        value |= (byte & 127) << shift
        if not byte & 128:
            return value, pos
        shift += 7
        if shift > 21:
            raise PropertyError("a variable byte integer longer than four bytes")


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n % 128
        n //= 128
        out.append(b | 128 if n else b)
        if not n:
            return bytes(out)


def utf8(raw: bytes) -> str:
    """A string as MQTT allows it: well-formed UTF-8 without U+0000 (section 1.5.3)."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PropertyError("a string is not well-formed UTF-8") from None
    if "\x00" in s:
        raise PropertyError("a string contains U+0000")
    return s


def _string(b: bytes, pos: int) -> tuple[str, int]:
    raw, pos = _binary(b, pos)
    return utf8(raw), pos


def _binary(b: bytes, pos: int) -> tuple[bytes, int]:
    if pos + 2 > len(b):
        raise PropertyError("a property ends early")
    (n,) = _U16.unpack_from(b, pos)
    pos += 2
    if pos + n > len(b):
        raise PropertyError("a property ends early")
    return b[pos:pos + n], pos + n


def read(b: bytes, pos: int, allowed: frozenset[int]) -> tuple[Props, int]:
    """The property list at ``pos`` (its length first): (properties, position after them)."""
    length, pos = read_varint(b, pos)
    end = pos + length
    if end > len(b):
        raise PropertyError("the property list ends after the packet")
    out: Props = {}
    while pos < end:
        ident, pos = read_varint(b, pos)
        kind = TYPES.get(ident)
        if kind is None or ident not in allowed:
            raise PropertyError(f"property {ident:#x} not allowed here")
        if ident in out and ident != USER_PROPERTY:
            raise PropertyError(f"property {ident:#x} twice")
        value: Any
        if kind == "b":
            if pos >= end:
                raise PropertyError("a property ends early")
            value, pos = b[pos], pos + 1
        elif kind == "h":
            if pos + 2 > end:
                raise PropertyError("a property ends early")
            (value,), pos = _U16.unpack_from(b, pos), pos + 2
        elif kind == "i":
            if pos + 4 > end:
                raise PropertyError("a property ends early")
            (value,), pos = _U32.unpack_from(b, pos), pos + 4
        elif kind == "v":
            value, pos = read_varint(b, pos)
        elif kind == "s":
            value, pos = _string(b, pos)
        elif kind == "d":
            value, pos = _binary(b, pos)
        else:  # "p"
            k, pos = _string(b, pos)
            v, pos = _string(b, pos)
            out.setdefault(USER_PROPERTY, []).append((k, v))
            continue
        if pos > end:
            raise PropertyError("a property runs past the property list")
        out[ident] = value
    if pos != end:
        raise PropertyError("a property runs past the property list")
    _check_values(out)
    return out, end


def _check_values(p: Props) -> None:
    for ident in (PAYLOAD_FORMAT, REQUEST_PROBLEM_INFO, REQUEST_RESPONSE_INFO):
        if p.get(ident, 0) > 1:
            raise PropertyError(f"property {ident:#x} is {p[ident]}, not 0 or 1")
    for ident in (RECEIVE_MAXIMUM, MAXIMUM_PACKET_SIZE, SUBSCRIPTION_ID, TOPIC_ALIAS):
        if p.get(ident, 1) == 0:
            raise PropertyError(f"property {ident:#x} is 0")


def write(p: Props | None) -> bytes:
    """The property list of ``p`` with its length (one zero byte for none)."""
    if not p:
        return b"\x00"
    out = bytearray()
    for ident, value in p.items():
        kind = TYPES[ident]
        if kind == "p":
            for k, v in value:
                out += varint(ident)
                for s in (k, v):
                    raw = s.encode()
                    out += _U16.pack(len(raw)) + raw
            continue
        if kind == "v" and isinstance(value, list | tuple):  # several subscription identifiers
            for one in value:
                out += varint(ident) + varint(one)
            continue
        out += varint(ident)
        if kind == "b":
            out.append(value)
        elif kind == "h":
            out += _U16.pack(value)
        elif kind == "i":
            out += _U32.pack(value)
        elif kind == "v":
            out += varint(value)
        else:
            raw = value.encode() if kind == "s" else bytes(value)
            out += _U16.pack(len(raw)) + raw
    return varint(len(out)) + bytes(out)
