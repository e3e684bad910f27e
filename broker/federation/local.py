"""Links to an upstream on this broker (a host-less URI: ``amqp://`` or ``amqp:///vhost``), run
in-process through the model's public operations, with no socket.

Theory of operation
-------------------
The link is the same as over AMQP (``exchange_link.py``, ``queue_link.py``): on the upstream vhost
it declares the upstream queue (``VHost.declare_queue``) and, for an exchange, its
``x-federation-upstream`` exchange (bound to the queue) and binds that to the upstream exchange
with the local exchange's bindings (``VHost.bind_exchange``/``unbind_exchange``), then consumes it with a
``LinkConsumer``: a model consumer with room for ``prefetch-count`` unsettled messages, like an
AMQP consumer's prefetch. Each delivery goes through the link's ``take``/``forward`` (hop rules,
``x-received-from``, the turn's batch publish here) and is settled on the upstream queue by ack-mode
(``Queue.ack`` once durable here; ``Queue.reject`` with requeue when this side refused it). A
settlement that comes after the link stopped still happens, so nothing stays unacked or is
requeued after it was published here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broker.links.message import Message
from broker.model.exchange_features import FEDERATION_UPSTREAM
from broker.model.queue import Consumer, Queue
from broker.model.vhost import VHost

if TYPE_CHECKING:
    from broker.federation.exchange_link import ExchangeLink
    from broker.federation.queue_link import QueueLink

OnMessage = Callable[[int, str, bytes, bytes, bool, Callable[[bool], None]], None]


class LinkConsumer(Consumer):
    """A link's consumer of an upstream queue of this broker."""

    def __init__(self, queue: Queue, prefetch: int, on_message: OnMessage,
                 fail: Callable[[BaseException], None], tag: str,
                 gate: Callable[[], bool] = lambda: True) -> None:
        super().__init__(tag, queue, no_ack=False, exclusive=False)
        self.prefetch = prefetch
        self.gate = gate  # a queue link: is there demand downstream?
        self.on_message = on_message
        self.fail = fail
        self.unsettled: set[int] = set()
        self.closed = False

    def ready(self) -> bool:
        return not self.closed and len(self.unsettled) < self.prefetch and self.gate()

    def deliver(self, msgid: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes,
                redelivered: bool) -> None:
        self.unsettled.add(msgid)
        try:
            self.on_message(msgid, routing_key.decode(), props, body, redelivered,
                            lambda ok: self.settle(msgid, ok))
        except Exception as exc:  # this side refused it (settled already): the session ends
            self.closed = True
            self.fail(exc)

    def settle(self, msgid: int, ok: bool) -> None:
        self.unsettled.discard(msgid)
        q = self.queue
        if ok:
            q.ack(msgid)
        else:
            q.reject(msgid, True)
        q.schedule_delivery()  # room again

    def detach(self) -> None:
        self.queue.remove_consumer(self)

    def cancelled_by_server(self) -> None:
        self.closed = True
        self.fail(RuntimeError(f"the upstream queue '{self.queue.name}' was deleted"))


async def exchange_session(link: ExchangeLink, up: VHost, interval: float) -> None:
    from broker.federation.exchange_link import exchange_name, local_bindings, upstream_exchange_args

    ex = link.vhost.exchanges.get(link.resource)
    if ex is None:
        raise RuntimeError(f"no exchange '{link.resource}' here")
    up_ex, name = link.upstream_name(), link.queue()
    if up_ex not in up.exchanges:
        up.declare_exchange(up_ex, ex.type, durable=ex.durable, arguments=dict(ex.arguments))
    args: dict[str, Any] = {"x-internal-purpose": "federation"}
    if link.upstream.expires is not None:
        args["x-expires"] = link.upstream.expires
    if link.upstream.message_ttl is not None:
        args["x-message-ttl"] = link.upstream.message_ttl
    q, _ = up.declare_queue(name, durable=True, arguments=args, owner=None)
    via, via_args = exchange_name(name), upstream_exchange_args(link)
    old = up.exchanges.get(via)
    if old is not None and (old.type != FEDERATION_UPSTREAM or old.arguments != via_args):
        up.delete_exchange(via)  # declared before with other arguments (max-hops changed)
    up.declare_exchange(via, FEDERATION_UPSTREAM, durable=True, internal=True, arguments=via_args)
    up.bind_queue(name, via, "", {}, owner=None)
    bound: dict[Any, dict[str, Any]] = {}

    def mirror() -> None:
        want = local_bindings(ex)
        for key in [k for k in bound if k not in want]:
            up.unbind_exchange(via, up_ex, key[0], bound.pop(key))
        for key, bargs in want.items():
            if key not in bound:
                up.bind_exchange(via, up_ex, key[0], bargs)
                bound[key] = bargs

    mirror()

    def on_message(msgid: int, rk: str, props: bytes, body: bytes, redelivered: bool,
                   settle: Callable[[bool], None]) -> None:
        link.take(Message(up_ex, rk, None, body, redelivered, msgid, raw=props), up_ex, settle)

    consumer = LinkConsumer(q, link.upstream.prefetch_count, on_message, link.fail,
                            f"federation: {link.resource}")
    q.add_consumer(consumer)
    link._set("running")
    watch = asyncio.ensure_future(link.until_failed())
    try:
        while not watch.done():
            await asyncio.wait([watch], timeout=interval)
            if link.vhost.exchanges.get(link.resource) is not ex:
                raise RuntimeError(f"exchange '{link.resource}' was deleted")
            if q.deleted:
                raise RuntimeError(f"the upstream queue '{name}' was deleted")
            if not watch.done():
                mirror()
        watch.result()
    finally:
        watch.cancel()
        consumer.closed = True
        consumer.detach()


async def queue_session(link: QueueLink, up: VHost, interval: float) -> None:
    from broker.federation.queue_link import demand

    q = link.vhost.queues.get(link.resource)
    if q is None or q.deleted:
        raise RuntimeError(f"no queue '{link.resource}' here")
    up_name = link.upstream_name()
    up_q, _ = up.declare_queue(up_name, durable=True, owner=None) if up_name not in up.queues \
        else (up.queues[up_name], False)

    def on_message(msgid: int, rk: str, props: bytes, body: bytes, redelivered: bool,
                   settle: Callable[[bool], None]) -> None:
        msg = Message("", rk, None, body, redelivered, msgid, raw=props)
        link.forward(msg, "", link.resource, link.hops_of(msg), ("queue", up_name), settle)

    consumer = LinkConsumer(up_q, link.upstream.prefetch_count, on_message, link.fail,
                            f"federation: {link.resource}", gate=lambda: demand(q))
    attached = False
    link._set("running")
    watch = asyncio.ensure_future(link.until_failed())
    try:
        while not watch.done():
            await asyncio.wait([watch], timeout=interval)
            if watch.done():
                break
            if link.vhost.queues.get(link.resource) is not q or q.deleted:
                raise RuntimeError(f"queue '{link.resource}' was deleted")
            if up_q.deleted:
                raise RuntimeError(f"the upstream queue '{up_name}' was deleted")
            wanted = demand(q)
            if wanted and not attached:
                up_q.add_consumer(consumer)
            elif wanted:
                up_q.schedule_delivery()  # the gate may have closed a pass: try again
            elif not wanted and attached:
                consumer.detach()
            attached = wanted
        watch.result()
    finally:
        watch.cancel()
        consumer.closed = True
        consumer.detach()
