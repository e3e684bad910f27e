"""A shovel's source on a remote AMQP 0-9-1 broker: a consuming connection that reads whole
socket reads.

Theory of operation
-------------------
A shovel's source does one thing at volume: take ``basic.deliver`` + content header + body
frames off one channel and hand each message on. A general client library (aiormq) pays per
frame for that: reads of the frame header and payload, a lock, decoding every method and
content header into objects, queue hops from connection to channel and a task per delivery;
that was most of the CPU a remote shovel spent. This connection is an ``asyncio.Protocol``:
``data_received`` appends a read to a buffer and walks every whole frame in it in one loop.

- ``basic.deliver`` (class 60, method 60) is read in place: the consumer tag is skipped, the
  delivery tag, redelivered bit, exchange and routing key are taken at their offsets; its
  content header keeps the **raw property bytes** (flags + list, exactly what this broker
  stores), so a local destination publishes them without a decode/encode; body frames are
  joined until the header's body size is reached, then the message goes to ``on_message``.
  A property list a client library could not decode (``properties.valid``) breaks the
  connection instead of entering the store.
- Every other frame (the handshake, declare/qos/consume replies, closes, cancels) is decoded
  by pamqp, the codec aiormq uses: no second codec for the long tail of the spec. Frames we
  write are pamqp's too (acks are one per quarter window, not per message).
- Heartbeats: the server's interval (or the URI's ``heartbeat``, the smaller), a heartbeat
  frame every half interval, the connection lost after two intervals without a read.
- Bounds: a frame larger than the negotiated ``frame_max`` or without its frame end breaks the
  connection; every reply is awaited for at most ``OP_TIMEOUT``; the whole open for at most
  ``CONNECT_TIMEOUT``; unsettled deliveries are at most the prefetch window (``basic.qos``).

The URI takes aiormq's query options for TLS (``cafile``, ``capath``, ``certfile``, ``keyfile``,
``no_verify_ssl``), ``heartbeat`` and ``auth`` (``plain``, ``external`` for client certificates),
as federation's aiormq links read them. The destination (``amqp_dest.py``) is this connection
used the other way round.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, unquote, urlsplit

from pamqp import commands
from pamqp import frame as pframe
from pamqp.base import Frame as PFrame

from broker import properties
from broker.shovel.definition import ShovelDef, Uri
from broker.shovel.ends import CONNECT_TIMEOUT, OP_TIMEOUT, EndLost, Message, Settle, new_lost, set_lost

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

    role = "source"  # which end of the shovel, in the reasons it gives

    def __init__(self, lost: asyncio.Future[str]) -> None:
        self.lost = lost
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.frame_max = FRAME_MAX
        self.replies: asyncio.Queue[PFrame] = asyncio.Queue()
        self.channel = 0  # the consuming channel; deliveries on any other are a protocol error
        self.consuming = False
        self.last_read = time.monotonic()
        self.on_message: Callable[[Message], None] | None = None
        self.track: Callable[[int], None] | None = None  # records an unsettled delivery tag
        self._deliver: tuple[int, bool, str, str] | None = None  # method read, content awaited
        self._props = b""
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
            self._props = bytes(buf[start + 12:end])
            if not properties.valid(self._props):
                raise ValueError(f"undecodable message properties: {properties.problem(self._props)}")
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
        if self.consuming and not isinstance(method, commands.Basic.ConsumeOk | commands.Connection.CloseOk):
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

    async def call(self, channel: int, method: PFrame, answer: type[PFrame]) -> PFrame:
        """Write ``method`` and wait for ``answer``; a close instead raises EndLost."""
        self.write(channel, method)
        return await self.expect(answer)

    async def expect(self, answer: type[PFrame]) -> PFrame:
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


def _ssl_context(options: dict[str, str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=options.get("cafile"), capath=options.get("capath"))
    if options.get("certfile"):
        ctx.load_cert_chain(options["certfile"], options.get("keyfile"))
    if options.get("no_verify_ssl", "0") != "0":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


W = TypeVar("W", bound=Wire)


async def open_first(uris: tuple[Uri, ...], name: str, wire_type: type[W]) -> tuple[W, asyncio.Future[str]]:
    """A connection to the first of ``uris`` that takes it, and its ``lost`` future; EndLost
    naming each failure otherwise."""
    problems = []
    for uri in uris:
        lost = new_lost()
        try:
            wire = await asyncio.wait_for(_open_connection(uri, name, lost, wire_type), CONNECT_TIMEOUT)
            return wire, lost
        except TimeoutError:
            problems.append(f"{uri.redacted()}: no answer in {CONNECT_TIMEOUT:g} s")
        except EndLost as exc:  # the broker said why (a close: wrong credentials, no vhost)
            problems.append(f"{uri.redacted()}: {exc}")
        except Exception as exc:  # noqa: BLE001 - refused, TLS, wrong credentials: each is a reason
            problems.append(f"{uri.redacted()}: {type(exc).__name__}: {exc}")
        set_lost(lost, "closed")
    raise EndLost("; ".join(problems))


async def _open_connection(uri: Uri, name: str, lost: asyncio.Future[str], wire_type: type[W]) -> W:
    """TCP (or TLS) and the AMQP handshake to an open connection, within ``CONNECT_TIMEOUT``."""
    parts = urlsplit(uri.text)
    options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    tls = parts.scheme == "amqps"
    host = parts.hostname or "localhost"
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    wire = wire_type(lost)
    loop = asyncio.get_running_loop()
    await loop.create_connection(lambda: wire, host, parts.port or (5671 if tls else 5672),
                                 ssl=_ssl_context(options) if tls else None)
    try:
        await _handshake(wire, parts.username, parts.password, vhost, options, name)
    except BaseException:  # refused, timed out, cancelled: the socket goes with the attempt
        if wire.transport is not None:
            wire.transport.abort()
        raise
    return wire


async def _handshake(wire: Wire, username: str | None, password: str | None, vhost: str,
                     options: dict[str, str], name: str) -> None:
    start = await wire.expect(commands.Connection.Start)
    assert isinstance(start, commands.Connection.Start)
    mechanism = options.get("auth", "plain").upper()
    if mechanism not in str(start.mechanisms).split():
        raise EndLost(f"{wire.role}: the broker does not offer {mechanism} authentication")
    user, secret = unquote(username or "guest"), unquote(password or "guest")
    response = f"\0{user}\0{secret}" if mechanism == "PLAIN" else ""
    client = {"connection_name": f"Shovel {name}", "product": "Skred shovel",
              "capabilities": {"authentication_failure_close": True, "consumer_cancel_notify": True,
                               "connection.blocked": True}}
    wire.write(0, commands.Connection.StartOk(client_properties=client, mechanism=mechanism,  # type: ignore[arg-type]
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


class AmqpSource:
    can_dead_letter = False

    def __init__(self, d: ShovelDef, tag: str, args: dict[str, Any]) -> None:
        self.d = d
        self.tag = tag
        self.args = args  # consumer arguments for this run (x-stream-offset only on the first)
        self.lost = new_lost()
        self.length = 0
        self.wire: Wire | None = None
        self.delivered: collections.deque[int] = collections.deque()  # unsettled tags, in order
        self.settled: set[int] = set()  # settled, not yet covered by a multiple ack
        self.flush_timer: asyncio.TimerHandle | None = None
        self.ack_batch = max(1, d.src_prefetch // 4)

    async def open(self, on_message: Callable[[Message], None]) -> None:
        try:
            await self._open(on_message)
        except BaseException:
            await self.close()
            raise

    async def _open(self, on_message: Callable[[Message], None]) -> None:
        d = self.d
        self.wire, self.lost = await open_first(d.src_uris, d.name, Wire)
        wire, channel = self.wire, 1
        await wire.call(channel, commands.Channel.Open(), commands.Channel.OpenOk)
        queue = d.src_queue or ""
        if queue:
            try:
                ok = await wire.call(channel, commands.Queue.Declare(queue=queue, passive=True),
                                     commands.Queue.DeclareOk)
            except Closed as exc:
                if exc.code != 404:
                    raise
                channel += 1  # a passive declare of a missing queue closed the channel
                await wire.call(channel, commands.Channel.Open(), commands.Channel.OpenOk)
                ok = await wire.call(channel, commands.Queue.Declare(queue=queue, durable=True,
                                                                     arguments=d.src_queue_args),
                                     commands.Queue.DeclareOk)
            assert isinstance(ok, commands.Queue.DeclareOk)
            if d.delete_after == "queue-length":
                self.length = ok.message_count or 0
        else:
            ok = await wire.call(channel, commands.Queue.Declare(exclusive=True, auto_delete=True,
                                                                 arguments=d.src_queue_args),
                                 commands.Queue.DeclareOk)
            assert isinstance(ok, commands.Queue.DeclareOk)
            queue = ok.queue or ""
            await wire.call(channel, commands.Queue.Bind(queue=queue, exchange=d.src_exchange or "",
                                                         routing_key=d.src_exchange_key),
                            commands.Queue.BindOk)
        await wire.call(channel, commands.Basic.Qos(prefetch_count=d.src_prefetch), commands.Basic.QosOk)
        no_ack = d.ack_mode == "no-ack"
        wire.channel, wire.on_message = channel, on_message
        wire.track = None if no_ack else self.delivered.append  # nothing to settle without acks
        wire.consuming = True
        await wire.call(channel, commands.Basic.Consume(queue=queue, consumer_tag=self.tag, no_ack=no_ack,
                                                        arguments=self.args), commands.Basic.ConsumeOk)

    def settle(self, tag: int, how: Settle) -> None:
        """Acks are coalesced: settled messages share one ``basic.ack`` with ``multiple`` up to the
        highest delivery tag below which everything is settled (a message still in flight is never
        covered), written once a quarter of the prefetch window is settled or ``ACK_DELAY`` after
        the first of them, whichever comes first (so the broker's window never starves and a
        lone message is acked promptly; what waits behind a message still in flight is written
        with the settle that frees it); a requeue is sent at once. Closing writes what is due."""
        wire = self.wire
        if wire is None or self.lost.done() or self.d.ack_mode == "no-ack":
            return  # gone: the broker gives the message back itself
        self.settled.add(tag)
        if how is not Settle.ACK:
            wire.write(wire.channel, commands.Basic.Reject(delivery_tag=tag, requeue=True))
        if len(self.settled) >= self.ack_batch:
            self._flush()
        elif self.flush_timer is None:
            self.flush_timer = asyncio.get_running_loop().call_later(ACK_DELAY, self._flush)

    def _flush(self) -> None:
        if self.flush_timer is not None:
            self.flush_timer.cancel()
            self.flush_timer = None
        wire, delivered, settled = self.wire, self.delivered, self.settled
        upto = 0
        while delivered and delivered[0] in settled:
            upto = delivered.popleft()
            settled.discard(upto)  # (a rejected tag in the run is no longer the broker's: multiple skips it)
        if upto and wire is not None:
            wire.write(wire.channel, commands.Basic.Ack(delivery_tag=upto, multiple=True))

    async def close(self) -> None:
        wire, self.wire = self.wire, None
        if wire is not None and not self.lost.done():
            self.wire = wire
            self._flush()  # what was settled is acked before the connection goes
            self.wire = None
        if self.flush_timer is not None:
            self.flush_timer.cancel()
            self.flush_timer = None
        if wire is None:
            return
        wire.on_message = wire.track = None
        if not wire.lost.done():
            try:
                bye = commands.Connection.Close(reply_code=200, reply_text="shovel closing", class_id=0,
                                                method_id=0)
                await asyncio.wait_for(wire.call(0, bye, commands.Connection.CloseOk), CLOSE_TIMEOUT)
            except (EndLost, TimeoutError):
                pass  # gone already, or not answering: the socket closes below all the same
        set_lost(wire.lost, "closed")
        if wire.transport is not None:
            wire.transport.close()
