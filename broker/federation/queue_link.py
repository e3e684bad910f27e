"""Queue federation: a local queue takes from the upstream's queue while its consumers want more.

Theory of operation
-------------------
A federated queue and its upstream queue are one logical queue drained from both ends: the link
consumes from the upstream queue (declared there durable if it is missing) only while the local
queue has **demand**, that is, no message ready and at least one consumer with room (prefetch
credit, channel flow, a writable socket: ``Consumer.capacity``). While there is demand the link
holds one upstream consumer with ``prefetch-count``; when demand ends it cancels it, so messages
stay upstream for that broker's own consumers rather than pile up here. Demand is read every
``DEMAND_INTERVAL`` seconds (a poll of two counters per federated queue: the model has no
consumer-change event for front ends, and this keeps the link outside the model) and after
every delivery, which cancels at once when the demand is gone: so what arrives here beyond the
demand is bounded by the messages in flight (``prefetch-count``), however fast the upstream
sends. In-process (``local.py``) the link's consumer is not even ready without demand.

Each delivery is published here to the default exchange with the queue's name as routing key
(``VHost.publish``), so it lands in this queue only, and settled upstream by ack-mode
(``link.py``). Deliveries in flight when the consumer is cancelled are still taken: they are this
queue's by then. With ``on-confirm`` a message is acked upstream only once durable here, so a
crash of either side loses nothing (it is redelivered from upstream).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage

from broker.federation import local
from broker.federation.link import CALL_TIMEOUT, Link
from broker.model.queue import Queue
from broker.model.vhost import VHost

DEMAND_INTERVAL = 0.05  # seconds between reads of the local queue's demand


def demand(q: Queue) -> bool:
    """Consumers with room and nothing ready for them here."""
    if q.deleted or not q.consumers or q.message_count > 0:
        return False
    return any(c.capacity() > 0 for c in q.consumers)


class QueueLink(Link):
    kind = "queue"

    def upstream_name(self) -> str:
        return self.upstream.queue or self.resource

    def _queue(self) -> Queue | None:
        q = self.vhost.queues.get(self.resource)
        return None if q is None or q.deleted else q

    async def _session(self, conn: aiormq.abc.AbstractConnection) -> None:
        q = self._queue()
        if q is None:
            raise RuntimeError(f"no queue '{self.resource}' here")
        up_q = self.upstream_name()
        async with asyncio.timeout(CALL_TIMEOUT):  # a mute upstream ends the session
            ch = await conn.channel()
            try:
                await ch.queue_declare(up_q, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                ch = await conn.channel()
                quorum = self.upstream.queue_type == "quorum"
                args: dict[str, Any] | None = {"x-queue-type": "quorum"} if quorum else None
                await ch.queue_declare(up_q, durable=True, arguments=args)
            await ch.basic_qos(prefetch_count=self.upstream.prefetch_count)

        changed = asyncio.Event()  # a delivery found the demand gone: cancel now, not at the next poll

        async def deliver(msg: DeliveredMessage) -> None:
            try:
                props = msg.header.properties
                self.forward(msg.body, bool(msg.redelivered), "", self.resource, props, self.hops_of(props),
                             ("queue", up_q), self.settler(ch, msg))
            except Exception as exc:
                self.fail(exc)
            if not demand(q):
                changed.set()

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
                wanted = demand(q)
                if wanted and tag is None:
                    ok = await ch.basic_consume(up_q, deliver, no_ack=self.upstream.ack_mode == "no-ack",
                                                consumer_tag=self.upstream.consumer_tag, timeout=CALL_TIMEOUT)
                    tag = str(ok.consumer_tag)
                elif not wanted and tag is not None:
                    await ch.basic_cancel(tag, timeout=CALL_TIMEOUT)
                    tag = None
            watch.result()
        finally:
            watch.cancel()

    async def _local_session(self, up: VHost) -> None:
        await local.queue_session(self, up, DEMAND_INTERVAL)
