"""The sink's AMQP 0-9-1 path: rows published with confirms through the link layer.

Theory of operation
-------------------
A task's rows to an exchange (or to a queue through the default exchange, or with
``exactlyOnce`` to an exchange declared with ``x-message-deduplication``) go out on one
connection of ``broker/links/`` (``wire.py``'s connection, ``publisher.py``'s in-place reading
of ``basic.ack`` / ``basic.nack``). Rows are framed by ``amqp_frames.py``: a whole Arrow batch
at once when its rows share the target and carry no headers (the property bytes built once per
task, or with ``exactlyOnce`` each row's id built column-wise into its properties), else row by
row into a buffer; either is written with one call. Confirms are
counted by delivery tag, a ``multiple`` ack settling every tag up to it, with no object per
row. A general client library spent 400-500 µs of CPU per row on the same work (a future, a
lock and three frames built from objects per row).

Confirms: ``SinkPublisher`` keeps at most ``window`` rows unconfirmed; when full it waits until
half of them are confirmed (one wake-up per half window, not per row), so the task costs a round
trip per half window. A nack, a returned row (publishes through the default exchange are
``mandatory``: RabbitMQ sends the ``basic.return`` before that row's ``basic.ack``), the
publishing channel closed, the connection lost or no confirm within ``timeout`` raise
``SinkError``: the task fails and Spark retries it; rows in flight then count as not written
(their copies from the retry are duplicates at least once, dropped by the exchange with
``exactlyOnce``).

Whether a target is an exchange is asked with a passive ``exchange.declare`` on a channel of
its own (a missing exchange closes that channel, not the publishing one).
"""

from __future__ import annotations

import asyncio
import struct
import time

from pamqp import commands
from pamqp.base import Frame as PFrame

from broker.links.message import new_lost, set_lost
from broker.links.publisher import CHANNEL, FLUSH_BYTES, PublishWire
from broker.links.wire import FRAME_MAX, Closed, open_first
from broker.spark.amqp_frames import frame_row

CLIENT = {"connection_name": "Skred Spark sink", "product": "Skred Spark sink"}
_RETURN = 0x003C0032  # basic.return (60, 50)
_METHOD = struct.Struct(">I")
_REPLY_CODE = struct.Struct(">H")
_BODY_SIZE = struct.Struct(">Q")


class SinkError(RuntimeError):
    """A row was not confirmed (nacked, returned unroutable, timed out): the task fails."""


class SinkWire(PublishWire):
    """The link connection, reading ``basic.return`` (and skipping the returned row's content)."""

    def __init__(self, lost: asyncio.Future[str]) -> None:
        super().__init__(lost)
        self.returned = ""  # why the first returned row came back ("" while none did)
        self._skipping = False  # a returned row's content header and body are still to come
        self._skip_left = 0

    def _frame(self, kind: int, channel: int, buf: bytearray, start: int, end: int) -> None:
        if channel == CHANNEL:
            if kind == 1 and _METHOD.unpack_from(buf, start)[0] == _RETURN:
                code = _REPLY_CODE.unpack_from(buf, start + 4)[0]
                text = bytes(buf[start + 7:start + 7 + buf[start + 6]]).decode("utf-8", "replace")
                self.returned = self.returned or f"{code} {text}"
                self._skipping, self._skip_left = True, -1
                return
            if self._skipping and kind in (2, 3):
                if kind == 2:
                    self._skip_left = _BODY_SIZE.unpack_from(buf, start + 4)[0]
                else:
                    self._skip_left -= end - start
                self._skipping = self._skip_left > 0
                return
        super()._frame(kind, channel, buf, start, end)

    def _method(self, channel: int, method: PFrame) -> None:
        if channel == CHANNEL and isinstance(method, commands.Channel.Close):
            self.write(channel, commands.Channel.CloseOk())
            set_lost(self.lost, f"publishing channel closed: {method.reply_code} {method.reply_text}")
            return
        if self.awaiting or isinstance(method, commands.Connection.Close | commands.Channel.Close):
            super()._method(channel, method)  # else nobody waits for it (connection.blocked): dropped


class SinkPublisher:
    """One task's connection: publishes framed by ``amqp_frames``, confirms counted against a
    window by delivery tag (a ``multiple`` ack settles every tag up to it)."""

    def __init__(self, window: int, timeout: float) -> None:
        self.window = window
        self.low = window // 2  # a full window waits until this many are unconfirmed
        self.timeout = timeout
        self.wire: SinkWire | None = None
        self.lost = new_lost()
        self.out = bytearray()  # rows framed one by one, not yet written
        self.tag = 0  # the last delivery tag taken
        self.floor = 0  # every tag up to this one is settled
        self.singles: set[int] = set()  # tags above ``floor`` settled one by one
        self.failure = ""
        self._wake: asyncio.Future[None] | None = None
        self._channels = CHANNEL

    @property
    def pending(self) -> int:
        return self.tag - self.floor - len(self.singles)

    @property
    def frame_max(self) -> int:
        return self.wire.frame_max if self.wire is not None else FRAME_MAX

    async def open(self, uri: str) -> None:
        wire, self.lost = await open_first([uri], CLIENT, SinkWire)
        self.wire = wire
        await wire.call(CHANNEL, commands.Channel.Open(), commands.Channel.OpenOk)
        await wire.call(CHANNEL, commands.Confirm.Select(), commands.Confirm.SelectOk)
        wire.on_confirm = self._confirmed

    async def exchange_exists(self, name: str) -> bool:
        wire = self.wire
        assert wire is not None
        self._channels += 1
        channel = self._channels
        await wire.call(channel, commands.Channel.Open(), commands.Channel.OpenOk)
        try:
            await wire.call(channel, commands.Exchange.Declare(exchange=name, passive=True),
                            commands.Exchange.DeclareOk)
        except Closed as exc:
            if exc.code != 404:
                raise
            return False
        bye = commands.Channel.Close(reply_code=200, reply_text="checked", class_id=0, method_id=0)
        await wire.call(channel, bye, commands.Channel.CloseOk)
        return True

    def put(self, exchange: str, routing_key: str, props: bytes, body: bytes) -> None:
        """Frame one row (the caller drains first when ``pending`` reached ``window``);
        publishes to the default exchange (a queue) are mandatory."""
        frame_row(self.out, exchange.encode(), not exchange, routing_key.encode(), props, body,
                  self.frame_max)
        self.tag += 1
        if len(self.out) >= FLUSH_BYTES:
            self.write()

    def put_framed(self, data: bytes, count: int) -> None:
        """``count`` publishes framed by ``frame_batch``, written after what ``put`` framed."""
        self.write()
        self._send(data)
        self.tag += count

    def write(self) -> None:
        if self.out:
            self._send(bytes(self.out))
            self.out.clear()

    def _send(self, data: bytes) -> None:
        wire = self.wire
        if wire is None or wire.transport is None or wire.transport.is_closing() or self.lost.done():
            why = self.lost.result() if self.lost.done() else "closed"
            raise SinkError(f"skred sink: connection lost: {why}")
        wire.transport.write(data)

    def _confirmed(self, tag: int, multiple: bool, ack: bool) -> None:
        if not self.failure:
            wire = self.wire
            if wire is not None and wire.returned:
                self.failure = f"skred sink: Unroutable row returned by the broker: {wire.returned}"
            elif not ack:
                self.failure = "skred sink: row not confirmed (nack)"
        if tag <= self.floor:
            pass
        elif multiple:
            self.floor = tag
            if self.singles:
                self.singles = {t for t in self.singles if t > tag}
        else:
            self.singles.add(tag)
            while self.floor + 1 in self.singles:
                self.floor += 1
                self.singles.discard(self.floor)
        wake = self._wake
        if wake is not None and not wake.done() and (self.pending <= self.low or self.failure):
            wake.set_result(None)

    async def drain(self, level: int) -> None:
        """Wait until at most ``level`` rows are unconfirmed; SinkError on any failure."""
        deadline = time.monotonic() + self.timeout
        self.write()
        while self.pending > level and not self.failure:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SinkError("skred sink: no confirm within confirmTimeout")
            if self.lost.done():
                raise SinkError(f"skred sink: connection lost: {self.lost.result()}")
            self._wake = wake = asyncio.get_running_loop().create_future()
            self.low = level
            try:
                await asyncio.wait([wake, self.lost], timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._wake = None
                self.low = self.window // 2
        if self.failure:
            raise SinkError(self.failure)

    async def close(self) -> None:
        wire, self.wire = self.wire, None
        if wire is not None:
            wire.on_confirm = None
            await wire.shutdown("sink task done")
        set_lost(self.lost, "closed")
