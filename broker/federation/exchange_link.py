"""Exchange federation: the upstream's exchange feeds this one.

Theory of operation
-------------------
On the upstream the link declares a durable queue named after RabbitMQ's
``federation: <exchange> -> <this cluster's name>`` (``queue_name``), with the upstream's
``expires`` and ``message-ttl`` as ``x-expires``/``x-message-ttl``, and, as RabbitMQ's plugin
does, an internal exchange of type ``x-federation-upstream`` beside it (``exchange_name``: the
queue's name and `` A``) with ``x-max-hops`` (the upstream's ``max-hops``),
``x-downstream-name`` (this cluster's name) and ``x-downstream-vhost``. The queue is bound to that
exchange, and the exchange to the upstream exchange with every binding the local exchange has
(routing key and arguments, once each), so the upstream sends only what some local binding
wants. The binding set is mirrored for as long as the link runs: every ``BINDINGS_INTERVAL``
seconds the link compares the local exchange's bindings with what it bound upstream, and binds
and unbinds the difference. An upstream that has no such exchange type (a RabbitMQ without the
federation plugin, an older Skred) refuses the declare; the link then binds its queue to the
upstream exchange directly, as before, and hops are counted here only. (RabbitMQ requires
``x-max-hops`` as a 64-bit ``long``; pamqp encodes a small integer in one byte, so the declare
encodes its integer arguments itself: ``_Declare``.) Deliveries are published here through the
link's ``TurnPublisher`` (``link.py``): a turn's deliveries at once, one group commit.

Hops are counted on **both sides**. Upstream, the ``x-federation-upstream`` exchange routes a
message to the link's queue only if it has crossed fewer than ``max-hops`` links and did not
come from this downstream (broker/model/exchange_features.py): a message that would stop here
never travels. Here, every delivery is checked again (an upstream that binds directly, or one
that counts differently): a message that has already crossed ``max-hops`` links is dropped
(acked upstream: it is not lost, it arrived where it should have stopped), and so is one that
has already left this vhost of this cluster once (a cycle: its ``x-received-from`` list names
this ``cluster-name`` and vhost). So in a cycle A -> B -> A every message reaches each broker
once, whatever ``max-hops`` says, and in a chain A -> B -> C it reaches C only with
``max-hops`` 2 or more.
"""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import Callable
from typing import Any

from pamqp import commands, encode

from broker.federation import local
from broker.federation.link import Link, UpstreamWire
from broker.links.message import Message
from broker.links.wire import Closed
from broker.model.exchange import Exchange
from broker.model.exchange_features import FEDERATION_UPSTREAM
from broker.model.vhost import VHost

_NOT_IN_GRAMMAR = re.compile(r"[^a-zA-Z0-9_.:@#,/+ -]")  # a name's characters (AMQP 0-9-1 grammar)
BINDINGS_INTERVAL = 0.5  # seconds between comparisons of the local exchange's bindings

Binding = tuple[str, tuple[tuple[str, Any], ...]]  # routing key, arguments (sorted, hashable)


def queue_name(exchange: str, upstream_exchange: str, cluster: str, vhost: str) -> str:
    """The upstream queue's name: RabbitMQ's ``federation: X -> cluster`` shape, in the
    characters the AMQP 0-9-1 grammar allows a name (RabbitMQ's own ``->`` and parentheses are
    outside it, and the client library refuses to send them): ``federation: X - cluster``, then
    `` vhost`` for a vhost other than ``/`` and `` exchange`` when the local one is named otherwise."""
    name = f"federation: {upstream_exchange} - {cluster}"
    if vhost != "/":
        name += f" {vhost}"
    if exchange != upstream_exchange:
        name += f" {exchange}"
    return _NOT_IN_GRAMMAR.sub("_", name)[:255]


def exchange_name(queue: str) -> str:
    """The upstream's ``x-federation-upstream`` exchange of the link whose queue is ``queue``."""
    return f"{queue[:253]} A"


def upstream_exchange_args(link: Link) -> dict[str, Any]:
    """The arguments of that exchange: where the link's messages go, and how far they may."""
    return {"x-max-hops": link.upstream.max_hops, "x-downstream-name": link.cluster_name,
            "x-downstream-vhost": link.vhost.name}


class _Declare(commands.Exchange.Declare):
    """``exchange.declare`` whose integer arguments go as 64-bit ``long`` (``l``) values: RabbitMQ
    refuses an ``x-federation-upstream`` exchange whose ``x-max-hops`` is not one, and the client
    library encodes an integer in the fewest bytes. The rest of the frame is the library's."""

    def marshal(self) -> bytes:
        args, self.arguments = self.arguments or {}, {}
        try:
            head = super().marshal()  # ends with the empty table's length
        finally:
            self.arguments = args
        table = b"".join(encode.short_string(k) + _value(v) for k, v in args.items())
        return head[:-4] + _U32.pack(len(table)) + table


def _value(v: Any) -> bytes:
    if type(v) is int and -(1 << 63) <= v < 1 << 63:
        return _LONG.pack(b"l", v)
    return encode.encode_table_value(v)


_LONG = struct.Struct(">cq")  # (with its type octet)
_U32 = struct.Struct(">I")


def _hashable(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    return v


def local_bindings(ex: Exchange) -> dict[Binding, dict[str, Any]]:
    out: dict[Binding, dict[str, Any]] = {}
    for _dest, rk, args in ex.bindings():
        args = {k: v for k, v in (args or {}).items() if k != "x-bound-from"}
        out[(rk, _hashable(args))] = dict(args)
    return out


class ExchangeLink(Link):
    kind = "exchange"
    direct = False  # the upstream has no x-federation-upstream type: the queue binds directly

    def upstream_name(self) -> str:
        return self.upstream.exchange or self.resource

    def queue(self) -> str:
        return queue_name(self.resource, self.upstream_name(), self.cluster_name, self.vhost.name)

    async def _session(self, wire: UpstreamWire) -> None:
        ex = self.vhost.exchanges.get(self.resource)
        if ex is None:
            raise RuntimeError(f"no exchange '{self.resource}' here")
        up_ex, queue = self.upstream_name(), self.queue()
        ch = await self._channel(wire, 1)
        try:
            passive = commands.Exchange.Declare(exchange=up_ex, passive=True)
            await wire.ask(ch, passive, commands.Exchange.DeclareOk)
        except Closed as exc:
            if exc.code != 404:
                raise
            ch = await self._channel(wire, ch + 1)  # the passive declare closed the channel
            declare = commands.Exchange.Declare(exchange=up_ex, exchange_type=ex.type, durable=ex.durable,
                                                arguments=_jsonable(ex.arguments))
            await wire.ask(ch, declare, commands.Exchange.DeclareOk)
        args: dict[str, Any] = {"x-internal-purpose": "federation"}
        if self.upstream.expires is not None:
            args["x-expires"] = self.upstream.expires
        if self.upstream.message_ttl is not None:
            args["x-message-ttl"] = self.upstream.message_ttl
        await wire.ask(ch, commands.Queue.Declare(queue=queue, durable=True, arguments=args),
                       commands.Queue.DeclareOk)
        ch, via = await self._upstream_exchange(wire, ch, queue)
        bound: dict[Binding, dict[str, Any]] = {}
        await self._mirror(wire, ch, ex, queue, up_ex, bound, via)
        await self.qos(wire, ch)

        def deliver(msg: Message) -> None:
            try:
                self.take(msg, up_ex, self.remote_settler(msg))
            except Exception as exc:
                self.fail(exc)

        await self.consume(wire, ch, queue, deliver)
        self._set("running")
        watch = asyncio.ensure_future(self.until_failed())
        try:
            while not watch.done():
                await asyncio.wait([watch], timeout=BINDINGS_INTERVAL)
                current = self.vhost.exchanges.get(self.resource)
                if current is not ex:
                    raise RuntimeError(f"exchange '{self.resource}' was deleted")
                if not watch.done():
                    await self._mirror(wire, ch, ex, queue, up_ex, bound, via)
            watch.result()
        finally:
            watch.cancel()

    @staticmethod
    async def _channel(wire: UpstreamWire, ch: int) -> int:
        await wire.ask(ch, commands.Channel.Open(), commands.Channel.OpenOk)
        return ch

    async def _local_session(self, up: VHost) -> None:
        await local.exchange_session(self, up, BINDINGS_INTERVAL)

    async def _upstream_exchange(self, wire: UpstreamWire, ch: int, queue: str) -> tuple[int, str | None]:
        """Declare the ``x-federation-upstream`` exchange and bind the queue to it: the channel to
        go on with, and the exchange (None: the upstream has no such type, bind directly)."""
        via, args = exchange_name(queue), upstream_exchange_args(self)
        if self.direct:
            return ch, None
        for attempt in (1, 2):
            try:
                declare = _Declare(exchange=via, exchange_type=FEDERATION_UPSTREAM, durable=True,
                                   internal=True, arguments=args)
                await wire.ask(ch, declare, commands.Exchange.DeclareOk)
                break
            except Closed as exc:
                if exc.code == 406:  # precondition failed: the channel is closed
                    ch = await self._channel(wire, ch + 1)
                    if attempt == 2:  # refused even new: an upstream with rules of its own
                        self.direct = True
                        return ch, None
                    # declared before with other arguments (max-hops changed)
                    await wire.ask(ch, commands.Exchange.Delete(exchange=via), commands.Exchange.DeleteOk)
                    continue
                if exc.code in (503, 540):
                    # no such exchange type upstream (a connection error): from now on bind directly
                    self.direct = True
                raise
        bind = commands.Queue.Bind(queue=queue, exchange=via, routing_key="")
        await wire.ask(ch, bind, commands.Queue.BindOk)
        return ch, via

    async def _mirror(self, wire: UpstreamWire, ch: int, ex: Exchange, queue: str, up_ex: str,
                      bound: dict[Binding, dict[str, Any]], via: str | None) -> None:
        want = local_bindings(ex)
        for key in [k for k in bound if k not in want]:
            args = bound.pop(key)
            if via is None:
                await wire.ask(ch, commands.Queue.Unbind(queue=queue, exchange=up_ex, routing_key=key[0],
                                                         arguments=args), commands.Queue.UnbindOk)
            else:
                await wire.ask(ch, commands.Exchange.Unbind(destination=via, source=up_ex, routing_key=key[0],
                                                            arguments=args), commands.Exchange.UnbindOk)
        for key, args in want.items():
            if key not in bound:
                if via is None:
                    await wire.ask(ch, commands.Queue.Bind(queue=queue, exchange=up_ex, routing_key=key[0],
                                                           arguments=args), commands.Queue.BindOk)
                else:
                    xbind = commands.Exchange.Bind(destination=via, source=up_ex, routing_key=key[0],
                                                   arguments=args)
                    await wire.ask(ch, xbind, commands.Exchange.BindOk)
                bound[key] = args

    def take(self, msg: Message, up_ex: str, settle: Callable[[bool], None]) -> None:
        """One message from the upstream: dropped (settled) past max-hops or on a cycle, else
        published here."""
        hops = self.hops_of(msg)
        if len(hops) >= self.upstream.max_hops or any(self._visited(h) for h in hops):
            settle(True)  # it stops here
            return
        self.forward(msg, self.resource, msg.routing_key, hops, ("exchange", up_ex), settle)

    def _visited(self, hop: Any) -> bool:
        """Did the message leave this vhost of this cluster once already?"""
        if not isinstance(hop, dict):
            return False
        cluster = hop.get("cluster-name")
        cluster = cluster.decode() if isinstance(cluster, bytes) else cluster
        vhost = hop.get("vhost", self.vhost.name)
        vhost = vhost.decode() if isinstance(vhost, bytes) else vhost
        return bool(cluster == self.cluster_name and vhost == self.vhost.name)


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in args.items() if isinstance(v, str | int | float | bool | dict | list)}
