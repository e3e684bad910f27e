"""The publish path for messages that need more than routing: CC/BCC and per-message TTL.

Theory of operation
-------------------
``Session._publish`` calls ``publish_special`` only when the raw property flags
say the message has an ``expiration`` or headers (one bit test, so plain
messages never come here). ``features.inspect_publish`` validates the
expiration (406 if it is not a non-negative integer, as RabbitMQ) and, only if
the raw header bytes contain a ``CC`` or ``BCC`` key, decodes the headers:
CC and BCC routing keys are routed in addition to the routing key, and BCC is
removed from the stored properties. A message with an expiration switches each
queue it reaches to the featured path (``msg_ttl_seen``) so its head expiry is
checked. Anything else falls back to the ordinary path (returns False).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker import properties
from broker.model import features

if TYPE_CHECKING:
    from broker.amqp.connection import PublishArgs
    from broker.model.exchange import Exchange
    from broker.model.queue import Queue
    from broker.net.session import ChannelState, Session


def publish_special(s: Session, chs: ChannelState, ex: Exchange, args: PublishArgs, props: bytes,
                    body: bytes, persistent: bool) -> bool:
    """Publish a message with CC/BCC or an expiration; False when it has neither."""
    props, extra, has_exp = features.inspect_publish(props)
    if extra is None and not has_exp:
        return False
    vh = s.vhost_obj
    exchange = args.exchange
    keys = [args.routing_key, *(extra or ())]
    queues: list[Queue] = []
    headers: list[dict[str, Any] | None] = []

    def headers_of() -> dict[str, Any] | None:
        if not headers:
            h = properties.decode(props).headers
            headers.append(dict(h) if h else None)
        return headers[0]

    for key in keys:
        if exchange == "":
            q = vh.queues.get(key)
            found = [q] if q is not None else []
        else:
            found = vh.route(ex, key, headers_of)
        for q in found:
            if q not in queues:
                queues.append(q)
    if has_exp:
        for q in queues:
            features.ensure(q, vh).msg_ttl_seen = True
    s.store_routed(chs, args, props, body, persistent, queues)
    return True


def publish_exchange_special(s: Session, chs: ChannelState, ex: Exchange, args: PublishArgs,
                             props: bytes, body: bytes, persistent: bool) -> bool:
    """Publish to an exchange with features (``ex.special``); False: take the ordinary path."""
    special = ex.special
    assert special is not None
    consumed, queues = special.on_publish(s.now_ms, args.routing_key, props, body, persistent)
    if consumed:
        # dropped as a duplicate, or held by a delayed exchange (durably when it is durable)
        if special.delayed is not None and special.delayed.durable and chs.confirm:
            chs.needs_sync = True
        return True
    if queues is None:
        return False
    s.store_routed(chs, args, props, body, persistent, queues)
    return True
