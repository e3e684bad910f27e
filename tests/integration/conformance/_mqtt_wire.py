"""What an MQTT client sees, as a transcript that brokers' runs can be diffed on.

Theory of operation: a scenario drives raw MQTT connections (``Client``, a socket and a few
encoders: the test owns its codec, so a broker-side change cannot make both sides agree) through
an ``MRun``. Every packet a scenario reads is appended to the run's transcript as a small tuple
``(client, kind, fields...)``: CONNACK's session-present flag and code, SUBACK and UNSUBACK codes,
a delivery's topic, payload, QoS, retain flag and subscription identifiers, an acknowledgement's
packet identifier and reason code, a server DISCONNECT's reason, ``closed`` when the server ended
the connection, ``timeout`` when nothing came. The run's unique topic prefix and client ids are
replaced by the scenario's names, so transcripts of different brokers compare exactly.

Absence is observed without sleeping: a scenario that expects no message publishes a marker
after the operation under test and reads up to it (``until_marker``), since every broker here
keeps a publisher's messages in order to a subscriber. Received QoS 1 and 2 deliveries are
acknowledged as a client library would (PUBACK; PUBREC, PUBREL, PUBCOMP).

A run given a ``url`` speaks MQTT over WebSocket instead (``WebSocketStream``: subprotocol
``mqtt``, each packet written as one binary message, the messages read as one byte stream), so
the same scenarios compare the brokers' WebSocket listeners.
"""

from __future__ import annotations

import socket
import struct
import time
import uuid
from typing import Any

import websocket

Record = tuple[Any, ...]
READ_TIMEOUT = 8.0  # seconds for one expected packet; a shared 2-core machine can be slow

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14
KINDS = {CONNACK: "connack", PUBLISH: "publish", PUBACK: "puback", PUBREC: "pubrec", PUBREL: "pubrel",
         PUBCOMP: "pubcomp", SUBACK: "suback", UNSUBACK: "unsuback", PINGRESP: "pingresp",
         DISCONNECT: "disconnect"}

# MQTT 5 property identifiers and how their values are encoded (section 2.2.2.2)
_BYTE, _TWO, _FOUR, _VAR, _STR, _BIN, _PAIR = range(7)
_PROP_TYPES = {
    0x01: _BYTE, 0x02: _FOUR, 0x03: _STR, 0x08: _STR, 0x09: _BIN, 0x0B: _VAR, 0x11: _FOUR, 0x12: _STR,
    0x13: _TWO, 0x15: _STR, 0x16: _BIN, 0x17: _BYTE, 0x18: _FOUR, 0x19: _BYTE, 0x1A: _STR, 0x1C: _STR,
    0x1F: _STR, 0x21: _TWO, 0x22: _TWO, 0x23: _TWO, 0x24: _BYTE, 0x25: _BYTE, 0x26: _PAIR, 0x27: _FOUR,
    0x28: _BYTE, 0x29: _BYTE, 0x2A: _BYTE,
}
SUBSCRIPTION_ID, SESSION_EXPIRY, ASSIGNED_CLIENT_ID, TOPIC_ALIAS, WILL_DELAY = 0x0B, 0x11, 0x12, 0x23, 0x18


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, b = n >> 7, n & 127
        out.append(b | (128 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(b: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        byte = b[pos]
        pos += 1
        n |= (byte & 127) << shift
        shift += 7
        if not byte & 128:
            return n, pos


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("!H", len(raw)) + raw


def prop(ident: int, value: int | str | bytes) -> bytes:
    kind = _PROP_TYPES[ident]
    if kind == _BYTE:
        return bytes((ident, int(value)))  # type: ignore[arg-type]
    if kind == _TWO:
        return bytes((ident,)) + struct.pack("!H", value)
    if kind == _FOUR:
        return bytes((ident,)) + struct.pack("!I", value)
    if kind == _VAR:
        return bytes((ident,)) + varint(int(value))  # type: ignore[arg-type]
    return bytes((ident,)) + s(value)  # type: ignore[arg-type]


def read_props(b: bytes, pos: int) -> tuple[dict[int, list[Any]], int]:
    length, pos = _read_varint(b, pos)
    end, out = pos + length, {}  # type: ignore[var-annotated]
    while pos < end:
        ident = b[pos]
        kind = _PROP_TYPES[ident]
        pos += 1
        if kind == _BYTE:
            val: Any = b[pos]
            pos += 1
        elif kind == _TWO:
            (val,), pos = struct.unpack_from("!H", b, pos), pos + 2
        elif kind == _FOUR:
            (val,), pos = struct.unpack_from("!I", b, pos), pos + 4
        elif kind == _VAR:
            val, pos = _read_varint(b, pos)
        elif kind == _PAIR:
            (n,) = struct.unpack_from("!H", b, pos)
            k = b[pos + 2:pos + 2 + n]
            pos += 2 + n
            (m,) = struct.unpack_from("!H", b, pos)
            val, pos = (k.decode(), b[pos + 2:pos + 2 + m].decode()), pos + 2 + m
        else:
            (n,) = struct.unpack_from("!H", b, pos)
            val, pos = b[pos + 2:pos + 2 + n], pos + 2 + n
        out.setdefault(ident, []).append(val)
    return out, end


def packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + varint(len(body)) + body


class MRun:
    """One scenario's run against one broker (and MQTT version): names, clients, transcript."""

    def __init__(self, broker: str, host: str, port: int, version: int, url: str = "") -> None:
        self.broker, self.host, self.port, self.version = broker, host, port, version
        self.url = url  # MQTT over WebSocket at this URL (empty: plain TCP)
        self.tag = uuid.uuid4().hex[:8]
        self.transcript: list[Record] = []
        self.clients: list[Client] = []

    @property
    def v5(self) -> bool:
        return self.version == 5

    def topic(self, name: str) -> str:
        return f"conf{self.tag}/{name}"

    def client_id(self, name: str) -> str:
        return f"conf{self.tag}{name}"

    def log(self, rec: Record) -> None:
        self.transcript.append(tuple(self.norm(x) for x in rec))

    def norm(self, x: Any) -> Any:
        if isinstance(x, str):
            return x.replace(f"conf{self.tag}", "<run>")
        if isinstance(x, bytes):
            return self.norm(x.decode(errors="replace"))
        if isinstance(x, (list, tuple)):
            return type(x)(self.norm(y) for y in x)
        return x

    def client(self, name: str, **kw: Any) -> Client:
        c = Client(self, name, **kw)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.sock.close()


class WebSocketStream:
    """An MQTT over WebSocket connection with the few socket methods ``Client`` uses."""

    def __init__(self, url: str) -> None:
        self.ws = websocket.create_connection(url, subprotocols=["mqtt"], timeout=READ_TIMEOUT)

    def sendall(self, data: bytes) -> None:
        try:
            self.ws.send_binary(data)
        except websocket.WebSocketConnectionClosedException as exc:
            raise BrokenPipeError from exc

    def settimeout(self, seconds: float) -> None:
        self.ws.settimeout(seconds)

    def recv(self, _size: int) -> bytes:
        """The next message's bytes; b"" once the server closed."""
        try:
            data = self.ws.recv()
        except websocket.WebSocketTimeoutException as exc:
            raise TimeoutError from exc
        except (websocket.WebSocketConnectionClosedException, ConnectionError):
            return b""
        return data.encode() if isinstance(data, str) else bytes(data)

    def close(self) -> None:
        self.ws.close()


class Client:
    """A raw MQTT connection of a scenario; ``name`` labels its records in the transcript."""

    def __init__(self, run: MRun, name: str, *, client_id: str | None = None, user: str | None = "guest",
                 password: str | None = "guest", clean: bool = True, keepalive: int = 60,
                 will: tuple[str, bytes, int, bool] | None = None, will_props: bytes = b"",
                 props: bytes = b"", version: int | None = None, log_connack: bool = True) -> None:
        self.run, self.name = run, name
        self.version = version or run.version
        self.sock: socket.socket | WebSocketStream = (
            WebSocketStream(run.url) if run.url else socket.create_connection((run.host, run.port),
                                                                              timeout=READ_TIMEOUT))
        self.buf = b""
        self.pending: list[tuple[int, int, bytes]] = []
        self.next_id = 1
        cid = run.client_id(name) if client_id is None else client_id
        flags = (2 if clean else 0) | (128 if user is not None else 0) | (64 if password is not None else 0)
        payload = s(cid)
        if will is not None:
            topic, msg, qos, retain = will
            flags |= 4 | (qos << 3) | (32 if retain else 0)
            if self.version == 5:
                payload += varint(len(will_props)) + will_props
            payload += s(topic) + s(msg)
        if user is not None:
            payload += s(user)
        if password is not None:
            payload += s(password)
        head = s("MQTT") + bytes((self.version, flags)) + struct.pack("!H", keepalive)
        if self.version == 5:
            head += varint(len(props)) + props
        self.send(packet(CONNECT << 4, head + payload))
        self.connack: Record = self.expect(CONNACK, log=log_connack)

    # ---------------------------------------------------------------- wire

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass  # the server closed: the next read records it

    def _read(self, timeout: float) -> tuple[int, int, bytes] | None:
        """The next packet, None when the server closed; TimeoutError when nothing came."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self.buf) >= 2:
                try:
                    length, pos = _read_varint(self.buf, 1)
                except IndexError:
                    length, pos = -1, 0
                if length >= 0 and len(self.buf) >= pos + length:
                    first, body = self.buf[0], self.buf[pos:pos + length]
                    self.buf = self.buf[pos + length:]
                    return first >> 4, first & 15, body
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                return None
            except OSError as exc:
                if isinstance(exc, TimeoutError | socket.timeout):
                    raise TimeoutError from exc
                return None
            if not chunk:
                return None
            self.buf += chunk

    def describe(self, kind: int, flags: int, body: bytes) -> Record:
        v5 = self.version == 5
        if kind == CONNACK:
            rec: Record = (self.name, "connack", body[0] & 1, body[1])
            if v5 and len(body) > 2:
                props, _ = read_props(body, 2)
                rec += (("assigned-client-id", ASSIGNED_CLIENT_ID in props),)
            return rec
        if kind == PUBLISH:
            qos, retain = (flags >> 1) & 3, flags & 1
            (n,) = struct.unpack_from("!H", body, 0)
            topic, pos = body[2:2 + n].decode(errors="replace"), 2 + n
            if qos:
                pos += 2
            sub_ids: list[int] = []
            if v5:
                props, pos = read_props(body, pos)
                sub_ids = sorted(props.get(SUBSCRIPTION_ID, []))
            rec = (self.name, "publish", topic, body[pos:], qos, retain)
            return (*rec, ("sub-ids", sub_ids)) if sub_ids else rec
        if kind in (PUBACK, PUBREC, PUBREL, PUBCOMP):
            (pid,) = struct.unpack_from("!H", body, 0)
            return (self.name, KINDS[kind], pid, body[2] if len(body) > 2 else 0)
        if kind in (SUBACK, UNSUBACK):
            (pid,) = struct.unpack_from("!H", body, 0)
            pos = read_props(body, 2)[1] if v5 else 2
            return (self.name, KINDS[kind], pid, list(body[pos:]))
        if kind == DISCONNECT:
            return (self.name, "disconnect", body[0] if body else 0)
        return (self.name, KINDS.get(kind, str(kind)))

    def next(self, timeout: float = READ_TIMEOUT, log: bool = True) -> Record:
        """The next packet (a pending one first), described, logged, and acknowledged if a
        delivery."""
        try:
            pkt = self.pending.pop(0) if self.pending else self._read(timeout)
        except TimeoutError:
            rec: Record = (self.name, "timeout")
        else:
            rec = (self.name, "closed") if pkt is None else self.describe(*pkt)
            if pkt is not None and pkt[0] == PUBLISH:
                self._ack(pkt)
        if log:
            self.run.log(rec)
        return rec

    def _ack(self, pkt: tuple[int, int, bytes]) -> None:
        kind, flags, body = pkt
        qos = (flags >> 1) & 3
        if not qos:
            return
        (n,) = struct.unpack_from("!H", body, 0)
        pid = body[2 + n:4 + n]
        if qos == 1:
            self.send(packet(PUBACK << 4, pid))
            return
        self.send(packet(PUBREC << 4, pid))
        rel = self.expect(PUBREL, log=False)
        if rel[1] == "pubrel":
            self.send(packet(PUBCOMP << 4, pid))

    def expect(self, kind: int, log: bool = True, also: tuple[int, ...] = ()) -> Record:
        """Read until a packet of ``kind`` or ``also`` (deliveries in between are kept for
        ``next``)."""
        deadline = time.monotonic() + READ_TIMEOUT
        while True:
            try:
                pkt = self._read(max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                rec: Record = (self.name, "timeout")
                break
            if pkt is None:
                rec = (self.name, "closed")
                break
            if pkt[0] == kind or pkt[0] in also:
                rec = self.describe(*pkt)
                break
            if pkt[0] == DISCONNECT:
                rec = self.describe(*pkt)
                break
            self.pending.append(pkt)
        if log:
            self.run.log(rec)
        return rec

    # ---------------------------------------------------------------- operations

    def pid(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def subscribe(self, *filters: str, qos: int = 1, options: int = 0, sub_id: int | None = None) -> Record:
        pid = self.pid()
        body = struct.pack("!H", pid)
        if self.version == 5:
            props = prop(SUBSCRIPTION_ID, sub_id) if sub_id is not None else b""
            body += varint(len(props)) + props
        for f in filters:
            body += s(f) + bytes((qos | options,))
        self.send(packet((SUBSCRIBE << 4) | 2, body))
        return self.expect(SUBACK)

    def unsubscribe(self, *filters: str) -> Record:
        body = struct.pack("!H", self.pid()) + (b"\x00" if self.version == 5 else b"")
        self.send(packet((UNSUBSCRIBE << 4) | 2, body + b"".join(s(f) for f in filters)))
        return self.expect(UNSUBACK)

    def publish(self, topic: str, payload: bytes | str, qos: int = 0, retain: bool = False,
                props: bytes = b"") -> None:
        """Publish and, for QoS 1 and 2, read (and log) the broker's acknowledgements."""
        raw = payload.encode() if isinstance(payload, str) else payload
        pid = self.pid() if qos else 0
        body = s(topic) + (struct.pack("!H", pid) if qos else b"")
        if self.version == 5:
            body += varint(len(props)) + props
        self.send(packet((PUBLISH << 4) | (qos << 1) | int(retain), body + raw))
        if qos == 1:
            self.expect(PUBACK)
        elif qos == 2:
            rec = self.expect(PUBREC, also=(PUBACK,))  # RabbitMQ 3.10 takes QoS 2 as QoS 1
            if rec[1] == "pubrec":
                self.send(packet((PUBREL << 4) | 2, struct.pack("!H", pid)))
                self.expect(PUBCOMP)

    def receive(self, n: int) -> list[Record]:
        """``n`` deliveries, sorted by topic and payload (brokers may interleave topics)."""
        got = [self.next(log=False) for _ in range(n)]
        for rec in sorted(got, key=repr):
            self.run.log(rec)
        return got

    def until_marker(self, publisher: Client, topic: str) -> None:
        """Publish a marker on ``topic`` (which this client subscribes to) and log every delivery
        before it: the way to observe that nothing else came."""
        publisher.publish(topic, b"<marker>", qos=1)
        for _ in range(20):
            rec = self.next(log=False)
            if rec[1] != "publish" or rec[3] == b"<marker>":
                if rec[1] != "publish":
                    self.run.log(rec)
                return
            self.run.log(rec)

    def closed_within(self, seconds: float) -> None:
        """Log how the server ends this connection within ``seconds`` (DISCONNECT, close) or
        ``still-open``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                pkt = self._read(max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
            if pkt is None:
                self.run.log((self.name, "closed"))
                return
            if pkt[0] == DISCONNECT:
                self.run.log(self.describe(*pkt))
        self.run.log((self.name, "still-open"))

    def ping(self) -> None:
        """PINGREQ, and log the answer: ``pingresp`` while the connection is open."""
        self.send(packet(PINGREQ << 4, b""))
        self.expect(PINGRESP)

    def disconnect(self, props: bytes = b"") -> None:
        body = (b"\x00" + varint(len(props)) + props) if self.version == 5 and props else b""
        self.send(packet(DISCONNECT << 4, body))
        self.sock.close()

    def drop(self) -> None:
        """End the connection without DISCONNECT (an abnormal end: the will goes out)."""
        self.sock.close()
