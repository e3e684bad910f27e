"""One AMQP 0-9-1 client connection to another broker, reading whole socket reads.

Theory of operation
-------------------
A link does one thing at volume: take ``basic.deliver`` + content header + body frames off one
channel and hand each message on (a consumer), or frame publishes and read their confirms (a
publisher, ``publisher.py``). A general client library (aiormq) pays per frame for that: reads
of the frame header and payload, a lock, decoding every method and content header into objects,
queue hops from connection to channel and a task per delivery; that was most of the CPU a remote
shovel or federation link spent. This connection is an ``asyncio.Protocol``: ``data_received``
appends a read to a buffer and walks every whole frame in it in one loop.

- ``basic.deliver`` (class 60, method 60) is read in place: the consumer tag is skipped, the
  delivery tag, redelivered bit, exchange and routing key are taken at their offsets; its
  content header keeps the **raw property bytes** (flags + list, exactly what this broker
  stores), so a local destination publishes them without a decode/encode; body frames are
  joined until the header's body size is reached, then the message goes to ``on_message``.
  A property list a client library could not decode (``properties.valid``) breaks the
  connection instead of entering the store; a list equal to the last one that passed is not
  checked again (a source's messages mostly carry one list; the check was a tenth of the
  instructions this connection spends on a 1 KiB delivery).
- Every other frame (the handshake, declare/bind/qos/consume/cancel replies, closes, cancels) is
  decoded by pamqp, the codec aiormq uses: no second codec for the long tail of the spec. Frames
  we write are pamqp's too. Once consuming, a reply is kept only while a call waits for one
  (``connection.blocked`` and the like concern nobody: not kept, so nothing piles up).
- Heartbeats: the server's interval (or the URI's ``heartbeat``, the smaller), a heartbeat
  frame every half interval, the connection lost after two intervals without a read.
- Bounds: a frame larger than the negotiated ``frame_max`` or without its frame end breaks the
  connection; every reply is awaited for at most ``OP_TIMEOUT``; the whole open for at most
  ``CONNECT_TIMEOUT``; unsettled deliveries are at most the prefetch window (``basic.qos``).

The URI takes aiormq's query options for TLS (``cafile``, ``capath``, ``certfile``, ``keyfile``,
``no_verify_ssl``), ``heartbeat`` and ``auth`` (``plain``, ``external`` for client certificates).
"""

from __future__ import annotations

import asyncio
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, unquote, urlsplit

from pamqp import commands
from pamqp import frame as pframe
from pamqp.base import Frame as PFrame

from broker import properties
from broker.links.message import CONNECT_TIMEOUT, OP_TIMEOUT, EndLost, Message, new_lost, set_lost

CLOSE_TIMEOUT = 5.0  # seconds for the broker's connection.close-ok
ACK_DELAY = 0.05  # seconds a settled message waits for others to share its ``basic.ack``
FRAME_MAX = 131072  # what we ask for (RabbitMQ's default); the server may ask for less
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"

_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_U32 = struct.Struct(">I")
_TAG_REDELIVERED = struct.Struct(">QB")
_BODY_SIZE = struct.Struct(">Q")
_DELIVER = 0x003C003C  # basic.deliver (60, 60)
_TYPE_METHOD, _TYPE_HEADER, _TYPE_BODY, _TYPE_HEARTBEAT = 1, 2, 3, 8


class Wire(asyncio.Protocol):
    """The socket: frames in (deliveries in place, the rest through pamqp), frames out."""

    role = "source"  # which end of the link, in the reasons it gives

    def __init__(self, lost: asyncio.Future[str]) -> None:
        self.lost = lost
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.frame_max = FRAME_MAX
        self.replies: asyncio.Queue[PFrame] = asyncio.Queue()
        self.channel = 0  # the consuming channel; deliveries on any other are a protocol error
        self.consuming = False
        self.awaiting = 0  # calls waiting for a reply (once consuming, replies nobody awaits are dropped)
        self.server_properties: dict[str, Any] = {}
        self.last_read = time.monotonic()
        self.on_message: Callable[[Message], None] | None = None
        self.track: Callable[[int], None] | None = None  # records an unsettled delivery tag
        self._deliver: tuple[int, bool, str, str] | None = None  # method read, content awaited
        self._props = b""
        self._valid_props = b""  # the last property list that passed ``properties.valid``
        self._left = 0  # body bytes still to come
        self._parts: list[bytes] = []

    # ------------------------------------------------------------------ asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass of it)
        self.transport.write(PROTOCOL_HEADER)

    def connection_lost(self, exc: Exception | None) -> None:
        what = f"{self.role} connection"
        set_lost(self.lost, f"{what} lost: {exc}" if exc else f"{what} closed")
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.last_read = time.monotonic()
        buf = self.buf
        buf += data
        pos, size_all = 0, len(buf)
        try:
            while size_all - pos >= 8:
                kind, channel, size = _HEAD.unpack_from(buf, pos)
                if size > self.frame_max:
                    raise ValueError(f"a frame of {size} bytes (frame_max {self.frame_max})")
                end = pos + 7 + size
                if end >= size_all:
                    break
                if buf[end] != 0xCE:
                    raise ValueError("a frame without its frame end")
                self._frame(kind, channel, buf, pos + 7, end)
                pos = end + 1
        except Exception as exc:  # noqa: BLE001 - whatever the peer sent: the connection breaks
            self.fail(f"{self.role} sent a bad frame: {type(exc).__name__}: {exc}")
            return
        del buf[:pos]

    # ------------------------------------------------------------------- frames
    def _frame(self, kind: int, channel: int, buf: bytearray, start: int, end: int) -> None:
        if kind == _TYPE_METHOD:
            if _U32.unpack_from(buf, start)[0] == _DELIVER and channel == self.channel:
                at = start + 5 + buf[start + 4]  # past the consumer tag
                tag, redelivered = _TAG_REDELIVERED.unpack_from(buf, at)
                at += 9
                exchange = buf[at + 1:at + 1 + buf[at]].decode()
                at += 1 + buf[at]
                routing_key = buf[at + 1:at + 1 + buf[at]].decode()
                self._deliver = (tag, bool(redelivered), exchange, routing_key)
                return
            method = pframe.unmarshal(bytes(buf[start - 7:end + 1]))[2]
            if not isinstance(method, PFrame):
                raise ValueError("a method frame that is not a method")
            self._method(channel, method)
        elif kind == _TYPE_HEADER:
            if self._deliver is None or channel != self.channel:
                raise ValueError("a content header without its basic.deliver")
            self._left = _BODY_SIZE.unpack_from(buf, start + 4)[0]
            props = self._props = bytes(buf[start + 12:end])
            if props != self._valid_props:  # a publisher's messages mostly repeat one list: checked once
                if not properties.valid(props):
                    raise ValueError(f"undecodable message properties: {properties.problem(props)}")
                self._valid_props = props
            if self._left == 0:
                self._emit(b"")
        elif kind == _TYPE_BODY:
            if self._deliver is None or channel != self.channel or end - start > self._left:
                raise ValueError("a body frame without its basic.deliver")
            self._left -= end - start
            if self._left == 0 and not self._parts:
                self._emit(bytes(buf[start:end]))
                return
            self._parts.append(bytes(buf[start:end]))
            if self._left == 0:
                parts, self._parts = self._parts, []
                self._emit(b"".join(parts))
        elif kind != _TYPE_HEARTBEAT:
            raise ValueError(f"frame type {kind}")

    def _emit(self, body: bytes) -> None:
        assert self._deliver is not None
        tag, redelivered, exchange, routing_key = self._deliver
        self._deliver = None
        if self.track is not None:
            self.track(tag)
        if self.on_message is not None:
            self.on_message(Message(exchange, routing_key, None, body, redelivered, tag, raw=self._props))

    def _method(self, channel: int, method: PFrame) -> None:
        if isinstance(method, commands.Connection.Close):
            self.write(0, commands.Connection.CloseOk())
            set_lost(self.lost, f"{self.role}: {method.reply_code} {method.reply_text}")
        elif isinstance(method, commands.Channel.Close):
            self.write(channel, commands.Channel.CloseOk())
            if self.consuming:
                set_lost(self.lost, f"{self.role} channel closed: {method.reply_code} {method.reply_text}")
        elif isinstance(method, commands.Basic.Cancel) and self.consuming:
            set_lost(self.lost, f"{self.role}: the broker cancelled the consumer (queue deleted?)")
            return
        if self.consuming and not self.awaiting:
            return  # nobody waits for it (connection.blocked concerns publishers): not kept
        self.replies.put_nowait(method)

    # ------------------------------------------------------------------ writing
    def write(self, channel: int, method: PFrame) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(pframe.marshal(method, channel))

    def fail(self, reason: str) -> None:
        set_lost(self.lost, reason)
        if self.transport is not None:
            self.transport.abort()

    async def shutdown(self, text: str) -> None:
        """``connection.close`` and its ``close-ok`` (for at most ``CLOSE_TIMEOUT``), then the socket."""
        if not self.lost.done() and self.transport is not None and not self.transport.is_closing():
            try:
                bye = commands.Connection.Close(reply_code=200, reply_text=text, class_id=0, method_id=0)
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await self.call(0, bye, commands.Connection.CloseOk)
            except (EndLost, TimeoutError):
                pass  # gone already, or not answering: the socket closes below all the same
        set_lost(self.lost, "closed")
        if self.transport is not None:
            self.transport.close()

    async def call(self, channel: int, method: PFrame, answer: type[PFrame]) -> PFrame:
        """Write ``method`` and wait for ``answer``; a close instead raises EndLost."""
        self.write(channel, method)
        return await self.expect(answer)

    async def expect(self, answer: type[PFrame]) -> PFrame:
        self.awaiting += 1
        try:
            return await self._expect(answer)
        finally:
            self.awaiting -= 1

    async def _expect(self, answer: type[PFrame]) -> PFrame:
        deadline = time.monotonic() + OP_TIMEOUT
        while True:
            got: asyncio.Future[Any] = asyncio.ensure_future(self.replies.get())
            lost: asyncio.Future[Any] = self.lost
            done, _ = await asyncio.wait([got, lost], timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if got not in done:
                got.cancel()
                if self.lost.done():
                    raise EndLost(self.lost.result())
                raise EndLost(f"{self.role}: no {answer.name} from the broker in {OP_TIMEOUT:g} s")
            reply = got.result()
            if isinstance(reply, answer):
                return reply
            if isinstance(reply, commands.Connection.Close | commands.Channel.Close):
                raise Closed(reply.reply_code or 0, f"{self.role}: {reply.reply_code} {reply.reply_text}")


class Closed(EndLost):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code


def ssl_context(options: dict[str, str]) -> ssl.SSLContext:
    """A client's TLS context from a URI's query options (aiormq's names: ``cafile``, ``capath``,
    ``certfile``, ``keyfile``, ``no_verify_ssl``); also the Spark source's ``https://`` read."""
    ctx = ssl.create_default_context(cafile=options.get("cafile"), capath=options.get("capath"))
    if options.get("certfile"):
        ctx.load_cert_chain(options["certfile"], options.get("keyfile"))
    if options.get("no_verify_ssl", "0") != "0":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


W = TypeVar("W", bound=Wire)


def redact(uri: str) -> str:
    """The URI without its password, for a status and the logs."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


async def open_first(uris: Sequence[str], client: dict[str, Any],
                     wire_type: type[W]) -> tuple[W, asyncio.Future[str]]:
    """A connection to the first of ``uris`` that takes it, and its ``lost`` future; EndLost
    naming each failure otherwise. ``client`` is the connection's client properties
    (``connection_name``, ``product``)."""
    problems = []
    for uri in uris:
        lost = new_lost()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                wire = await _open_connection(uri, client, lost, wire_type)
            return wire, lost
        except TimeoutError:
            problems.append(f"{redact(uri)}: no answer in {CONNECT_TIMEOUT:g} s")
        except EndLost as exc:  # the broker said why (a close: wrong credentials, no vhost)
            problems.append(f"{redact(uri)}: {exc}")
        except Exception as exc:  # noqa: BLE001 - refused, TLS, wrong credentials: each is a reason
            problems.append(f"{redact(uri)}: {type(exc).__name__}: {exc}")
        set_lost(lost, "closed")
    raise EndLost("; ".join(problems))


async def _open_connection(uri: str, client: dict[str, Any], lost: asyncio.Future[str],
                           wire_type: type[W]) -> W:
    """TCP (or TLS) and the AMQP handshake to an open connection, within ``CONNECT_TIMEOUT``."""
    parts = urlsplit(uri)
    options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    tls = parts.scheme == "amqps"
    host = parts.hostname or "localhost"
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    wire = wire_type(lost)
    loop = asyncio.get_running_loop()
    await loop.create_connection(lambda: wire, host, parts.port or (5671 if tls else 5672),
                                 ssl=ssl_context(options) if tls else None)
    try:
        await _handshake(wire, parts.username, parts.password, vhost, options, client)
    except BaseException:  # refused, timed out, cancelled: the socket goes with the attempt
        if wire.transport is not None:
            wire.transport.abort()
        raise
    return wire


async def _handshake(wire: Wire, username: str | None, password: str | None, vhost: str,
                     options: dict[str, str], client: dict[str, Any]) -> None:
    start = await wire.expect(commands.Connection.Start)
    assert isinstance(start, commands.Connection.Start)
    mechanism = options.get("auth", "plain").upper()
    if mechanism not in str(start.mechanisms).split():
        raise EndLost(f"{wire.role}: the broker does not offer {mechanism} authentication")
    user, secret = unquote(username or "guest"), unquote(password or "guest")
    response = f"\0{user}\0{secret}" if mechanism == "PLAIN" else ""
    client = {**client, "capabilities": {"authentication_failure_close": True, "consumer_cancel_notify": True,
                                         "connection.blocked": True}}
    wire.server_properties = dict(start.server_properties or {})
    wire.write(0, commands.Connection.StartOk(client_properties=client, mechanism=mechanism,
                                              response=response))
    tune = await wire.expect(commands.Connection.Tune)
    assert isinstance(tune, commands.Connection.Tune)
    wire.frame_max = min(FRAME_MAX, tune.frame_max or FRAME_MAX)
    asked = int(options.get("heartbeat", tune.heartbeat))
    heartbeat = min(asked, tune.heartbeat) if asked and tune.heartbeat else 0
    wire.write(0, commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=wire.frame_max,
                                             heartbeat=heartbeat))
    await wire.call(0, commands.Connection.Open(virtual_host=vhost), commands.Connection.OpenOk)
    if heartbeat:
        _beat(wire, heartbeat)


def _beat(wire: Wire, interval: int) -> None:
    """Write a heartbeat every half interval; the connection is lost after two silent intervals."""
    def tick() -> None:
        if wire.lost.done() or wire.transport is None:
            return
        if time.monotonic() - wire.last_read > 2 * interval:
            wire.fail(f"{wire.role}: no heartbeat from the broker in {2 * interval} s")
            return
        wire.transport.write(HEARTBEAT_FRAME)
        asyncio.get_running_loop().call_later(interval / 2, tick)

    asyncio.get_running_loop().call_later(interval / 2, tick)


