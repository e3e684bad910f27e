"""Queue federation: a local queue takes from the upstream's queue while its consumers want more.

Theory of operation
-------------------
A federated queue and its upstream queue are one logical queue drained from both ends: the link
consumes from the upstream queue (declared there durable if it is missing) only while the local
queue's consumers have room. It **starts** the upstream consumer (``prefetch-count``) on
**demand**: no message ready here and at least one consumer with room (prefetch credit, channel
flow, a writable socket: ``Consumer.capacity``). It **keeps** it, credit-like, while the ready
messages here are fewer than the local consumers' room or than ``LOW_WATER`` of a prefetch window
(``keep``), and cancels it when there are no local consumers any more or the ready messages
outgrow both: deliveries land here in bursts (a whole socket read per turn) that the local
consumers take a moment later, and cancelling and consuming again on every burst was most of
what the link spent. What arrives here beyond what the consumers take is bounded by that
threshold plus the messages in flight (``prefetch-count``), however fast the upstream sends.
``keep`` is read after every turn of deliveries and every ``DEMAND_INTERVAL`` seconds (a poll
of two counters per federated queue: the model has no consumer-change event for front ends, and
this keeps the link outside the model). In-process (``local.py``) the link's consumer is not even
ready without demand.

Each delivery is published here to the default exchange with the queue's name as routing key
(through the link's ``TurnPublisher``: the model's batch operation, one group commit per turn),
so it lands in this queue only, and settled upstream by ack-mode (``link.py``). Deliveries in
flight when the consumer is cancelled are still taken: they are this queue's by then. With
``on-confirm`` a message is acked upstream only once durable here, so a crash of either side
loses nothing (it is redelivered from upstream).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pamqp import commands

from broker.federation import local
from broker.federation.link import Link, UpstreamWire
from broker.links.message import Message
from broker.links.wire import Closed
from broker.model.queue import Queue
from broker.model.vhost import VHost

DEMAND_INTERVAL = 0.05  # seconds between reads of the local queue's demand
LOW_WATER = 0.5  # of prefetch-count: ready messages here below which the link keeps consuming


def demand(q: Queue) -> bool:
    """Consumers with room and nothing ready for them here."""
    if q.deleted or not q.consumers or q.message_count > 0:
        return False
    return any(c.capacity() > 0 for c in q.consumers)


def keep(q: Queue, prefetch: int) -> bool:
    """Consumers here, and the ready messages fewer than their room or than the low-water mark."""
    if q.deleted or not q.consumers:
        return False
    ready = q.message_count
    if ready < max(1, int(prefetch * LOW_WATER)):
        return True
    room = 0
    for c in q.consumers:
        room += c.capacity()
        if room > ready:
            return True
    return False


class QueueLink(Link):
    kind = "queue"

    def upstream_name(self) -> str:
        return self.upstream.queue or self.resource

    def _queue(self) -> Queue | None:
        q = self.vhost.queues.get(self.resource)
        return None if q is None or q.deleted else q

    async def _session(self, wire: UpstreamWire) -> None:
        q = self._queue()
        if q is None:
            raise RuntimeError(f"no queue '{self.resource}' here")
        up_q, ch = self.upstream_name(), 1
        await wire.ask(ch, commands.Channel.Open(), commands.Channel.OpenOk)
        try:
            await wire.ask(ch, commands.Queue.Declare(queue=up_q, passive=True), commands.Queue.DeclareOk)
        except Closed as exc:
            if exc.code != 404:
                raise
            ch += 1  # the passive declare of a missing queue closed the channel
            await wire.ask(ch, commands.Channel.Open(), commands.Channel.OpenOk)
            quorum = self.upstream.queue_type == "quorum"
            args: dict[str, Any] | None = {"x-queue-type": "quorum"} if quorum else None
            await wire.ask(ch, commands.Queue.Declare(queue=up_q, durable=True, arguments=args),
                           commands.Queue.DeclareOk)
        await self.qos(wire, ch)

        prefetch = self.upstream.prefetch_count
        changed = asyncio.Event()  # a turn of deliveries outgrew the room: cancel now, not at the next poll
        checking = False

        def check() -> None:
            nonlocal checking
            checking = False
            if not keep(q, prefetch):
                changed.set()

        def deliver(msg: Message) -> None:
            nonlocal checking
            try:
                self.forward(msg, "", self.resource, self.hops_of(msg), ("queue", up_q),
                             self.remote_settler(msg))
            except Exception as exc:
                self.fail(exc)
            if not checking:  # once per turn, after the turn's batch is published here
                checking = True
                loop.call_soon(check)

        loop = asyncio.get_running_loop()
        self._set("running")
        watch = asyncio.ensure_future(self.until_failed())
        tag: str | None = None
        try:
            while not watch.done():
                woken = asyncio.ensure_future(changed.wait())
                await asyncio.wait([watch, woken], timeout=DEMAND_INTERVAL,
                                   return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                changed.clear()
                if watch.done():
                    break
                if self._queue() is not q:
                    raise RuntimeError(f"queue '{self.resource}' was deleted")
                if tag is None and demand(q):
                    tag = await self.consume(wire, ch, up_q, deliver)
                elif tag is not None and not keep(q, prefetch):
                    await wire.ask(ch, commands.Basic.Cancel(consumer_tag=tag), commands.Basic.CancelOk)
                    tag = None
            watch.result()
        finally:
            watch.cancel()

    async def _local_session(self, up: VHost) -> None:
        await local.queue_session(self, up, DEMAND_INTERVAL)
