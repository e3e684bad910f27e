"""A shovel end on this broker itself (a host-less ``amqp://``): no socket, the model's public
operations only.

Source: a ``Consumer`` on the queue (``VHost.get_queue``, ``Queue.add_consumer``), ready while
fewer than ``prefetch`` of its deliveries are unsettled, settled with ``Queue.ack`` /
``Queue.reject``; a stream queue takes the consumer's arguments (``x-stream-offset``) and tracks
its offset by the consumer tag, as for any AMQP consumer. A ``src-exchange`` source declares an
exclusive server-named queue owned by the shovel and binds it. Closing removes the consumer and
rejects every unsettled delivery with requeue (what a closed AMQP channel does).

Destination: the sends of one event-loop turn are published together at the end of the turn
through the shared link layer's ``TurnPublisher`` (``broker/links/turn.py``: the model's batch
operation, one group-commit wait per turn); a publish that fails (no such exchange, a full
disk) breaks the run (``lost``): the source gives back every message not yet settled.

Permissions are the AMQP ones of the user who defined the shovel: read on the source queue (or
exchange, and configure on its queue), write on the destination exchange and its topic
permission. A parameter with no such user (loaded from a definitions file) acts as the operator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker import errors
from broker.auth.users import UserStore
from broker.links.turn import AfterSync, TurnPublisher
from broker.model.queue import Consumer, Queue
from broker.model.vhost import VHost
from broker.shovel.definition import ShovelDef
from broker.shovel.ends import EndLost, Message, Settle, Verdict, new_lost, set_lost


@dataclass(frozen=True)
class Local:
    """What a local end needs of the node."""

    vhosts: dict[str, VHost]
    users: UserStore
    after_sync: AfterSync


def _vhost(local: Local, name: str) -> VHost:
    vh = local.vhosts.get(name)
    if vh is None:
        raise EndLost(f"no vhost '{name}' on this broker")
    return vh


def _allowed(local: Local, owner: str | None, kind: str, vhost: str, resource: str) -> None:
    if owner is None:
        return
    check = {"configure": local.users.can_configure, "write": local.users.can_write,
             "read": local.users.can_read}[kind]
    if local.users.get(owner) is None or not check(owner, vhost, resource):
        raise EndLost(f"user '{owner}' has no {kind} permission on '{resource}' in vhost '{vhost}'")


class _ShovelConsumer(Consumer):
    __slots__ = ("source",)

    def __init__(self, source: LocalSource, tag: str, queue: Queue, no_ack: bool,
                 arguments: dict[str, Any]) -> None:
        super().__init__(tag, queue, no_ack, False, arguments)
        self.source = source

    def ready(self) -> bool:
        return self.capacity() > 0

    def capacity(self) -> int:
        s = self.source
        return 0 if s.closed else max(0, s.prefetch - len(s.unsettled) - s.forwarding)

    def deliver(self, msgid: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes,
                redelivered: bool) -> None:
        self.source.deliver(msgid, exchange, routing_key, props, body, redelivered)

    def cancelled_by_server(self) -> None:
        set_lost(self.source.lost, f"source queue '{self.queue.name}' was deleted")


class LocalSource:
    def __init__(self, d: ShovelDef, local: Local, owner: str | None, tag: str, args: dict[str, Any]) -> None:
        self.d, self.local, self.owner, self.tag, self.args = d, local, owner, tag, args
        self.lost = new_lost()
        self.length = 0
        self.can_dead_letter = False
        self.prefetch = d.src_prefetch
        self.unsettled: set[int] = set()
        self.forwarding = 0  # no-ack deliveries not yet handed on (they count against prefetch)
        self.closed = False
        self.queue: Queue | None = None
        self.consumer: _ShovelConsumer | None = None
        self.temp_queue: str | None = None
        self.on_message: Callable[[Message], None] | None = None
        self.no_ack = d.ack_mode == "no-ack"

    async def open(self, on_message: Callable[[Message], None]) -> None:
        d, uri = self.d, self.d.src_uris[0]
        vh = _vhost(self.local, uri.vhost)
        try:
            if d.src_queue is not None:
                _allowed(self.local, self.owner, "read", vh.name, d.src_queue)
                if d.src_queue not in vh.queues:
                    _allowed(self.local, self.owner, "configure", vh.name, d.src_queue)
                    vh.declare_queue(d.src_queue, durable=True, arguments=d.src_queue_args, owner=None)
                q = vh.get_queue(d.src_queue, None)
            else:
                ex = d.src_exchange or ""
                _allowed(self.local, self.owner, "read", vh.name, ex)
                q, _ = vh.declare_queue("", exclusive=True, arguments=d.src_queue_args, owner=self)
                self.temp_queue = q.name
                vh.bind_queue(q.name, ex, d.src_exchange_key, {}, owner=self)
            self.length = q.message_count
            self.can_dead_letter = q.dead_letters
            q.check_consume(self.no_ack, self.prefetch, 0, dict(self.args))
            self.queue, self.on_message = q, on_message
            self.consumer = _ShovelConsumer(self, self.tag, q, self.no_ack, dict(self.args))
            q.add_consumer(self.consumer)
        except errors.AMQPError as exc:
            await self.close()
            raise EndLost(f"source: {exc.reply_text}") from None

    def deliver(self, msgid: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes,
                redelivered: bool) -> None:
        if self.on_message is None:
            return
        if self.no_ack:
            self.forwarding += 1
        else:
            self.unsettled.add(msgid)
        self.on_message(Message(exchange.decode(errors="replace"), routing_key.decode(errors="replace"),
                                None, body, redelivered, msgid, raw=props))

    def settle(self, tag: int, how: Settle) -> None:
        q = self.queue
        if self.no_ack:
            self.forwarding = max(0, self.forwarding - 1)
        elif q is None or self.closed or tag not in self.unsettled:
            return
        else:
            self.unsettled.discard(tag)
            if how is Settle.ACK:
                q.ack(tag)
            else:
                q.reject(tag, how is Settle.REQUEUE)
        if q is not None:
            q.schedule_delivery()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        set_lost(self.lost, "closed")
        q, c = self.queue, self.consumer
        if q is not None and c is not None:
            q.remove_consumer(c)
            for msgid in sorted(self.unsettled):  # what a closed channel does with its unacked
                q.reject(msgid, True)
            self.unsettled.clear()
            q.schedule_delivery()
        if self.temp_queue is not None:
            vh = self.local.vhosts.get(self.d.src_uris[0].vhost)
            if vh is not None and self.temp_queue in vh.queues:
                vh.delete_queue(self.temp_queue, owner=self)


class LocalDestination:
    concurrency = 1 << 16  # publishes are synchronous and in order; only the durability wait overlaps
    immediate = True  # send_now: no task per message

    def __init__(self, d: ShovelDef, local: Local, owner: str | None) -> None:
        self.d, self.local, self.owner = d, local, owner
        self.lost = new_lost()
        self.vhost: VHost | None = None
        self.checked: set[str] = set()  # exchanges the owner may write to (as a session remembers)
        self.turn = TurnPublisher(self._live_vhost, local.after_sync, d.ack_mode == "on-confirm",
                                  lambda reason: set_lost(self.lost, reason))

    @property
    def problem(self) -> str:
        return self.turn.problem

    def _live_vhost(self) -> VHost | None:
        vh = self.vhost
        return vh if vh is not None and vh.name in self.local.vhosts else None

    async def open(self) -> None:
        d = self.d
        vh = self.vhost = _vhost(self.local, d.dest_uris[0].vhost)
        if d.dest_queue and d.dest_queue not in vh.queues:
            _allowed(self.local, self.owner, "configure", vh.name, d.dest_queue)
            try:
                vh.declare_queue(d.dest_queue, durable=True, arguments=d.dest_queue_args, owner=None)
            except errors.AMQPError as exc:
                raise EndLost(f"destination: {exc.reply_text}") from None

    def _may_write(self, vh: VHost, exchange: str, routing_key: str) -> None:
        users, owner = self.local.users, self.owner
        if exchange not in self.checked:
            _allowed(self.local, owner, "write", vh.name, exchange)
            if owner is None or not users.has_topic_permission(owner, vh.name, exchange):
                self.checked.add(exchange)
                return
        if owner is not None and not users.topic_allows(owner, vh.name, exchange, "write", routing_key):
            raise EndLost(f"user '{owner}' may not publish to '{exchange}' with routing key '{routing_key}'")

    async def send(self, msg: Message) -> Verdict:
        later: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        verdict = self.send_now(msg, lambda v: None if later.done() else later.set_result(v))
        return verdict if verdict is not None else await later

    def send_now(self, msg: Message, later: Callable[[Verdict], None]) -> Verdict | None:
        """Check the owner may publish it (EndLost if not) and take it into this turn's batch:
        ``later`` gets the verdict once it is published (and, on-confirm, durable)."""
        vh = self.vhost
        if vh is None or vh.name not in self.local.vhosts:
            raise EndLost("destination vhost is gone")
        self._may_write(vh, msg.exchange, msg.routing_key)
        self.turn.add(msg, later)
        return None

    async def close(self) -> None:
        set_lost(self.lost, "closed")
