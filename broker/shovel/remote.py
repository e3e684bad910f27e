"""A shovel's destination on any AMQP 0-9-1 broker (Skred, RabbitMQ, LavinMQ), over aiormq (the
source is ``amqp_source``: a consuming connection of its own that reads whole socket reads).

aiormq is the connection library aio-pika is built on; the shovel uses it directly because it
publishes content properties as pamqp objects (aio-pika's message objects would convert each
property twice). One connection, opened with the URI's credentials, vhost and TLS settings
(``amqps://`` with aiormq's ``cafile``/``certfile``/``keyfile`` query options for client
certificates); the destination's URIs are tried in order. Every wait has a deadline: a host
that does not answer in ``CONNECT_TIMEOUT`` is a failed attempt like a refused connection.

Destination: confirms are selected unless ack-mode is
no-ack/on-publish; a ``basic.nack`` (RabbitMQ's ``reject-publish`` overflow) is ``RETRY``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

import aiormq
from pamqp import commands

from broker.shovel.definition import ShovelDef, Uri
from broker.shovel.ends import CONNECT_TIMEOUT, OP_TIMEOUT, EndLost, Message, Verdict, new_lost, set_lost

log = logging.getLogger(__name__)
# aiormq logs a traceback at WARNING for every connection the peer drops; the shovel's status and
# its own warning say that once, with the reason
logging.getLogger("aiormq.connection").setLevel(logging.ERROR)



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
