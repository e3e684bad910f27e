"""The one publish operation: every way a message enters the broker ends here.

Theory of operation
-------------------
``VHost.publish(PublishRequest) -> PublishOutcome`` (implemented by ``publish`` below) is
what AMQP single publishes, AMQP transaction commits, the HTTP publish API, dead-lettering
and delayed-message firing call; protocols still to come (an HTTP queue API, MQTT,
shovels) call it too and never route themselves. It:

1. finds the exchange (404 when missing; whether a client may publish to it, internal or
   permissions, is the caller's question: dead-lettering may use an internal exchange);
2. reads what the raw properties ask for, only when their flag bits say so: an
   ``expiration`` (406 unless a non-negative integer) and ``CC``/``BCC`` headers, which
   add routing keys (``BCC`` is removed from the stored copy);
3. routes: the exchange's own type, then exchange-to-exchange bindings breadth first, each
   exchange once; the alternate exchange when the first exchange routes nowhere. Every
   exchange on the way applies its own behaviour (``ExchangeSpecial``: deduplication,
   delay, consistent hashing), so a delayed exchange delays and a dedup exchange drops
   duplicates however the message reaches it: published to it, through an exchange
   binding, or dead-lettered to it. A message an exchange keeps (delayed) or drops
   (duplicate) is ``held``: accepted, not unroutable;
4. appends to each queue reached (the queue applies its limits and features; a queue may
   refuse it: ``rejected``, which AMQP answers with a basic.nack under confirms).

The outcome says what happened; the caller answers in its own protocol (basic.return for
a mandatory unroutable message, basic.ack/nack, an HTTP body). ``sync`` is true when a
persistent message reached a durable place, so a confirm must wait for the group commit.

Runs. ``publish_run`` takes several messages to one exchange and routing key at once
(what the AMQP parser finds when a client repeats a publish). It is an optimisation of
``publish`` decided here, in one place: a run whose messages need nothing per message
(no expiration, no CC/BCC header, only plain queues reached, no exchange on the way with
a behaviour of its own or routing by headers that differ from message to message, runs
switched on) is routed once and handed to each queue as a run; otherwise it returns None
and the caller publishes the messages one by one, which is the reference behaviour.
Headers alone do not split a run: most client libraries send some on every message. ``FastPaths.on``
(broker/model/fastpaths.py) switches every such shortcut off (runs here, direct hand-over
to consumers and delivery runs in the queue); the differential tests compare both settings
byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from broker import errors, properties
from broker.model import features
from broker.model.queue import Queue as QueueT
from broker.store.queue_store import QueueStore
from broker.store.segment import record_size, short_pair

if TYPE_CHECKING:
    from broker.model.exchange import Exchange
    from broker.model.queue import Queue
    from broker.model.vhost import VHost

_HEADERS = properties.HI_HEADERS
_DELIVERY_MODE = properties.HI_DELIVERY_MODE
_EXPIRATION = properties.HI_EXPIRATION
# flags that can make one message route unlike the last: headers (CC/BCC) and expiration
_PER_MESSAGE = properties.HI_HEADERS | properties.HI_EXPIRATION


class _NotARun(Exception):
    """A probe route met what decides per message (see ``publish_run``)."""


class EncodedNames(Protocol):
    """An exchange and routing key in the encodings the store and deliveries use."""

    exchange_b: bytes
    routing_key_b: bytes
    exrk: bytes  # both as AMQP short strings, as a stored record and basic.deliver carry them


class Names:
    """``EncodedNames`` from the two strings."""

    __slots__ = ("exchange_b", "routing_key_b", "exrk")

    def __init__(self, exchange: str, routing_key: str) -> None:
        self.exchange_b = exchange.encode()
        self.routing_key_b = routing_key.encode()
        self.exrk = short_pair(self.exchange_b, self.routing_key_b)


class PublishRequest:
    """One message to publish, protocol-neutral.

    ``props``: the AMQP content-header property bytes (flags first), the store's format for
    every protocol. ``ts``: arrival time in ms. ``persistent``: None to read delivery-mode
    from ``props``. ``names``: the exchange and routing key already encoded, when the
    caller has them (an AMQP session keeps them per publish method frame). ``exclude``:
    queues the message must not reach (dead-lettering's cycle rule). ``cc``: False to route
    by ``routing_key`` alone, ignoring CC/BCC headers (dead-lettering with a dead-letter
    routing key).
    """

    __slots__ = ("exchange", "routing_key", "props", "body", "ts", "persistent", "names", "exclude", "cc")

    def __init__(self, exchange: str, routing_key: str, props: bytes, body: bytes | memoryview, ts: int,
                 persistent: bool | None = None, names: EncodedNames | None = None,
                 exclude: Callable[[Queue], bool] | None = None, cc: bool = True) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.props = props
        self.body = body
        self.ts = ts
        self.persistent = persistent
        self.names = names
        self.exclude = exclude
        self.cc = cc


class PublishOutcome:
    """What happened to one published message (or to every message of a run).

    ``queues``: the queues that took it (or refused it, see ``rejected``); ``rejected``: a
    queue refused it (length limit with reject-publish); ``held``: an exchange kept it for
    later (delayed) or dropped it as a duplicate: accepted, not unroutable; ``sync``: it
    reached durable storage, so a confirm waits for the group commit.
    """

    __slots__ = ("queues", "rejected", "held", "sync")

    def __init__(self, queues: list[Queue], rejected: bool = False, held: bool = False,
                 sync: bool = False) -> None:
        self.queues = queues
        self.rejected = rejected
        self.held = held
        self.sync = sync

    @property
    def unroutable(self) -> bool:
        return not self.queues and not self.held

    def __repr__(self) -> str:
        return (f"PublishOutcome(queues={[q.name for q in self.queues]}, rejected={self.rejected}, "
                f"held={self.held}, sync={self.sync})")


def is_persistent(props: bytes) -> bool:
    return bool(props and props[0] & _DELIVERY_MODE) and properties.delivery_mode(props) == 2


def _headers_of(props: bytes) -> Callable[[], dict[str, Any] | None]:
    cache: list[dict[str, Any] | None] = []

    def headers_of() -> dict[str, Any] | None:
        if not cache:
            try:
                h = properties.decode(props).headers if props and props[0] & _HEADERS else None
            except Exception:
                h = None
            cache.append(dict(h) if h else None)
        return cache[0]

    return headers_of


def _no_headers() -> dict[str, Any] | None:
    return None


def publish(vh: VHost, req: PublishRequest, first_hop: bool = True) -> PublishOutcome:
    """Route ``req`` and append it to every queue it reaches (see the module doc).

    ``first_hop`` False: the message comes out of the first exchange's own hold (a delayed
    message firing), so that exchange's behaviour is not applied again.
    """
    ex = vh.exchanges.get(req.exchange)
    if ex is None:
        raise errors.NotFound(f"no exchange '{req.exchange}' in vhost '{vh.name}'")
    props = req.props
    flags = props[0] if props else 0
    persistent = req.persistent
    if persistent is None:
        persistent = is_persistent(props)
    routing_key = req.routing_key
    out = PublishOutcome([])
    extra: list[str] | None = None
    has_exp = False
    if flags & _EXPIRATION or (flags & _HEADERS and b"CC" in props):
        # an expiration (a valid TTL) or headers that may hold CC/BCC (keys added, BCC removed)
        props, extra, has_exp = features.inspect_publish(props)
        if not req.cc:
            extra = None
    if req.exchange == "" and extra is None and req.exclude is None:
        q = vh.queues.get(routing_key)  # the common case: one queue by name
        queues = [] if q is None else [q]
    else:
        queues = route(vh, ex, [routing_key, *extra] if extra else [routing_key], props, req, out, first_hop)
        if req.exclude is not None:
            queues = [q for q in queues if not req.exclude(q)]
    ex.n_in += 1
    if has_exp:
        for q in queues:
            q.expiration_seen(vh)  # its head expiry is checked from now
    if queues:
        ex.n_out += len(queues)
        out.queues = queues
        ts = req.ts
        names = req.names
        if names is None:
            names = req.names = Names(req.exchange, routing_key)
        exb = names.exchange_b
        rkb = names.routing_key_b
        exrk = names.exrk
        body = req.body
        if len(queues) > 1:
            reserve(queues, record_size(exb, rkb, props, body), props, ts)
        for q in queues:
            if q.publish(ts, exb, rkb, props, body, persistent, exrk) is False:
                out.rejected = True
            elif persistent and q.durable:
                out.sync = True
    return out


def _probe_headers() -> dict[str, Any] | None:
    raise _NotARun


def reserve(queues: list[Queue], size: int, props: bytes, ts: int) -> None:
    """A full disk stores a message (or a run) everywhere or nowhere: room for ``size`` bytes
    first in the write segment of every queue it reaches, whatever its store's kind (a
    priority queue's level, a stream's log), so DiskFull comes before anything is written."""
    for q in queues:
        q.store.make_room(size, props, ts)


def route(vh: VHost, ex: Exchange, keys: list[str], props: bytes, req: PublishRequest,
          out: PublishOutcome, first_hop: bool, probe: bool = False, varied: bool = False) -> list[Queue]:
    """The queues a message reaches from ``ex`` with routing keys ``keys``, applying each
    exchange's behaviour once (sets ``out.held``/``out.sync`` when one keeps the message).

    ``props`` are the properties as stored (BCC removed); an exchange's behaviour sees the
    message as published (``req.props``), so a delayed message keeps its BCC for later.
    ``probe``: route for a whole run: raises ``_NotARun`` instead of applying an exchange's
    behaviour, and with ``varied`` (the run's properties differ) instead of reading headers.
    """
    if varied:
        headers_of = _probe_headers
    else:
        headers_of = _headers_of(props) if props and props[0] & _HEADERS else _no_headers
    if len(keys) == 1 and (ex.special is None or not first_hop):
        # one key into an exchange without a behaviour of its own that reaches only queues
        first = ex.route(keys[0], headers_of)
        if first:
            for d in first:
                if not isinstance(d, QueueT):
                    break
            else:
                return list(first)  # type: ignore[arg-type]
    queues: list[Queue] = []
    for key in keys:
        seen: set[int] = {id(ex)}
        todo: list[Any] = [ex]
        i = 0
        while i < len(todo):
            e = todo[i]
            i += 1
            special = e.special
            dests: Any = None
            if special is not None and (e is not ex or first_hop):
                if probe:
                    raise _NotARun
                if key is not keys[0]:
                    continue  # an exchange with a behaviour takes a message once, by its routing key
                persistent = req.persistent if req.persistent is not None else is_persistent(req.props)
                kept, dests = special.on_publish(req.ts, key, req.props, req.body, persistent)
                if kept:
                    out.held = True
                    if special.delayed is not None and special.delayed.durable:
                        out.sync = True
                    continue
            if dests is None:
                dests = e.route(key, headers_of)
                if not dests and e is ex and ex.alternate:
                    alt = vh.exchanges.get(ex.alternate)
                    if alt is not None and id(alt) not in seen:
                        dests = (alt,)
            for d in dests:
                if isinstance(d, QueueT):
                    if d not in queues:
                        queues.append(d)
                elif id(d) not in seen:
                    seen.add(id(d))
                    todo.append(d)
    return queues


def publish_run(vh: VHost, exchange: str, routing_key: str, names: EncodedNames, props: list[bytes],
                bodies: list[bytes], same: bool, ts: int) -> PublishOutcome | None:
    """Publish a run of messages to one exchange and routing key as ``publish`` would one by
    one, when that can be done at once; None when not (the caller then publishes them one by
    one). ``same``: one properties object and one body length for the whole run.

    At once means: fast paths on, no message with an expiration or CC/BCC headers, no
    exchange on the route with a behaviour of its own, no routing by headers unless every
    message has the same properties, and only queues without features reached.
    """
    if not vh.fast.on:
        return None
    ex = vh.exchanges.get(exchange)
    if ex is None or ex.special is not None:
        return None
    if same:
        if props[0][0] & _PER_MESSAGE and features.routes_alone(props[0]):
            return None
    else:
        hi = properties.run_flags(props) >> 8
        if hi & _EXPIRATION or (hi & _HEADERS and b"CC" in b"".join(props)
                                 and any(map(features.may_carry_cc, props))):
            return None
    if exchange == "":
        q = vh.queues.get(routing_key)
        queues = [] if q is None else [q]
    else:
        req = PublishRequest(exchange, routing_key, props[0], b"", ts)
        try:
            queues = route(vh, ex, [routing_key], props[0], req, PublishOutcome([]), True, probe=True,
                           varied=not same)
        except _NotARun:
            return None
    if not queues or any(q.features is not None for q in queues):
        return None
    # persistence only decides whether a durable queue must sync before a confirm
    if not any(q.durable for q in queues):
        persistent = False
    elif same:
        persistent = is_persistent(props[0])
    else:  # any of them
        persistent = any(is_persistent(p) for p in props)
    reserve(queues, QueueStore.run_size(names.exrk, props, bodies, same), props[0], ts)
    k = len(bodies)
    ex.n_in += k
    ex.n_out += k * len(queues)
    for q in queues:
        q.publish_run(ts, names.exchange_b, names.routing_key_b, props, bodies, persistent, names.exrk, same)
    return PublishOutcome(queues, sync=persistent)
