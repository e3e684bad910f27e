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
Headers alone do not split a run: most client libraries send some on every message. A
deduplicating exchange (``x-message-deduplication`` its only behaviour) does not split one
either: the run is routed once past it, each message's key (read in place, not decoded with
the rest of the headers) looked up and remembered in its cache in order, the duplicates
dropped (held: accepted and confirmed) and the rest stored as a run; ``publish_batch`` does the
same per message. A message nacked for a full disk is not published, so its key is forgotten
again on every path (its retry must not be dropped as a duplicate). ``FastPaths.on``
(broker/model/fastpaths.py) switches every such shortcut off (runs here, direct hand-over
to consumers and delivery runs in the queue); the differential tests compare both settings
byte for byte.

Where it sits: above the queue engine and the exchanges it routes through, below the vhost
that calls it (the ``model-stack`` contract). It reads the vhost through ``Scope``; its
request and outcome are plain data in ``broker/model/publish_api.py`` (re-exported here), so
dead-lettering and delayed firing, which sit below it, can build them and publish again
through the ``Republisher`` the vhost hands them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from broker import errors, properties
from broker.model import features
from broker.model.dedup_cache import DedupCache, dedup_key, kept_by, now_ms
from broker.model.exchange import Exchange
from broker.model.fastpaths import FastPaths
from broker.model.publish_api import BatchOutcome as BatchOutcome
from broker.model.publish_api import EncodedNames as EncodedNames
from broker.model.publish_api import KeyedNames as KeyedNames
from broker.model.publish_api import Names as Names
from broker.model.publish_api import PublishOutcome as PublishOutcome
from broker.model.publish_api import PublishRequest as PublishRequest
from broker.model.queue import ClassicQueue, Queue
from broker.store.priority_store import PriorityStore
from broker.store.queue_store import QueueStore
from broker.store.segment import FIXED_SIZE, record_size

_HEADERS = properties.HI_HEADERS
_DELIVERY_MODE = properties.HI_DELIVERY_MODE
_EXPIRATION = properties.HI_EXPIRATION
# flags that can make one message route unlike the last: headers (CC/BCC) and expiration
_PER_MESSAGE = properties.HI_HEADERS | properties.HI_EXPIRATION


class Scope(Protocol):
    """What the publish operation reads of the vhost it publishes in (``VHost`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def exchanges(self) -> Mapping[str, Exchange]: ...

    @property
    def queues(self) -> Mapping[str, Queue]: ...

    @property
    def fast(self) -> FastPaths: ...


class _NotARun(Exception):
    """A probe route met what decides per message (see ``publish_run``)."""


_last_read: list[Any] = [b"", False]  # the properties is_persistent read last, and its answer


def is_persistent(props: bytes) -> bool:
    """delivery-mode 2? Read once per properties object: a publisher repeating its
    properties hands over the very same bytes object every time."""
    if props is _last_read[0]:
        return bool(_last_read[1])
    persistent = bool(props and props[0] & _DELIVERY_MODE) and properties.delivery_mode(props) == 2
    _last_read[0] = props
    _last_read[1] = persistent
    return persistent


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


def publish(vh: Scope, req: PublishRequest, first_hop: bool = True) -> PublishOutcome:
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
    routing_key = req.routing_key
    out = PublishOutcome([])
    extra: list[str] | None = None
    has_exp = False
    if flags & _PER_MESSAGE and features.routes_alone(props):
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
            q.expiration_seen()  # its head expiry is checked from now
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
        if persistent is None:  # read from the properties only where it matters: a durable queue
            persistent = is_persistent(props) if any(q.durable for q in queues) else False
        try:
            if len(queues) > 1:
                reserve(queues, record_size(exb, rkb, props, body), props, ts)
            for q in queues:
                if q.publish(ts, exb, rkb, props, body, persistent, exrk) is False:
                    out.rejected = True
                elif persistent and q.durable:
                    out.sync = True
        except (errors.DiskFull, OSError):
            # not stored: a deduplicating exchange must not drop its retry as a duplicate
            for cache in out.remembered or ():
                cache.forget([req.props])
            raise
    return out


def _probe_headers() -> dict[str, Any] | None:
    raise _NotARun


def reserve(queues: list[Queue], size: int, props: bytes, ts: int) -> None:
    """A full disk stores a message (or a run) everywhere or nowhere: room for ``size`` bytes
    first in the write segment of every queue it reaches, whatever its store's kind (a
    priority queue's level, a stream's log), so DiskFull comes before anything is written."""
    for q in queues:
        q.store.make_room(size, props, ts)


def route(vh: Scope, ex: Exchange, keys: list[str], props: bytes, req: PublishRequest,
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
                if not isinstance(d, Queue):
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
                    if special.delayed is not None and special.delayed.durable \
                            or special.dedup is not None and special.dedup.durable:
                        out.sync = True  # held on disk, or a duplicate of a key maybe not yet synced
                    continue
                if special.dedup is not None:
                    out.remembered = [*(out.remembered or ()), special.dedup]
            if dests is None:
                dests = e.route(key, headers_of)
                if not dests and e is ex and ex.alternate:
                    alt = vh.exchanges.get(ex.alternate)
                    if alt is not None and id(alt) not in seen:
                        dests = (alt,)
            for d in dests:
                if isinstance(d, Queue):
                    if d not in queues:
                        queues.append(d)
                elif id(d) not in seen:
                    seen.add(id(d))
                    todo.append(d)
    return queues


_UNSEEN: Any = object()


def publish_batch(vh: Scope, exchange: str, keys: Sequence[KeyedNames], props: list[bytes],
                  bodies: list[bytes], ts: int, first: int = 0) -> BatchOutcome:
    """Publish messages to one exchange, each with its own routing key (``keys[i]``), as
    ``publish`` would one by one, from ``first`` for as long as that can be done at once:
    ``done`` in the outcome is the index of the first message not published (the caller
    publishes it through ``publish`` and calls again after it), ``first`` when not even
    that one qualifies.

    At once means what it means for ``publish_run`` (fast paths on, no expiration or CC/BCC
    header, no exchange with a behaviour of its own on the route but a deduplicating first
    exchange, no routing by headers,
    only queues without features), with the route looked up once per routing key. Each
    queue takes its messages in their order, as runs of one routing key (``publish_run``
    of the queue): a topic exchange fed keys in turn still hands every queue its part of
    the batch at once. A full disk raises before anything is written: every queue reached
    has room for its whole part first.
    """
    out = BatchOutcome(first)
    if not vh.fast.on:
        return out
    ex = vh.exchanges.get(exchange)
    if ex is None:
        return out
    dedup = None
    if ex.special is not None:
        dedup = ex.special.run_cache()  # deduplicating only: each message through its cache
        if dedup is None:
            return out
    by_name = exchange == ""
    routes: dict[str, Any] = {}  # routing key -> the queues it reaches, or None: not at once
    parts: dict[Queue, list[int]] = {}  # each queue's messages, in order
    remembered: list[bytes] = []  # the properties of messages whose keys ``dedup`` took as new
    unroutable = out.unroutable
    n = len(bodies)
    i = first
    now = now_ms() if dedup is not None else 0
    while i < n:
        p = props[i]
        if p[0] & _PER_MESSAGE and features.routes_alone(p):
            break
        rk = keys[i].routing_key
        queues = routes.get(rk, _UNSEEN)
        if queues is _UNSEEN:
            queues = routes[rk] = _batch_route(vh, ex, by_name, rk, p, dedup is None)
        if queues is None:
            break
        if dedup is not None:  # looked up in order, as one by one (which looks up before routing)
            key, ttl = dedup_key(p)
            if key is not None:
                if dedup.seen(key, ttl, now):
                    i += 1  # a duplicate: dropped, accepted (neither stored nor unroutable)
                    if dedup.durable:
                        out.sync = True  # confirmed after the original's key is synced
                    continue
                remembered.append(p)
        if not queues:
            unroutable.append(i)
        for q in queues:
            part = parts.get(q)
            if part is None:
                parts[q] = [i]
            else:
                part.append(i)
        i += 1
    if i == first:
        return out
    try:
        if dedup is not None:
            dedup.write()  # the new keys' records before their messages (DiskFull: neither)
        _store_batch(ex, keys, props, bodies, ts, parts, out)
    except (errors.DiskFull, OSError):
        if dedup is not None:  # nothing stored: the caller publishes them again one by one
            dedup.forget(remembered)
        raise
    ex.n_in += i - first
    out.queues = list(parts)
    out.done = i
    return out


def _store_batch(ex: Exchange, keys: Sequence[KeyedNames], props: list[bytes], bodies: list[bytes], ts: int,
                 parts: dict[Queue, list[int]], out: BatchOutcome) -> None:
    """A batch's messages into each queue they reach (``parts``: each queue's, in order)."""
    # room in every queue for its whole part first (a full disk: nothing written)
    fixed = FIXED_SIZE - 2  # FIXED_SIZE counts the length octets that exrk holds
    for q, part in parts.items():
        if len(part) == 1:
            j = part[0]
            q.store.make_room(fixed + len(keys[j].exrk) + len(props[j]) + len(bodies[j]), props[j], ts)
        else:
            q.store.make_room(sum([fixed + len(keys[j].exrk) + len(props[j]) + len(bodies[j]) for j in part]),
                              props[part[0]], ts)
    for q, part in parts.items():
        durable = q.durable
        ex.n_out += len(part)
        if len(part) == 1:  # a delivery of its own: no run to set up
            j = part[0]
            names = keys[j]
            persistent = durable and is_persistent(props[j])
            q.publish(ts, names.exchange_b, names.routing_key_b, props[j], bodies[j], persistent, names.exrk)
            if persistent:
                out.sync = True
        else:  # runs of one routing key
            at = 0
            while at < len(part):
                names = keys[part[at]]
                exrk = names.exrk
                upto = at + 1
                while upto < len(part) and keys[part[upto]].exrk == exrk:
                    upto += 1
                ps = [props[j] for j in part[at:upto]]
                bs = [bodies[j] for j in part[at:upto]]
                persistent = durable and any(map(is_persistent, ps))
                q.publish_run(ts, names.exchange_b, names.routing_key_b, ps, bs, persistent, exrk, False)
                if persistent:
                    out.sync = True
                at = upto


# What a probe hands ``route`` for the message and the outcome: a probe raises ``_NotARun``
# before an exchange's behaviour would read or set either.
_PROBE_REQUEST = PublishRequest("", "", b"", b"", 0)
_PROBE_OUTCOME = PublishOutcome([])


def _probe_route(vh: Scope, ex: Exchange, routing_key: str, props: bytes, varied: bool,
                 first_hop: bool = True) -> list[Queue]:
    """``route`` for messages taken together (a run, or a batch's messages with this routing
    key): the queues each of them reaches; ``_NotARun`` where that could differ per message.
    ``first_hop`` False: ``ex``'s own behaviour is the caller's (a deduplicating run)."""
    return route(vh, ex, [routing_key], props, _PROBE_REQUEST, _PROBE_OUTCOME, first_hop, probe=True,
                 varied=varied)


def _batch_route(vh: Scope, ex: Exchange, by_name: bool, rk: str, props: bytes, first_hop: bool) -> Any:
    """The queues a message with routing key ``rk`` reaches from ``ex`` (no behaviour of its
    own), or None when ``publish_batch`` cannot take it: routing by headers, an exchange
    with a behaviour on the way, a queue with features or priorities (a batch's room is
    made per queue, a priority queue would need it per level)."""
    if by_name:
        q = vh.queues.get(rk)
        queues: Any = () if q is None else (q,)
    else:
        try:
            queues = _probe_route(vh, ex, rk, props, True, first_hop)
        except _NotARun:
            return None
    for q in queues:
        if q.features is not None or isinstance(q.store, PriorityStore):
            return None
    return queues


def publish_run(vh: Scope, exchange: str, routing_key: str, names: EncodedNames, props: list[bytes],
                bodies: list[bytes], same: bool, ts: int, flags: int | None = None) -> PublishOutcome | None:
    """Publish a run of messages to one exchange and routing key as ``publish`` would one by
    one, when that can be done at once; None when not (the caller then publishes them one by
    one). ``same``: one properties object and one body length for the whole run.
    ``flags``: ``properties.run_flags(props)``, if the caller has it already.

    At once means: fast paths on, no message with an expiration or CC/BCC headers, no
    exchange on the route with a behaviour of its own (but deduplication by the first: see the
    module doc), no routing by headers unless every
    message has the same properties, only queues without features reached, and no
    priority queue unless every message has the same properties.
    """
    if not vh.fast.on:
        return None
    ex = vh.exchanges.get(exchange)
    if ex is None:
        return None
    dedup = None
    if ex.special is not None:
        dedup = ex.special.run_cache()  # deduplicating only: the run goes through its cache
        if dedup is None:
            return None
    if same:
        if props[0][0] & _PER_MESSAGE and features.routes_alone(props[0]):
            return None
    else:
        hi = (properties.run_flags(props) if flags is None else flags) >> 8
        if hi & _EXPIRATION:
            return None
        if hi & _HEADERS:
            if features.holds_cc(b"".join(props)) and any(map(features.may_carry_cc, props)):
                return None
    if exchange == "":
        q = vh.queues.get(routing_key)
        queues = [] if q is None else [q]
    else:
        try:
            queues = _probe_route(vh, ex, routing_key, props[0], not same, dedup is None)
        except _NotARun:
            return None
    if not queues or any(q.features is not None for q in queues):
        return None
    if not same and any(isinstance(q.store, PriorityStore) for q in queues):
        # messages of several priorities: room in each level they go to would have to come
        # first (a full disk must store all of the run or none of it)
        return None
    if dedup is not None:
        return _deduplicated_run(vh, ex, dedup, queues, names, props, bodies, same, ts)
    return _stored_run(ex, queues, names, props, bodies, same, ts, len(bodies))


def _deduplicated_run(vh: Scope, ex: Exchange, dedup: DedupCache, queues: list[Queue], names: EncodedNames,
                      props: list[bytes], bodies: list[bytes], same: bool, ts: int) -> PublishOutcome:
    """A run through a deduplicating exchange: each message's key looked up and remembered in
    order (as one by one), the duplicates dropped (held: accepted and confirmed), the rest
    stored as a run. When they cannot be stored (a full disk) their keys are forgotten again,
    so the caller's one-by-one publish finds them new."""
    k = len(bodies)
    kept = kept_by(dedup, props)
    if len(kept) < k:
        props = [props[i] for i in kept]
        bodies = [bodies[i] for i in kept]
    if not kept:
        ex.n_in += k
        return PublishOutcome([], held=True, sync=dedup.durable)
    try:
        out = _stored_run(ex, queues, names, props, bodies, same, ts, k)
    except (errors.DiskFull, OSError):
        dedup.forget(props)
        raise
    if len(kept) < k:
        out.held = True
        out.sync = out.sync or dedup.durable  # the duplicates' confirms after the originals' keys
    return out


def _stored_run(ex: Exchange, queues: list[Queue], names: EncodedNames, props: list[bytes],
                bodies: list[bytes], same: bool, ts: int, arrived: int) -> PublishOutcome:
    """A run routed to ``queues`` appended to each (``arrived``: how many came into ``ex``)."""
    # persistence only decides whether a durable queue must sync before a confirm
    if not any(q.durable for q in queues):
        persistent = False
    elif same:
        persistent = is_persistent(props[0])
    else:  # any of them
        persistent = any(is_persistent(p) for p in props)
    if len(queues) > 1 or not isinstance(queues[0], ClassicQueue):
        # (one classic queue makes room itself, when it stores: not for a direct hand-over)
        reserve(queues, QueueStore.run_size(names.exrk, props, bodies, same), props[0], ts)
    k = len(bodies)
    ex.n_in += arrived
    ex.n_out += k * len(queues)
    for q in queues:
        q.publish_run(ts, names.exchange_b, names.routing_key_b, props, bodies, persistent, names.exrk, same)
    return PublishOutcome(queues, sync=persistent)
