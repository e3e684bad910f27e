"""Firehose tracing (RabbitMQ's ``rabbitmqctl trace_on``): a copy of every publish and delivery.

Theory of operation
-------------------
Tracing is a vhost's switch (``VHostMeta.tracing``, in its ``metadata.json``, replicated; set by
``PUT /api/vhosts/{vhost}`` with ``"tracing": true`` and ``skredctl trace_on``), off by default.
While it is on, the AMQP session sends, for every message a client publishes on a channel in
that vhost, a copy to the vhost's ``amq.rabbitmq.trace`` exchange (topic, internal) with the
routing key ``publish.<exchange>``, and for every message it delivers (basic.deliver or
basic.get-ok) one with ``deliver.<queue>``. The copy is the message body with RabbitMQ's
headers: ``exchange_name``, ``routing_keys``, ``properties`` (the original's, as a table),
``node``, ``vhost``, ``channel``, ``user``, ``connection``, and ``routed_queues`` (publish) or
``redelivered`` (deliver). It goes through the model's one publish operation like any message;
a message published to or delivered from the trace exchange itself is never traced, so a queue
bound to it with ``#`` does not feed itself.

Cost when off: the session reads ``vh.meta.tracing`` once per publish it handles alone and once
per publish run or batch (a traced vhost publishes them one by one), once per delivery call;
nothing else on the publish path knows tracing exists (``benchmarks/trace_cost.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from pamqp import commands

from broker import properties
from broker.model.publish import PublishRequest
from broker.model.vhost import TRACE_EXCHANGE

if TYPE_CHECKING:
    from broker.model.queue import Queue
    from broker.model.vhost import VHost

_FIELDS: Final = ("content_type", "content_encoding", "headers", "delivery_mode", "priority",
                  "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
                  "message_type", "user_id", "app_id", "cluster_id")
# AMQP's names where pamqp's differ (RabbitMQ's trace table uses the spec's: ``type``)
_AMQP_NAME: Final = {"message_type": "type"}


class Origin:
    """Who a traced message came from or went to: what every trace copy's headers name."""

    __slots__ = ("node", "user", "connection", "channel")

    def __init__(self, node: str, user: str, connection: str, channel: int) -> None:
        self.node = node
        self.user = user
        self.connection = connection
        self.channel = channel


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


def _send(vh: VHost, routing_key: str, headers: dict[str, Any], body: bytes | memoryview,
          ts: int) -> None:
    props = properties.encode(commands.Basic.Properties(headers=headers))
    vh.publish(PublishRequest(TRACE_EXCHANGE, routing_key, props, bytes(body), ts, persistent=False))


def published(vh: VHost, who: Origin, exchange: str, routing_keys: list[str], props: bytes,
              body: bytes | memoryview, queues: list[Queue], ts: int) -> None:
    """The ``publish.<exchange>`` copy of a message a client published."""
    if exchange == TRACE_EXCHANGE:
        return
    _send(vh, f"publish.{exchange}", {
        "exchange_name": exchange, "routing_keys": routing_keys, "properties": _properties_table(props),
        "node": who.node, "vhost": vh.name, "channel": who.channel, "user": who.user,
        "connection": who.connection, "routed_queues": [q.name for q in queues],
    }, body, ts)


def delivered(vh: VHost, who: Origin, queue: str, exrk: bytes, props: bytes, body: bytes | memoryview,
              redelivered: bool, ts: int) -> None:
    """The ``deliver.<queue>`` copy of a delivery (``exrk``: exchange and routing key as the two
    short strings a stored record carries)."""
    n = exrk[0]
    exchange = exrk[1:1 + n].decode(errors="replace")
    if exchange == TRACE_EXCHANGE:
        return
    _send(vh, f"deliver.{queue}", {
        "exchange_name": exchange, "routing_keys": [exrk[2 + n:].decode(errors="replace")],
        "properties": _properties_table(props), "node": who.node, "vhost": vh.name,
        "channel": who.channel, "user": who.user, "connection": who.connection,
        "redelivered": int(redelivered),
    }, body, ts)
