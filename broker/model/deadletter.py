"""Dead-lettering and the header surgery it needs (cold path only).

Theory of operation
-------------------
A message leaves a queue as a dead letter for one of four reasons: ``rejected``
(basic.reject/nack without requeue), ``expired`` (TTL), ``maxlen`` (overflow
drop-head or reject-publish-dlx) and ``delivery_limit``. It is republished to
the queue's dead-letter exchange with the dead-letter routing key, or with its
original routing keys (routing key plus CC) when none is set. Before that its
properties are rewritten as RabbitMQ does: the ``x-death`` array gets an entry
per (queue, reason) holding count, reason, queue, time, exchange,
routing-keys (and original-expiration, the ``expiration`` property being
removed so the copy does not expire again); an existing entry for the same
queue and reason is counted up and moved to the front. ``x-first-death-*`` is
set once, ``x-last-death-*`` every time. A missing dead-letter exchange drops
the message silently.

Cycles: a target queue is skipped when the message already died in it and no
client rejection happened since (walking ``x-death`` from the most recent
entry); this stops e.g. a TTL queue dead-lettering into itself, while letting
a consumer's reject send a message round a retry loop.

At-least-once (quorum queues with ``x-dead-letter-strategy: at-least-once`` and
``x-overflow: reject-publish``, as RabbitMQ requires): a dead letter that no target
took stays unacked in the source queue's store and is offered again every
``DL_RETRY_S`` in order (``QueueFeatures``); only once a target takes it is it
acked in the source. After a restart such a message is ready again in the source
(redelivered), never lost.

Properties are only decoded here and in the other feature code, never on the
plain publish/deliver path.
"""

from __future__ import annotations

import datetime
from typing import Any

from broker import properties
from broker.model.publish_api import PublishRequest, Republisher
from broker.model.queue import Queue

DL_RETRY_S = 1.0  # at-least-once: how often a refused dead letter is offered to its target again


def _s(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes | bytearray) else str(v)


def cc_keys(headers: dict[str, Any] | None) -> list[str]:
    """The CC routing keys of a message's headers (an array of strings, or one string)."""
    if not headers:
        return []
    cc = headers.get("CC")
    if isinstance(cc, list):
        return [_s(k) for k in cc]
    if isinstance(cc, str | bytes):
        return [_s(cc)]
    return []


def set_header(props: bytes, key: str, value: Any) -> bytes:
    """``props`` with one header set (decodes and re-encodes the properties)."""
    p = properties.decode(props)
    headers = dict(p.headers or {})
    headers[key] = value
    p.headers = headers
    return properties.encode(p)


def x_death_props(props: bytes, queue: str, reason: str, exchange: str,
                  routing_key: str) -> tuple[bytes, list[dict[str, Any]], list[str]]:
    """Rewritten properties, the new x-death list and the message's routing keys."""
    p = properties.decode(props)
    headers: dict[str, Any] = dict(p.headers or {})
    routing_keys = [routing_key, *cc_keys(headers)]
    deaths_raw = headers.get("x-death")
    deaths: list[dict[str, Any]] = [dict(d) for d in deaths_raw if isinstance(d, dict)] \
        if isinstance(deaths_raw, list) else []
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0, tzinfo=None)
    found = None
    for i, d in enumerate(deaths):
        if _s(d.get("queue", "")) == queue and _s(d.get("reason", "")) == reason:
            found = deaths.pop(i)
            break
    if found is not None:
        count = found.get("count", 1)
        found["count"] = (count if isinstance(count, int) else 1) + 1
        entry = found
    else:
        entry = {"count": 1, "reason": reason, "queue": queue, "time": now,
                 "exchange": exchange, "routing-keys": routing_keys}
        if p.expiration is not None:
            entry["original-expiration"] = p.expiration
    deaths.insert(0, entry)
    headers["x-death"] = deaths
    if "x-first-death-reason" not in headers:
        headers["x-first-death-reason"] = reason
        headers["x-first-death-queue"] = queue
        headers["x-first-death-exchange"] = exchange
    headers["x-last-death-reason"] = reason
    headers["x-last-death-queue"] = queue
    headers["x-last-death-exchange"] = exchange
    headers.pop("x-delivery-count", None)
    p.headers = headers
    p.expiration = None
    return properties.encode(p), deaths, routing_keys


def is_cycle(deaths: list[dict[str, Any]], target: str) -> bool:
    """True when dead-lettering into ``target`` would loop with no client involved.

    ``deaths`` starts with the entry just added for the queue the message dies
    in now, so a queue dead-lettering into itself is a cycle unless the reason
    is ``rejected``.
    """
    for d in deaths:
        if _s(d.get("reason", "")) == "rejected":
            return False
        if _s(d.get("queue", "")) == target:
            return True
    return False


def dead_letter(vh: Republisher, source: Queue, dlx: str, dlrk: str | None, exchange: bytes,
                routing_key: bytes, props: bytes, body: bytes, reason: str, now_ms: int) -> int:
    """Republish one dead letter from ``source`` through the publish operation (so the
    dead-letter exchange's own behaviour applies, e.g. a delay) of ``vh``, the interface the
    vhost handed the queue's features; returns the number of queues that took it (0 when one
    refused it; an exchange holding it counts as one)."""
    if dlx not in vh.exchanges:
        return 0  # RabbitMQ: a missing dead-letter exchange drops the message silently
    new_props, deaths, keys = x_death_props(props, source.name, reason, _s(exchange), _s(routing_key))

    def skip(q: Queue) -> bool:
        return q.deleted or is_cycle(deaths, q.name)

    # with a dead-letter routing key, that key alone routes it; otherwise its routing key and
    # its CC header, as when it was first published
    req = PublishRequest(dlx, dlrk if dlrk is not None else keys[0], new_props, body, now_ms,
                         exclude=skip, cc=dlrk is None)
    out = vh.publish(req)
    if out.rejected:
        return 0  # a target refused it (reject-publish): at-least-once offers it again later
    return len(out.queues) + out.held
