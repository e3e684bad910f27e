"""Publishing to another broker: a whole event-loop turn of publishes in one system call.

Theory of operation
-------------------
A general client library publishes one message at a time: a lock, three frames built from
objects (the content properties encoded again from their fields), a socket write and a future
per message. A ``Publisher`` uses the link connection (``wire.py``) the other way round:

- ``send_now`` frames ``basic.publish`` + content header + body frames into one buffer: the
  method frame from the exchange and routing key, the content header from the message's **raw
  property bytes** as its source had them (no decode or encode), the body cut at the
  negotiated ``frame_max``. The buffer is written once per event-loop turn (a source hands over a
  whole socket read at once), or as soon as it holds ``FLUSH_BYTES``.
- With ``confirm`` (publisher confirms selected on the channel) every publish takes the
  channel's next delivery tag and waits for its ``basic.ack`` (``multiple``: every tag up to it)
  or ``basic.nack`` (``RETRY``: RabbitMQ's ``reject-publish`` overflow), read in place off the
  socket. Without, a publish is ``OK`` once framed.
- Bounds: what is unconfirmed is at most what the caller hands over (a link's prefetch window);
  the socket's write buffer is bounded by that too. A broker that stops reading
  (``connection.blocked``, a full disk) stops the confirms, so the caller's source stops: the
  link slows down, nothing is dropped.
- ``release`` (the connection is gone or closing) answers ``RETRY`` to every publish still
  waiting: its source gives the message back and the next run sends it again, so what was in
  flight may arrive twice, never not at all.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from collections.abc import Callable

from broker.links.message import EMPTY_PROPERTIES, EndLost, Message, Verdict, new_lost, set_lost
from broker.links.wire import Wire

FLUSH_BYTES = 256 * 1024  # a turn's publishes are written at once, or when this much is buffered
_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_PUBLISH = struct.Struct(">BHIHHH")  # frame head, class 60, method 40, ticket 0
_CONTENT = struct.Struct(">BHIHHQ")  # frame head, class 60, weight 0, body size
_TAG_BITS = struct.Struct(">QB")
_METHOD = struct.Struct(">I")
_ACK, _NACK = 0x003C0050, 0x003C0078  # basic.ack (60, 80), basic.nack (60, 120)
_END = b"\xce"
CHANNEL = 1



def append_publish(out: bytearray, args: bytes, props: bytes, body: bytes, frame_max: int) -> None:
    """Append one ``basic.publish`` on ``CHANNEL`` to ``out``: the method frame with ``args``
    (exchange, routing key, flags, encoded), the content header with the raw ``props`` and
    the body cut at ``frame_max``."""
    out += _PUBLISH.pack(1, CHANNEL, 6 + len(args), 60, 40, 0)
    out += args
    out += _END
    out += _CONTENT.pack(2, CHANNEL, 12 + len(props), 60, 0, len(body))
    out += props
    out += _END
    room = frame_max - 8
    for at in range(0, len(body), room):
        part = body[at:at + room]
        out += _HEAD.pack(3, CHANNEL, len(part))
        out += part
        out += _END

class PublishWire(Wire):
    """The connection, with publisher confirms read in place."""

    role = "destination"

    def __init__(self, lost: asyncio.Future[str]) -> None:
        super().__init__(lost)
        self.on_confirm: Callable[[int, bool, bool], None] | None = None  # tag, multiple, ack

    def _frame(self, kind: int, channel: int, buf: bytearray, start: int, end: int) -> None:
        if kind == 1 and channel == CHANNEL and self.on_confirm is not None:
            method = _METHOD.unpack_from(buf, start)[0]
            if method == _ACK or method == _NACK:
                tag, bits = _TAG_BITS.unpack_from(buf, start + 4)
                self.on_confirm(tag, bool(bits & 1), method == _ACK)
                return
        super()._frame(kind, channel, buf, start, end)


class Publisher:
    concurrency = 1 << 16  # publishes are framed in order at once; confirms pipeline
    immediate = True  # send_now: no task per message

    def __init__(self, confirm: bool) -> None:
        self.lost = new_lost()
        self.problem = ""
        self.wire: PublishWire | None = None
        self.confirm = confirm
        self.out = bytearray()
        self.flush_soon = False
        self.tag = 0  # the last delivery tag taken
        self.waiting: collections.OrderedDict[int, Callable[[Verdict], None]] = collections.OrderedDict()
        self.names: dict[tuple[str, str], bytes] = {}  # exchange, routing key -> encoded method arguments

    # ------------------------------------------------------------------ publish
    async def send(self, msg: Message) -> Verdict:
        later: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        verdict = self.send_now(msg, lambda v: None if later.done() else later.set_result(v))
        return verdict if verdict is not None else await later

    def send_now(self, msg: Message, later: Callable[[Verdict], None]) -> Verdict | None:
        wire = self.wire
        if wire is None or self.lost.done() or wire.transport is None or wire.transport.is_closing():
            raise EndLost("destination connection closed")
        self._frame(wire, msg)
        if not self.confirm:
            return Verdict.OK
        self.tag += 1
        self.waiting[self.tag] = later
        return None

    def _frame(self, wire: Wire, msg: Message) -> None:
        key = (msg.exchange, msg.routing_key)
        args = self.names.get(key)
        if args is None:
            ex, rk = msg.exchange.encode(), msg.routing_key.encode()
            args = bytes([len(ex)]) + ex + bytes([len(rk)]) + rk + b"\x00"  # mandatory, immediate off
            if len(self.names) >= 4096:
                self.names.clear()
            self.names[key] = args
        out, body, props = self.out, msg.body, msg.raw or EMPTY_PROPERTIES
        append_publish(out, args, props, body, wire.frame_max)
        if len(out) >= FLUSH_BYTES:
            self._flush()
        elif not self.flush_soon:
            self.flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_soon = False
        wire = self.wire
        if self.out and wire is not None and wire.transport is not None and not wire.transport.is_closing():
            wire.transport.write(bytes(self.out))
        self.out.clear()

    def _confirmed(self, tag: int, multiple: bool, ack: bool) -> None:
        verdict = Verdict.OK if ack else Verdict.RETRY
        if not ack:
            self.problem = "the destination broker refused (basic.nack) a message: retrying"
        waiting = self.waiting
        if multiple:
            while waiting:
                first = next(iter(waiting))
                if first > tag:
                    break
                waiting.popitem(last=False)[1](verdict)
        else:
            later = waiting.pop(tag, None)
            if later is not None:
                later(verdict)

    def release(self) -> PublishWire | None:
        """Write what is framed (as good as sent without confirms), answer RETRY to every publish
        still waiting for its confirm, and let go of the connection (returned, for closing)."""
        self._flush()
        wire, self.wire = self.wire, None
        set_lost(self.lost, "closed")
        waiting, self.waiting = self.waiting, collections.OrderedDict()
        for later in waiting.values():  # the run is over: its source gives these back
            later(Verdict.RETRY)
        if wire is not None:
            wire.on_confirm = None
        return wire
