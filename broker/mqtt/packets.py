"""MQTT 3.1, 3.1.1 and 5.0 packets: a sans-IO parser and the encoders the broker needs.

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
is 3.1.1, ``MQTT``/5 is 5.0), and the parser reads every later packet of the connection in that
version: MQTT 5 adds property lists (``props.py``), reason codes on acknowledgements and
DISCONNECT, subscription options and the AUTH packet. ``MalformedPacket.code`` is the MQTT 5
reason code the session puts in its DISCONNECT before it closes (0x81 malformed packet, 0x82
protocol error, 0x95 packet too large).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from broker.mqtt import props as PR
from broker.mqtt.props import Props

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = 8, 9, 10, 11, 12, 13, 14, 15

# CONNACK return codes of 3.1 and 3.1.1 (section 3.2.2.3)
ACCEPTED = 0
BAD_PROTOCOL_VERSION = 1
IDENTIFIER_REJECTED = 2
SERVER_UNAVAILABLE = 3
BAD_CREDENTIALS = 4
NOT_AUTHORIZED = 5
SUBACK_FAILURE = 0x80

# MQTT 5 reason codes (section 2.4) the broker uses
RC_SUCCESS = 0x00
RC_NO_MATCHING_SUBSCRIBERS = 0x10
RC_UNSPECIFIED = 0x80
RC_MALFORMED = 0x81
RC_PROTOCOL_ERROR = 0x82
RC_IMPLEMENTATION_SPECIFIC = 0x83
RC_UNSUPPORTED_VERSION = 0x84
RC_CLIENT_ID_NOT_VALID = 0x85
RC_BAD_CREDENTIALS = 0x86
RC_NOT_AUTHORIZED = 0x87
RC_SERVER_UNAVAILABLE = 0x88
RC_SERVER_SHUTTING_DOWN = 0x8B
RC_BAD_AUTH_METHOD = 0x8C
RC_KEEP_ALIVE_TIMEOUT = 0x8D
RC_SESSION_TAKEN_OVER = 0x8E
RC_TOPIC_FILTER_INVALID = 0x8F
RC_TOPIC_NAME_INVALID = 0x90
RC_PACKET_ID_NOT_FOUND = 0x92
RC_RECEIVE_MAXIMUM_EXCEEDED = 0x93
RC_TOPIC_ALIAS_INVALID = 0x94
RC_PACKET_TOO_LARGE = 0x95
RC_QUOTA_EXCEEDED = 0x97
RC_ADMINISTRATIVE_ACTION = 0x98
RC_USE_ANOTHER_SERVER = 0x9C
RC_SHARED_NOT_SUPPORTED = 0x9E

_U16 = struct.Struct("!H")


class MalformedPacket(Exception):
    """Input that breaks the spec: the connection is closed (section 4.8); ``code`` is the
    MQTT 5 reason code of the DISCONNECT that says why."""

    def __init__(self, text: str, code: int = RC_MALFORMED) -> None:
        super().__init__(text)
        self.code = code


def _no_props() -> Props:
    return {}


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    message: bytes
    qos: int
    retain: bool
    props: Props = field(default_factory=_no_props)


@dataclass(frozen=True, slots=True)
class Connect:
    protocol: str
    level: int
    clean_session: bool  # MQTT 5: clean start
    keepalive: int
    client_id: str
    will: Will | None
    username: str | None
    password: bytes | None
    props: Props = field(default_factory=_no_props)


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ was 6 % of QoS 0 fan-in
class Publish:
    topic: str  # MQTT 5: "" with a topic alias property
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int  # 0 for QoS 0
    props: Props = field(default_factory=_no_props)


@dataclass(frozen=True, slots=True)
class PacketId:
    """PUBACK, PUBREC, PUBREL, PUBCOMP and UNSUBACK: a type and a packet identifier (MQTT 5: a
    reason code and properties too)."""

    type: int
    packet_id: int
    reason: int = 0
    props: Props = field(default_factory=_no_props)


# subscription options (MQTT 5 section 3.8.3.1; 3.1.1 has the QoS bits only)
NO_LOCAL = 4
RETAIN_AS_PUBLISHED = 8


def retain_handling(options: int) -> int:
    return (options >> 4) & 3


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    filters: tuple[tuple[str, int], ...]  # (topic filter, options: QoS in the low two bits)
    props: Props = field(default_factory=_no_props)


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    filters: tuple[str, ...]
    props: Props = field(default_factory=_no_props)


@dataclass(frozen=True, slots=True)
class Bare:
    """PINGREQ and PINGRESP: a type alone."""

    type: int


@dataclass(frozen=True, slots=True)
class Disconnect:
    reason: int = 0
    props: Props = field(default_factory=_no_props)


@dataclass(frozen=True, slots=True)
class Auth:
    reason: int = 0
    props: Props = field(default_factory=_no_props)


Packet = Connect | Publish | PacketId | Subscribe | Unsubscribe | Bare | Disconnect | Auth

# the fixed header's low nibble each type must carry (PUBLISH's is its own flags)
_FLAGS = {CONNECT: 0, PUBACK: 0, PUBREC: 0, PUBREL: 2, PUBCOMP: 0, SUBSCRIBE: 2, UNSUBSCRIBE: 2,
          PINGREQ: 0, DISCONNECT: 0, CONNACK: 0, SUBACK: 0, UNSUBACK: 0, PINGRESP: 0, AUTH: 0}


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

    def props(self, allowed: frozenset[int]) -> Props:
        try:
            p, self.pos = PR.read(self.b, self.pos, allowed)
        except PR.PropertyError as exc:
            raise MalformedPacket(str(exc), RC_PROTOCOL_ERROR) from None
        return p

    def rest(self) -> bytes:
        v = self.b[self.pos:]
        self.pos = len(self.b)
        return v


def utf8(raw: bytes) -> str:
    """``props.utf8``: a malformed string makes a malformed packet."""
    try:
        return PR.utf8(raw)
    except PR.PropertyError as exc:
        raise MalformedPacket(str(exc)) from None


def _packet_id(r: _Reader) -> int:
    pid = r.u16()
    if pid == 0:
        raise MalformedPacket("packet identifier 0", RC_PROTOCOL_ERROR)
    return pid


def _connect(r: _Reader) -> Connect:
    protocol = r.string()
    level = r.byte()
    if (protocol, level) not in (("MQTT", 4), ("MQIsdp", 3), ("MQTT", 5)):
        # an unknown level is answered with CONNACK 0x01 by the session; a wrong name is garbage
        if protocol not in ("MQTT", "MQIsdp"):
            raise MalformedPacket(f"protocol name {protocol!r}")
        return Connect(protocol, level, True, 0, "", None, None, None)
    v5 = level == 5
    flags = r.byte()
    if flags & 1:
        raise MalformedPacket("CONNECT's reserved flag is set")
    keepalive = r.u16()
    props = r.props(PR.CONNECT_PROPS) if v5 else {}
    client_id = r.string()
    will = None
    will_qos = (flags >> 3) & 3
    if flags & 4:
        if will_qos == 3:
            raise MalformedPacket("will QoS 3")
        will_props = r.props(PR.WILL_PROPS) if v5 else {}
        topic = r.string()
        check_topic_name(topic)
        will = Will(topic, r.binary(), will_qos, bool(flags & 32), will_props)
    elif flags & 0x38:
        raise MalformedPacket("will QoS or retain without a will")
    username = r.string() if flags & 128 else None
    if flags & 64 and not flags & 128 and level == 4:
        raise MalformedPacket("a password without a user name")
    password = r.binary() if flags & 64 else None
    if r.left():
        raise MalformedPacket("bytes after CONNECT's payload")
    return Connect(protocol, level, bool(flags & 2), keepalive, client_id, will, username, password, props)


def check_topic_name(topic: str) -> None:
    """A topic a message is published to: not empty, no wildcards (section 4.7)."""
    if not topic:
        raise MalformedPacket("an empty topic name", RC_TOPIC_NAME_INVALID)
    if "+" in topic or "#" in topic:
        raise MalformedPacket(f"wildcards in the topic name {topic!r}", RC_TOPIC_NAME_INVALID)


def check_topic_filter(f: str) -> None:
    """A subscription's filter: ``#`` only last and alone in its level, ``+`` alone in its level."""
    if not f:
        raise MalformedPacket("an empty topic filter", RC_TOPIC_FILTER_INVALID)
    levels = f.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise MalformedPacket(f"'#' misplaced in {f!r}", RC_TOPIC_FILTER_INVALID)
        if "+" in level and level != "+":
            raise MalformedPacket(f"'+' misplaced in {f!r}", RC_TOPIC_FILTER_INVALID)


def _reason_and_props(r: _Reader, allowed: frozenset[int]) -> tuple[int, Props]:
    """MQTT 5's optional tail: a reason code (absent: success), then properties (absent: none)."""
    reason = r.byte() if r.left() else 0
    props = r.props(allowed) if r.left() else {}
    if r.left():
        raise MalformedPacket("bytes after the properties")
    return reason, props


# Topic names of PUBLISHes lately read, as decoded and checked (valid UTF-8, no wildcards): a
# publisher repeats its topics. Bounded: short names only, the whole cache dropped when full.
_TOPIC_NAMES: dict[bytes, str] = {}
_TOPIC_NAMES_MAX = 4096
_TOPIC_CACHED_LEN = 128


def _decode(kind: int, flags: int, body: bytes, v5: bool) -> Packet:
    if kind != PUBLISH and _FLAGS.get(kind) != flags:
        raise MalformedPacket(f"packet type {kind} with flags {flags:#x}")
    if kind == PUBLISH:
        qos = (flags >> 1) & 3
        if qos == 3:
            raise MalformedPacket("PUBLISH with QoS 3")
        if qos == 0 and flags & 8:
            raise MalformedPacket("DUP set on a QoS 0 PUBLISH")
        n = len(body)
        end = 2 + (body[0] << 8 | body[1]) if n >= 2 else n + 1
        if end > n:
            raise MalformedPacket("packet ends inside a field")
        raw = body[2:end]
        topic = _TOPIC_NAMES.get(raw)
        if topic is not None and not qos and not v5:  # the common case, checked before
            return Publish(topic, body[end:], 0, bool(flags & 1), False, 0, {})
        checked = topic is not None
        if topic is None:
            topic = utf8(raw)
        r = _Reader(body)
        r.pos = end
        pid = _packet_id(r) if qos else 0
        props = r.props(PR.PUBLISH_PROPS) if v5 else {}
        if not checked and (topic or PR.TOPIC_ALIAS not in props):
            check_topic_name(topic)
            if len(raw) <= _TOPIC_CACHED_LEN:
                if len(_TOPIC_NAMES) >= _TOPIC_NAMES_MAX:
                    _TOPIC_NAMES.clear()
                _TOPIC_NAMES[raw] = topic
        return Publish(topic, r.rest(), qos, bool(flags & 1), bool(flags & 8), pid, props)
    r = _Reader(body)
    if kind == CONNECT:
        return _connect(r)
    if kind in (PUBACK, PUBREC, PUBREL, PUBCOMP):
        pid = _packet_id(r)
        if v5:
            reason, props = _reason_and_props(r, PR.ACK_PROPS)
            return PacketId(kind, pid, reason, props)
        if r.left():
            raise MalformedPacket("bytes after the packet identifier")
        return PacketId(kind, pid)
    if kind == SUBSCRIBE:
        pid = _packet_id(r)
        props = r.props(PR.SUBSCRIBE_PROPS) if v5 else {}
        subs: list[tuple[str, int]] = []
        while r.left():
            f = r.string()
            check_topic_filter(f)
            options = r.byte()
            if options & 3 == 3 or options & (0xC0 if v5 else 0xFC) or retain_handling(options) == 3:
                raise MalformedPacket(f"subscription options {options:#x}")
            subs.append((f, options))
        if not subs:
            raise MalformedPacket("SUBSCRIBE without a topic filter", RC_PROTOCOL_ERROR)
        return Subscribe(pid, tuple(subs), props)
    if kind == UNSUBSCRIBE:
        pid = _packet_id(r)
        props = r.props(PR.UNSUBSCRIBE_PROPS) if v5 else {}
        filters: list[str] = []
        while r.left():
            f = r.string()
            check_topic_filter(f)
            filters.append(f)
        if not filters:
            raise MalformedPacket("UNSUBSCRIBE without a topic filter", RC_PROTOCOL_ERROR)
        return Unsubscribe(pid, tuple(filters), props)
    if kind == DISCONNECT:
        if v5:
            return Disconnect(*_reason_and_props(r, PR.DISCONNECT_PROPS))
        if body:
            raise MalformedPacket("DISCONNECT with a body")
        return Disconnect()
    if kind == AUTH and v5:
        return Auth(*_reason_and_props(r, PR.AUTH_PROPS))
    if kind in (PINGREQ, PINGRESP):
        if body:
            raise MalformedPacket(f"packet type {kind} with a body")
        return Bare(kind)
    raise MalformedPacket(f"packet type {kind} is not one a client sends", RC_PROTOCOL_ERROR)


class Parser:
    """Bytes in, packets out. ``max_packet`` bounds one packet's size (fixed header included).
    ``level`` is the protocol level of the connection's CONNECT once it has been read."""

    __slots__ = ("buf", "max_packet", "error", "level")

    def __init__(self, max_packet: int) -> None:
        self.buf = bytearray()
        self.max_packet = max_packet
        self.error: MalformedPacket | None = None  # set once: the packets before it still count
        self.level = 0

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
                    f"packet of {length + i - pos} bytes over the limit of {self.max_packet}",
                    RC_PACKET_TOO_LARGE)
            if n - i < length:
                break
            first = buf[pos]
            pos = i + length
            p = _decode(first >> 4, first & 15, bytes(buf[i:pos]), self.level == 5)
            if isinstance(p, Connect) and not self.level:
                self.level = p.level
            out.append(p)
        if pos:
            del buf[:pos]


# ------------------------------------------------------------------ encoders (server to client)

def _str(s: str) -> bytes:
    b = s.encode()
    return _U16.pack(len(b)) + b


def _packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + PR.varint(len(body)) + body


def encode_connack(session_present: bool, code: int, props: Props | None = None, v5: bool = False) -> bytes:
    body = bytes((1 if session_present and code == ACCEPTED else 0, code))
    return _packet(CONNACK << 4, body + PR.write(props) if v5 else body)


def encode_publish(topic: str, payload: bytes, qos: int, retain: bool, dup: bool, packet_id: int,
                   props: Props | None = None, v5: bool = False) -> bytes:
    head = _str(topic) + (_U16.pack(packet_id) if qos else b"")
    if v5:
        head += PR.write(props)
    flags = (8 if dup else 0) | (qos << 1) | (1 if retain else 0)
    return bytes((PUBLISH << 4 | flags,)) + PR.varint(len(head) + len(payload)) + head + payload


def publish_head(topic: str, qos: int, dup: bool, payload_size: int) -> bytes:
    """What precedes the packet identifier (QoS 1 and 2) or the payload (QoS 0) in a 3.1.1
    PUBLISH without the retain flag: ``encode_publish`` in parts, for packets that differ only
    in their identifiers (``session._Shared``)."""
    rest = _str(topic)
    size = len(rest) + (2 if qos else 0) + payload_size
    return bytes((PUBLISH << 4 | (8 if dup else 0) | qos << 1,)) + PR.varint(size) + rest


U16_PACK = _U16.pack  # a packet identifier's two octets


def encode_packet_id(kind: int, packet_id: int, reason: int = 0, props: Props | None = None) -> bytes:
    """PUBACK, PUBREC, PUBREL (flags 2), PUBCOMP: MQTT 5's reason code and properties are left
    out when they are success and none, which is also the 3.1.1 form."""
    body = _U16.pack(packet_id)
    if reason or props:
        body += bytes((reason,)) + (PR.write(props) if props else b"")
    return _packet(kind << 4 | _FLAGS[kind], body)


def encode_suback(packet_id: int, codes: list[int], v5: bool = False) -> bytes:
    return _packet(SUBACK << 4, _U16.pack(packet_id) + (b"\x00" if v5 else b"") + bytes(codes))


def encode_unsuback(packet_id: int, codes: list[int], v5: bool = False) -> bytes:
    return _packet(UNSUBACK << 4, _U16.pack(packet_id) + (b"\x00" + bytes(codes) if v5 else b""))


def encode_disconnect(reason: int, props: Props | None = None) -> bytes:
    """MQTT 5 only: the server says why it closes."""
    return _packet(DISCONNECT << 4, bytes((reason,)) + PR.write(props))


PINGRESP_BYTES = bytes((PINGRESP << 4, 0))


# ------------------------------------------------------------------ encoders (client to server)
# What a client sends, for the tests and fuzzers of the parser (the broker never sends these).

def encode_connect(c: Connect) -> bytes:
    v5 = c.level == 5
    flags = (2 if c.clean_session else 0) | (128 if c.username is not None else 0) | \
        (64 if c.password is not None else 0)
    payload = _str(c.client_id)
    if c.will is not None:
        flags |= 4 | (c.will.qos << 3) | (32 if c.will.retain else 0)
        payload += (PR.write(c.will.props) if v5 else b"") + _str(c.will.topic)
        payload += _U16.pack(len(c.will.message)) + c.will.message
    if c.username is not None:
        payload += _str(c.username)
    if c.password is not None:
        payload += _U16.pack(len(c.password)) + c.password
    body = _str(c.protocol) + bytes((c.level, flags)) + _U16.pack(c.keepalive)
    return _packet(CONNECT << 4, body + (PR.write(c.props) if v5 else b"") + payload)


def encode_subscribe(s: Subscribe, v5: bool = False) -> bytes:
    body = _U16.pack(s.packet_id) + (PR.write(s.props) if v5 else b"")
    return _packet(SUBSCRIBE << 4 | 2, body + b"".join(_str(f) + bytes((o,)) for f, o in s.filters))


def encode_unsubscribe(u: Unsubscribe, v5: bool = False) -> bytes:
    body = _U16.pack(u.packet_id) + (PR.write(u.props) if v5 else b"")
    return _packet(UNSUBSCRIBE << 4 | 2, body + b"".join(_str(f) for f in u.filters))
