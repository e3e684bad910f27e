"""Firehose tracing (RabbitMQ's ``rabbitmqctl trace_on``): a copy of every publish and delivery.

Theory of operation
-------------------
Tracing is a vhost's switch (``VHostMeta.tracing``, in its ``metadata.json``, replicated; set by
``PUT /api/vhosts/{vhost}`` with ``"tracing": true`` and ``skredctl trace_on``), off by default.
While it is on, every message a client publishes in that vhost, through any front end (AMQP,
MQTT, the management API's publish, LMQ), is copied to the vhost's ``amq.rabbitmq.trace``
exchange (topic, internal) with the routing key ``publish.<exchange>``, and every message a
client is given (basic.deliver, basic.get-ok, an MQTT PUBLISH, the management API's get, an LMQ
take) with ``deliver.<queue>``. The copy is the message body with RabbitMQ's headers:
``exchange_name``, ``routing_keys``, ``properties`` (the original's, as a table), ``node``,
``vhost``, ``channel``, ``user``, ``connection``, and ``routed_queues`` (publish) or
``redelivered`` (deliver). It goes through the model's one publish operation like any message.

Where it happens: publishes in the publish operation itself (``VHost.publish``), for every
request that names its ``Origin`` (``publish_api.Origin``: node, user, connection, channel),
which each front end hands in with a client's publish; the broker's own publishes (dead-lettering,
delayed firing, wills, these copies) name none and are never traced, so a queue bound to the
trace exchange with ``#`` does not feed itself. Deliveries: each front end calls ``delivered``
where it hands a message to its client, behind ``vh.meta.tracing``.

Cost when off: one read of ``vh.meta.tracing`` per publish the operation handles alone (the
AMQP session also reads it once per publish run or batch: a traced vhost publishes them one by
one) and once per delivery call; nothing else knows tracing exists (``benchmarks/trace_cost.py``).
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from pamqp import commands

from broker import properties
from broker.model.publish_api import Origin, PublishOutcome, PublishRequest

__all__ = ["TRACE_EXCHANGE", "Origin", "Target", "published", "delivered", "delivered_exrk"]

TRACE_EXCHANGE: Final = "amq.rabbitmq.trace"
_TRACE_EXCHANGE_B: Final = TRACE_EXCHANGE.encode()

_FIELDS: Final = ("content_type", "content_encoding", "headers", "delivery_mode", "priority",
                  "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
                  "message_type", "user_id", "app_id", "cluster_id")
# AMQP's names where pamqp's differ (RabbitMQ's trace table uses the spec's: ``type``)
_AMQP_NAME: Final = {"message_type": "type"}


class Target(Protocol):
    """What a trace copy is published into: the vhost."""

    @property
    def name(self) -> str: ...

    def publish(self, req: PublishRequest) -> PublishOutcome: ...


def _properties_table(props: bytes) -> dict[str, Any]:
    try:
        p = properties.decode(props)
    except Exception:  # validated on the way in; a copy is never worth an error
        return {}
    out: dict[str, Any] = {}
    for field in _FIELDS:
        value = getattr(p, field, None)
        if value is not None:
            out[_AMQP_NAME.get(field, field)] = value
    return out


def _send(vh: Target, routing_key: str, headers: dict[str, Any], body: bytes | memoryview,
          ts: int) -> None:
    props = properties.encode(commands.Basic.Properties(headers=headers))
    vh.publish(PublishRequest(TRACE_EXCHANGE, routing_key, props, bytes(body), ts, persistent=False))


def _who(vh: Target, who: Origin) -> dict[str, Any]:
    return {"node": who.node, "vhost": vh.name, "channel": who.channel, "user": who.user,
            "connection": who.connection}


def published(vh: Target, req: PublishRequest, who: Origin, out: PublishOutcome) -> None:
    """The ``publish.<exchange>`` copy of a message a client published (``req``), which
    reached ``out.queues``."""
    exchange = req.exchange
    if exchange == TRACE_EXCHANGE:
        return
    _send(vh, f"publish.{exchange}", {
        "exchange_name": exchange, "routing_keys": [req.routing_key],
        "properties": _properties_table(req.props), **_who(vh, who),
        "routed_queues": [q.name for q in out.queues],
    }, req.body, req.ts)


def delivered(vh: Target, who: Origin, queue: str, exchange: bytes, routing_key: bytes, props: bytes,
              body: bytes | memoryview, redelivered: bool, ts: int) -> None:
    """The ``deliver.<queue>`` copy of a message handed to a client (``exchange`` and
    ``routing_key`` as the store keeps them)."""
    if exchange == _TRACE_EXCHANGE_B:
        return
    _send(vh, f"deliver.{queue}", {
        "exchange_name": exchange.decode(errors="replace"),
        "routing_keys": [routing_key.decode(errors="replace")],
        "properties": _properties_table(props), **_who(vh, who), "redelivered": int(redelivered),
    }, body, ts)


def delivered_exrk(vh: Target, who: Origin, queue: str, exrk: bytes, props: bytes,
                   body: bytes | memoryview, redelivered: bool, ts: int) -> None:
    """``delivered`` with the exchange and routing key as the two short strings a stored record
    and basic.deliver carry them."""
    n = exrk[0]
    delivered(vh, who, queue, exrk[1:1 + n], exrk[2 + n:], props, body, redelivered, ts)
