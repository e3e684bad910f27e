"""A shovel end on any AMQP 0-9-1 broker (Skred, RabbitMQ, LavinMQ), over aiormq.

aiormq is the connection library aio-pika is built on; the shovel uses it directly because it
hands deliveries over with their content properties as pamqp objects and publishes them back
unchanged (aio-pika's message objects would convert each property twice). One connection per
end, opened with the URI's credentials, vhost and TLS settings (``amqps://`` with aiormq's
``cafile``/``certfile``/``keyfile`` query options for client certificates); the URIs of an end are
tried in order. Every wait has a deadline: a host that does not answer in ``CONNECT_TIMEOUT``
is a failed attempt like a refused connection.

Source: ``basic.qos(prefetch)`` then ``basic.consume`` (``no_ack`` in ack-mode no-ack); a
``src-exchange`` source declares an exclusive server-named queue bound with the key. Settling
acks, or rejects with requeue; ``DEAD_LETTER`` is never asked of it (whether a remote queue has a
dead-letter exchange is not known). Destination: confirms are selected unless ack-mode is
no-ack/on-publish; a ``basic.nack`` (RabbitMQ's ``reject-publish`` overflow) is ``RETRY``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aiormq
from aiormq.abc import DeliveredMessage
from pamqp import commands

from broker.shovel.definition import ShovelDef, Uri
from broker.shovel.ends import EndLost, Message, Settle, Verdict, new_lost, set_lost

log = logging.getLogger(__name__)
# aiormq logs a traceback at WARNING for every connection the peer drops; the shovel's status and
# its own warning say that once, with the reason
logging.getLogger("aiormq.connection").setLevel(logging.ERROR)

CONNECT_TIMEOUT = 15.0  # seconds for the TCP, TLS and AMQP handshakes of one URI
ACK_DELAY = 0.05  # seconds a settled message waits for others to share its ``basic.ack``
OP_TIMEOUT = 30.0  # seconds for one declare, qos, consume


async def connect(uris: tuple[Uri, ...], name: str) -> aiormq.abc.AbstractConnection:
    """The first URI that takes the connection; EndLost naming each failure otherwise."""
    problems = []
    for uri in uris:
        try:
            conn = await asyncio.wait_for(
                aiormq.connect(uri.text, client_properties={"connection_name": f"Shovel {name}"}),
                CONNECT_TIMEOUT)
            return conn
        except TimeoutError:
            problems.append(f"{uri.redacted()}: no answer in {CONNECT_TIMEOUT:g} s")
        except Exception as exc:  # noqa: BLE001 - refused, TLS, wrong credentials: each is a reason
            problems.append(f"{uri.redacted()}: {type(exc).__name__}: {exc}")
    raise EndLost("; ".join(problems))


async def ensure_queue(conn: aiormq.abc.AbstractConnection, name: str, args: dict[str, Any]) -> None:
    """Declare a queue an end names unless it exists (RabbitMQ's shovel declares both, durable, with
    ``src-queue-args``/``dest-queue-args``); an existing queue is used as it is, whatever its
    arguments. On a channel of its own: a passive declare of a missing queue closes it."""
    ch = await asyncio.wait_for(conn.channel(), OP_TIMEOUT)
    try:
        await asyncio.wait_for(ch.queue_declare(name, passive=True), OP_TIMEOUT)
    except aiormq.exceptions.ChannelNotFoundEntity:
        ch = await asyncio.wait_for(conn.channel(), OP_TIMEOUT)
        await asyncio.wait_for(ch.queue_declare(name, durable=True, arguments=args), OP_TIMEOUT)
    if not ch.is_closed:
        await asyncio.wait_for(ch.close(), OP_TIMEOUT)


def _watch(conn: aiormq.abc.AbstractConnection, channel: aiormq.abc.AbstractChannel,
           lost: asyncio.Future[str], what: str) -> None:
    def closed(fut: asyncio.Future[Any]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        set_lost(lost, f"{what} closed: {exc}" if exc is not None else f"{what} closed")

    conn.closing.add_done_callback(closed)
    channel.closing.add_done_callback(closed)


class AmqpSource:
    can_dead_letter = False

    def __init__(self, d: ShovelDef, tag: str, args: dict[str, Any]) -> None:
        self.d = d
        self.tag = tag
        self.args = args  # consumer arguments for this run (x-stream-offset only on the first)
        self.lost = new_lost()
        self.length = 0
        self.conn: aiormq.abc.AbstractConnection | None = None
        self.channel: aiormq.abc.AbstractChannel | None = None
        self.settling: set[asyncio.Future[Any]] = set()
        self.delivered: collections.deque[int] = collections.deque()  # unsettled tags, in order
        self.settled: set[int] = set()  # settled, not yet covered by a multiple ack
        self.flush_timer: asyncio.TimerHandle | None = None
        self.ack_batch = max(1, d.src_prefetch // 4)

    async def open(self, on_message: Callable[[Message], None]) -> None:
        d = self.d
        self.conn = await connect(d.src_uris, d.name)
        try:
            ch = self.channel = await asyncio.wait_for(self.conn.channel(), OP_TIMEOUT)
            _watch(self.conn, ch, self.lost, "source")
            queue = d.src_queue
            if queue:
                await ensure_queue(self.conn, queue, d.src_queue_args)
            if queue is None:
                ok = await asyncio.wait_for(ch.queue_declare("", exclusive=True, auto_delete=True,
                                                             arguments=d.src_queue_args), OP_TIMEOUT)
                assert ok is not None and ok.queue is not None
                queue = ok.queue
                await asyncio.wait_for(ch.queue_bind(queue, d.src_exchange or "", d.src_exchange_key),
                                       OP_TIMEOUT)
            elif d.delete_after == "queue-length":
                ok = await asyncio.wait_for(ch.queue_declare(queue, passive=True), OP_TIMEOUT)
                self.length = ok.message_count or 0 if ok is not None else 0
            await asyncio.wait_for(ch.basic_qos(prefetch_count=d.src_prefetch), OP_TIMEOUT)

            no_ack = d.ack_mode == "no-ack"

            async def deliver(m: DeliveredMessage) -> None:
                tag = m.delivery_tag or 0
                if not no_ack:  # nothing to settle without acknowledgements
                    self.delivered.append(tag)
                on_message(Message(m.exchange or "", m.routing_key or "", m.header.properties, m.body,
                                   bool(m.redelivered), tag))

            await asyncio.wait_for(ch.basic_consume(queue, deliver, no_ack=no_ack,
                                                    arguments=self.args, consumer_tag=self.tag), OP_TIMEOUT)
        except TimeoutError:
            await self.close()
            raise EndLost("source: no answer from the broker") from None
        except aiormq.exceptions.AMQPError as exc:
            await self.close()
            raise EndLost(f"source: {exc}") from None

    def settle(self, tag: int, how: Settle) -> None:
        """Acks are coalesced: settled messages share one ``basic.ack`` with ``multiple`` up to the
        highest delivery tag below which everything is settled (a message still in flight is never
        covered), written once a quarter of the prefetch window is settled or ``ACK_DELAY`` after
        the first of them, whichever comes first (so the broker's window never starves and a
        lone message is acked promptly; what waits behind a message still in flight is written
        with the settle that frees it); a requeue is sent at once. Closing writes what is due."""
        ch = self.channel
        if ch is None or ch.is_closed or self.d.ack_mode == "no-ack":
            return  # gone: the broker gives the message back itself
        self.settled.add(tag)
        if how is not Settle.ACK:
            self._send(ch.basic_reject(tag, requeue=True, wait=False))
        if len(self.settled) >= self.ack_batch:
            self._flush()
        elif self.flush_timer is None:
            self.flush_timer = asyncio.get_running_loop().call_later(ACK_DELAY, self._flush)

    def _flush(self) -> None:
        if self.flush_timer is not None:
            self.flush_timer.cancel()
            self.flush_timer = None
        ch, delivered, settled = self.channel, self.delivered, self.settled
        upto = 0
        acked = False
        while delivered and delivered[0] in settled:
            upto = delivered.popleft()
            settled.discard(upto)
            acked = True  # (a rejected tag in the run is no longer the broker's: multiple skips it)
        if acked and ch is not None and not ch.is_closed:
            self._send(ch.basic_ack(upto, multiple=True, wait=False))

    def _send(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.settling.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Future[Any]) -> None:
        self.settling.discard(task)
        if not task.cancelled():
            task.exception()  # a settle on a channel that just closed: the broker requeues it

    async def close(self) -> None:
        if self.channel is not None and not self.channel.is_closed:
            self._flush()  # what was settled is acked before the channel goes
        if self.flush_timer is not None:
            self.flush_timer.cancel()
            self.flush_timer = None
        conn, self.conn, self.channel = self.conn, None, None
        if conn is not None:
            if self.settling:  # acks already written out go with the close; the rest are requeued
                await asyncio.wait(list(self.settling), timeout=5.0)
            await _close(conn)
        for task in self.settling:
            task.cancel()


class AmqpDestination:
    concurrency = 1 << 16  # publishes are written in order under the channel's lock; confirms pipeline
    immediate = False

    def send_now(self, msg: Message, later: Callable[[Verdict], None]) -> Verdict | None:
        raise NotImplementedError  # not immediate: the link awaits send()

    def __init__(self, d: ShovelDef) -> None:
        self.d = d
        self.lost = new_lost()
        self.problem = ""
        self.conn: aiormq.abc.AbstractConnection | None = None
        self.channel: aiormq.abc.AbstractChannel | None = None

    async def open(self) -> None:
        d = self.d
        self.conn = await connect(d.dest_uris, d.name)
        try:
            ch = self.channel = await asyncio.wait_for(
                self.conn.channel(publisher_confirms=d.ack_mode == "on-confirm"), OP_TIMEOUT)
            _watch(self.conn, ch, self.lost, "destination")
            if d.dest_queue:
                await ensure_queue(self.conn, d.dest_queue, d.dest_queue_args)
        except TimeoutError:
            await self.close()
            raise EndLost("destination: no answer from the broker") from None
        except aiormq.exceptions.AMQPError as exc:
            await self.close()
            raise EndLost(f"destination: {exc}") from None

    async def send(self, msg: Message) -> Verdict:
        ch = self.channel
        if ch is None or ch.is_closed:
            raise EndLost("destination channel closed")
        try:
            confirm = await cast(aiormq.Channel, ch).basic_publish(
                msg.body, exchange=msg.exchange, routing_key=msg.routing_key, properties=msg.props,
                wait=False)  # wait: for the socket write, under the channel's lock: one at a time
        except Exception as exc:  # noqa: BLE001 - a closed channel or connection, however aiormq says it
            raise EndLost(f"destination: {type(exc).__name__}: {exc}") from None
        if isinstance(confirm, commands.Basic.Nack | commands.Basic.Reject):
            self.problem = "the destination broker refused (basic.nack) a message: retrying"
            return Verdict.RETRY
        return Verdict.OK

    async def close(self) -> None:
        conn, self.conn, self.channel = self.conn, None, None
        if conn is not None:
            await _close(conn)


async def _close(conn: aiormq.abc.AbstractConnection) -> None:
    try:
        await asyncio.wait_for(conn.close(), 5.0)
    except Exception:  # noqa: BLE001 - closing what may already be gone
        log.debug("shovel: closing a connection", exc_info=True)
