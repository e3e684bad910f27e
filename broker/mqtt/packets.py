"""MQTT 3.1 and 3.1.1 packets: a sans-IO parser and the encoders the broker needs.

Theory of operation
-------------------
``Parser.feed(data)`` takes whatever bytes arrived and returns the complete packets among them,
keeping a partial packet for the next call ("need more bytes" is an empty list, never an error).
A packet is a small frozen dataclass per type; ``encode_*`` build the bytes a broker sends. No IO,
no asyncio: the network adapter (``broker/mqtt/server.py``) moves bytes, the session
(``broker/mqtt/session.py``) turns packets into the model's operations.

Malformed input raises ``MalformedPacket``: the spec's answer to a protocol violation is to close
the network connection (MQTT 3.1.1 section 4.8), so the session closes it and never guesses. Every
rule the spec makes a server check is checked here: reserved flag bits, the remaining length's
four-byte limit, UTF-8 strings without U+0000 or surrogates, a packet that ends inside a field or
has bytes left over, packet identifier 0, SUBSCRIBE without topic filters, QoS 3. The first
packet's size is bounded by ``max_packet`` before its bytes are buffered, so a peer cannot make
the broker hold more than one packet's worth of its input.

Versions: the CONNECT's protocol name and level pick the version (``MQIsdp``/3 is 3.1, ``MQTT``/4
is 3.1.1). MQTT 5 (level 5) is recognised and parsed up to the level, so the session can refuse it
with the CONNACK code 3.1.1 clients understand (0x01, unacceptable protocol version).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14

# CONNACK return codes (3.1.1 section 3.2.2.3)
ACCEPTED = 0
BAD_PROTOCOL_VERSION = 1
IDENTIFIER_REJECTED = 2
SERVER_UNAVAILABLE = 3
BAD_CREDENTIALS = 4
NOT_AUTHORIZED = 5

SUBACK_FAILURE = 0x80
MAX_REMAINING = 268_435_455  # four bytes of variable-length encoding (section 2.2.3)

_U16 = struct.Struct("!H")


class MalformedPacket(Exception):
    """Input that breaks the spec: the connection is closed (section 4.8)."""


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    message: bytes
    qos: int
    retain: bool


@dataclass(frozen=True, slots=True)
class Connect:
    protocol: str
    level: int
    clean_session: bool
    keepalive: int
    client_id: str
    will: Will | None
    username: str | None
    password: bytes | None


@dataclass(frozen=True, slots=True)
class Publish:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int  # 0 for QoS 0


@dataclass(frozen=True, slots=True)
class PacketId:
    """PUBACK, PUBREC, PUBREL, PUBCOMP and UNSUBACK: a type and a packet identifier."""

    type: int
    packet_id: int


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    filters: tuple[tuple[str, int], ...]  # (topic filter, requested QoS)


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    filters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Bare:
    """PINGREQ, PINGRESP and DISCONNECT: a type alone."""

    type: int


Packet = Connect | Publish | PacketId | Subscribe | Unsubscribe | Bare

# the fixed header's low nibble each type must carry (PUBLISH's is its own flags)
_FLAGS = {CONNECT: 0, PUBACK: 0, PUBREC: 0, PUBREL: 2, PUBCOMP: 0, SUBSCRIBE: 2, UNSUBSCRIBE: 2,
          PINGREQ: 0, DISCONNECT: 0, CONNACK: 0, SUBACK: 0, UNSUBACK: 0, PINGRESP: 0}


class _Reader:
    __slots__ = ("b", "pos")

    def __init__(self, b: bytes) -> None:
        self.b = b
        self.pos = 0

    def left(self) -> int:
        return len(self.b) - self.pos

    def byte(self) -> int:
        if self.pos >= len(self.b):
            raise MalformedPacket("packet ends inside a field")
        v = self.b[self.pos]
        self.pos += 1
        return v

    def u16(self) -> int:
        if self.pos + 2 > len(self.b):
            raise MalformedPacket("packet ends inside a field")
        (v,) = _U16.unpack_from(self.b, self.pos)
        self.pos += 2
        return int(v)

    def binary(self) -> bytes:
        n = self.u16()
        if self.pos + n > len(self.b):
            raise MalformedPacket("packet ends inside a field")
        v = self.b[self.pos:self.pos + n]
        self.pos += n
        return v

    def string(self) -> str:
        return utf8(self.binary())

    def rest(self) -> bytes:
        v = self.b[self.pos:]
        self.pos = len(self.b)
        return v


def utf8(raw: bytes) -> str:
    """A string as MQTT allows it: well-formed UTF-8 without U+0000 (section 1.5.3)."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedPacket("a string is not well-formed UTF-8") from None
    if "\x00" in s:
        raise MalformedPacket("a string contains U+0000")
    return s


def _packet_id(r: _Reader) -> int:
    pid = r.u16()
    if pid == 0:
        raise MalformedPacket("packet identifier 0")
    return pid


def _connect(r: _Reader) -> Connect:
    protocol = r.string()
    level = r.byte()
    if (protocol, level) not in (("MQTT", 4), ("MQIsdp", 3), ("MQTT", 5)):
        # an unknown level is answered with CONNACK 0x01 by the session; a wrong name is garbage
        if protocol not in ("MQTT", "MQIsdp"):
            raise MalformedPacket(f"protocol name {protocol!r}")
        return Connect(protocol, level, True, 0, "", None, None, None)
    if level == 5:
        return Connect(protocol, level, True, 0, "", None, None, None)
    flags = r.byte()
    if flags & 1:
        raise MalformedPacket("CONNECT's reserved flag is set")
    keepalive = r.u16()
    client_id = r.string()
    will = None
    will_qos = (flags >> 3) & 3
    if flags & 4:
        if will_qos == 3:
            raise MalformedPacket("will QoS 3")
        topic = r.string()
        check_topic_name(topic)
        will = Will(topic, r.binary(), will_qos, bool(flags & 32))
    elif flags & 0x38:
        raise MalformedPacket("will QoS or retain without a will")
    username = r.string() if flags & 128 else None
    if flags & 64 and not flags & 128 and level == 4:
        raise MalformedPacket("a password without a user name")
    password = r.binary() if flags & 64 else None
    if r.left():
        raise MalformedPacket("bytes after CONNECT's payload")
    return Connect(protocol, level, bool(flags & 2), keepalive, client_id, will, username, password)


def check_topic_name(topic: str) -> None:
    """A topic a message is published to: not empty, no wildcards (section 4.7)."""
    if not topic:
        raise MalformedPacket("an empty topic name")
    if "+" in topic or "#" in topic:
        raise MalformedPacket(f"wildcards in the topic name {topic!r}")


def check_topic_filter(f: str) -> None:
    """A subscription's filter: ``#`` only last and alone in its level, ``+`` alone in its level."""
    if not f:
        raise MalformedPacket("an empty topic filter")
    levels = f.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise MalformedPacket(f"'#' misplaced in {f!r}")
        if "+" in level and level != "+":
            raise MalformedPacket(f"'+' misplaced in {f!r}")


def _decode(kind: int, flags: int, body: bytes) -> Packet:
    if kind != PUBLISH and _FLAGS.get(kind) != flags:
        raise MalformedPacket(f"packet type {kind} with flags {flags:#x}")
    r = _Reader(body)
    if kind == PUBLISH:
        qos = (flags >> 1) & 3
        if qos == 3:
            raise MalformedPacket("PUBLISH with QoS 3")
        if qos == 0 and flags & 8:
            raise MalformedPacket("DUP set on a QoS 0 PUBLISH")
        topic = r.string()
        check_topic_name(topic)
        pid = _packet_id(r) if qos else 0
        return Publish(topic, r.rest(), qos, bool(flags & 1), bool(flags & 8), pid)
    if kind == CONNECT:
        return _connect(r)
    if kind in (PUBACK, PUBREC, PUBREL, PUBCOMP, UNSUBACK):
        pid = _packet_id(r)
        if r.left():
            raise MalformedPacket("bytes after the packet identifier")
        return PacketId(kind, pid)
    if kind == SUBSCRIBE:
        pid = _packet_id(r)
        subs: list[tuple[str, int]] = []
        while r.left():
            f = r.string()
            check_topic_filter(f)
            qos = r.byte()
            if qos > 2:
                raise MalformedPacket("a subscription's QoS above 2 or reserved bits set")
            subs.append((f, qos))
        if not subs:
            raise MalformedPacket("SUBSCRIBE without a topic filter")
        return Subscribe(pid, tuple(subs))
    if kind == UNSUBSCRIBE:
        pid = _packet_id(r)
        filters: list[str] = []
        while r.left():
            f = r.string()
            check_topic_filter(f)
            filters.append(f)
        if not filters:
            raise MalformedPacket("UNSUBSCRIBE without a topic filter")
        return Unsubscribe(pid, tuple(filters))
    if kind in (PINGREQ, PINGRESP, DISCONNECT):
        if body:
            raise MalformedPacket(f"packet type {kind} with a body")
        return Bare(kind)
    raise MalformedPacket(f"packet type {kind} is not one a client sends")


class Parser:
    """Bytes in, packets out. ``max_packet`` bounds one packet's size (fixed header included)."""

    __slots__ = ("buf", "max_packet", "error")

    def __init__(self, max_packet: int) -> None:
        self.buf = bytearray()
        self.max_packet = max_packet
        self.error: MalformedPacket | None = None  # set once: the packets before it still count

    def feed(self, data: bytes) -> list[Packet]:
        """The complete packets in what arrived so far; after malformed input, those before it
        and ``error`` set (every later call returns nothing)."""
        if self.error is not None:
            return []
        out: list[Packet] = []
        try:
            self._feed(data, out)
        except MalformedPacket as exc:
            self.error = exc
            self.buf.clear()
        return out

    def _feed(self, data: bytes, out: list[Packet]) -> None:
        buf = self.buf
        buf += data
        pos = 0
        n = len(buf)
        while n - pos >= 2:
            length, shift, i, complete = 0, 0, pos + 1, False
            while i < n:
                b = buf[i]
                i += 1
                length |= (b & 127) << shift
                if not b & 128:
                    complete = True
                    break
                shift += 7
                if shift > 21:
                    raise MalformedPacket("remaining length longer than four bytes")
            if not complete:
                break  # the remaining length is not complete yet
            if length + (i - pos) > self.max_packet:
                raise MalformedPacket(
                    f"packet of {length + i - pos} bytes over the limit of {self.max_packet}")
            if n - i < length:
                break
            first = buf[pos]
            pos = i + length
            out.append(_decode(first >> 4, first & 15, bytes(buf[i:pos])))
        if pos:
            del buf[:pos]


# ------------------------------------------------------------------ encoders (server to client)

def _remaining(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n % 128
        n //= 128
        out.append(b | 128 if n else b)
        if not n:
            return bytes(out)


def _str(s: str) -> bytes:
    b = s.encode()
    return _U16.pack(len(b)) + b


def encode_connack(session_present: bool, code: int) -> bytes:
    return bytes((CONNACK << 4, 2, 1 if session_present and code == ACCEPTED else 0, code))


def encode_publish(topic: str, payload: bytes, qos: int, retain: bool, dup: bool, packet_id: int) -> bytes:
    head = _str(topic) + (_U16.pack(packet_id) if qos else b"")
    flags = (8 if dup else 0) | (qos << 1) | (1 if retain else 0)
    return bytes((PUBLISH << 4 | flags,)) + _remaining(len(head) + len(payload)) + head + payload


def encode_packet_id(kind: int, packet_id: int) -> bytes:
    """PUBACK, PUBREC, PUBREL (flags 2), PUBCOMP, UNSUBACK."""
    return bytes((kind << 4 | _FLAGS[kind], 2)) + _U16.pack(packet_id)


def encode_suback(packet_id: int, codes: list[int]) -> bytes:
    return bytes((SUBACK << 4,)) + _remaining(2 + len(codes)) + _U16.pack(packet_id) + bytes(codes)


PINGRESP_BYTES = bytes((PINGRESP << 4, 0))


# ------------------------------------------------------------------ encoders (client to server)
# What a client sends, for the tests and fuzzers of the parser (the broker never sends these).

def encode_connect(c: Connect) -> bytes:
    flags = (2 if c.clean_session else 0) | (128 if c.username is not None else 0) | \
        (64 if c.password is not None else 0)
    payload = _str(c.client_id)
    if c.will is not None:
        flags |= 4 | (c.will.qos << 3) | (32 if c.will.retain else 0)
        payload += _str(c.will.topic) + _U16.pack(len(c.will.message)) + c.will.message
    if c.username is not None:
        payload += _str(c.username)
    if c.password is not None:
        payload += _U16.pack(len(c.password)) + c.password
    body = _str(c.protocol) + bytes((c.level, flags)) + _U16.pack(c.keepalive) + payload
    return bytes((CONNECT << 4,)) + _remaining(len(body)) + body


def encode_subscribe(s: Subscribe) -> bytes:
    body = _U16.pack(s.packet_id) + b"".join(_str(f) + bytes((q,)) for f, q in s.filters)
    return bytes((SUBSCRIBE << 4 | 2,)) + _remaining(len(body)) + body


def encode_unsubscribe(u: Unsubscribe) -> bytes:
    body = _U16.pack(u.packet_id) + b"".join(_str(f) for f in u.filters)
    return bytes((UNSUBSCRIBE << 4 | 2,)) + _remaining(len(body)) + body
