"""MQTT names and properties onto AMQP's, both ways (RabbitMQ's mapping, so both brokers agree).

- Topics: ``/`` and ``.`` swap, ``+`` becomes ``*`` (``#`` stays): ``a/b.c/+`` <-> ``a.b/c.*``.
- QoS: 0 is delivery mode 1, 1 and 2 are delivery mode 2 (persistent); the published QoS travels
  in the header ``x-mqtt-publish-qos``, the retain flag in ``x-mqtt-retain`` (for MQTT 5's
  retain-as-published).
- MQTT 5 properties: content type <-> ``content_type``; correlation data <-> ``correlation_id``
  when it is UTF-8 of at most 255 bytes, else the header ``x-correlation-id`` (bytes); response
  topic <-> ``reply_to`` (as a routing key, so an AMQP responder publishes the reply to
  ``amq.topic`` with it); message expiry (seconds) <-> ``expiration`` (milliseconds); user
  properties <-> headers (the last value of a repeated name wins). ``x-mqtt-*`` headers stay
  internal: they are not sent as user properties.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pamqp import commands

from broker import properties
from broker.mqtt import props as PR
from broker.mqtt.props import Props

QOS_HEADER = "x-mqtt-publish-qos"
RETAIN_HEADER = "x-mqtt-retain"
ORIGIN_HEADER = "x-mqtt-origin"  # the publisher's client id, only for MQTT 5's no-local
CORRELATION_HEADER = "x-correlation-id"

_TO_AMQP = str.maketrans({"/": ".", ".": "/", "+": "*"})
_TO_MQTT = str.maketrans({".": "/", "/": "."})
_TO_FILTER = str.maketrans({".": "/", "/": ".", "*": "+"})


MAX_KEY_BYTES = 255  # an AMQP routing key is a short string: a longer MQTT topic has no routing key


def key_fits(topic: str) -> bool:
    """Whether a topic (or filter) has a routing key: at most ``MAX_KEY_BYTES`` of UTF-8, which
    also bounds its levels (128), so no topic filter compiles to an unbounded pattern."""
    return len(topic.encode()) <= MAX_KEY_BYTES


# Topics translated lately, both ways: a publisher repeats its topics and a subscriber's deliveries
# their routing keys, and ``str.translate`` with a table was 5-7 % of QoS 0 fan-in's time. Bounded:
# short names only, the whole cache dropped when full.
_KEYS: dict[str, str] = {}
_TOPICS: dict[str, str] = {}
_KEYS_MAX = 4096
_KEY_CACHED_LEN = 128


def _translated(name: str, cache: dict[str, str], table: dict[int, str]) -> str:
    out = cache.get(name)
    if out is None:
        out = name.translate(table)
        if len(name) <= _KEY_CACHED_LEN:
            if len(cache) >= _KEYS_MAX:
                cache.clear()
            cache[name] = out
    return out


def to_routing_key(topic: str) -> str:
    """MQTT topic (or filter) to AMQP routing key (or binding key)."""
    return _translated(topic, _KEYS, _TO_AMQP)


def to_topic(routing_key: str) -> str:
    return _translated(routing_key, _TOPICS, _TO_MQTT)


def to_filter(binding_key: str) -> str:
    """A binding key back to the MQTT filter it was made from."""
    return binding_key.translate(_TO_FILTER)


# Most MQTT publishes carry no MQTT 5 properties: their AMQP property list depends only on the
# QoS, the retain flag and (no-local) the publisher's client id, so it is encoded once per shape
# and reused, not built by pamqp per message. Likewise a delivery reads a stored property list of
# one of those few shapes: what it needs of it is read once per distinct list. Both caches are
# bounded (``SHAPES``); a message with MQTT 5 properties is encoded and read each time.
SHAPES = 1024


def amqp_props(qos: int, retain: bool, mqtt: Props | None = None, origin: str | None = None) -> bytes:
    """The AMQP property list of a message an MQTT client published."""
    if not mqtt:
        return _plain_props(qos, retain, origin)
    return _encode_props(qos, retain, mqtt, origin)


@lru_cache(maxsize=SHAPES)
def _plain_props(qos: int, retain: bool, origin: str | None) -> bytes:
    return _encode_props(qos, retain, None, origin)


def _encode_props(qos: int, retain: bool, mqtt: Props | None, origin: str | None) -> bytes:
    headers: dict[str, Any] = {QOS_HEADER: qos}
    if retain:
        headers[RETAIN_HEADER] = True
    if origin is not None:
        headers[ORIGIN_HEADER] = origin
    p = commands.Basic.Properties(delivery_mode=2 if qos else 1)
    if mqtt:
        for k, v in mqtt.get(PR.USER_PROPERTY, ()):
            if not k.startswith("x-mqtt-"):
                headers[k] = v
        if PR.CONTENT_TYPE in mqtt:
            p.content_type = mqtt[PR.CONTENT_TYPE][:255]
        if PR.RESPONSE_TOPIC in mqtt:
            p.reply_to = to_routing_key(mqtt[PR.RESPONSE_TOPIC])[:255]
        if PR.CORRELATION_DATA in mqtt:
            data = mqtt[PR.CORRELATION_DATA]
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None and len(data) <= 255:
                p.correlation_id = text
            else:
                headers[CORRELATION_HEADER] = bytearray(data)  # pamqp writes bytearray as a byte array
        if PR.MESSAGE_EXPIRY in mqtt:
            p.expiration = str(mqtt[PR.MESSAGE_EXPIRY] * 1000)
    p.headers = headers
    return properties.encode(p)


def delivered(raw: bytes, v5: bool) -> Delivered:
    """What a delivery needs of ``raw`` (shared: not to be changed); read once per distinct
    short property list (``SHAPES``), each time for a long one (MQTT 5 user properties...)."""
    if len(raw) <= _SHAPE_BYTES:
        return _delivered(bytes(raw), v5)
    return Delivered(raw, v5)


_SHAPE_BYTES = 128  # a property list longer than this is not kept


class Delivered:
    """What a delivery needs of a stored message's AMQP properties, read once."""

    __slots__ = ("qos", "retain", "origin", "props")

    def __init__(self, raw: bytes, v5: bool) -> None:
        headers = properties.headers(raw) if raw else {}
        q = headers.get(QOS_HEADER)
        self.qos = q if isinstance(q, int) and 0 <= q <= 2 else (
            1 if raw and properties.delivery_mode(raw) == 2 else 0)
        self.retain = headers.get(RETAIN_HEADER) is True
        origin = headers.get(ORIGIN_HEADER)
        self.origin = origin.decode(errors="replace") if isinstance(origin, bytes) else origin
        self.props: Props = _mqtt_props(raw, headers) if v5 and raw else {}


@lru_cache(maxsize=SHAPES)
def _delivered(raw: bytes, v5: bool) -> Delivered:
    return Delivered(raw, v5)


def _mqtt_props(raw: bytes, headers: dict[str, Any]) -> Props:
    p = properties.decode(raw)
    out: Props = {}
    if p.content_type:
        out[PR.CONTENT_TYPE] = p.content_type
    if p.reply_to:
        out[PR.RESPONSE_TOPIC] = to_topic(p.reply_to)
    corr = headers.get(CORRELATION_HEADER)
    if isinstance(corr, bytes | bytearray):
        out[PR.CORRELATION_DATA] = bytes(corr)
    elif p.correlation_id:
        out[PR.CORRELATION_DATA] = p.correlation_id.encode()
    if p.expiration and p.expiration.isdigit():
        out[PR.MESSAGE_EXPIRY] = max(1, -(-int(p.expiration) // 1000))
    users = [(_text(k), _text(v)) for k, v in headers.items()
             if not k.startswith("x-mqtt-") and k != CORRELATION_HEADER]
    if users:
        out[PR.USER_PROPERTY] = users
    return out


def _text(v: Any) -> str:
    """A header value as an MQTT string (which may not hold U+0000)."""
    if isinstance(v, bytes | bytearray):
        s = bytes(v).decode("utf-8", errors="replace")
    elif isinstance(v, bool):
        s = "true" if v else "false"
    else:
        s = str(v)
    return s.replace("\x00", "\ufffd")
