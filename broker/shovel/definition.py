"""A shovel parameter's value, validated: RabbitMQ's JSON shape, LavinMQ's HTTP destination.

Every key RabbitMQ 3.10's dynamic shovel takes is known here; an unknown key, a missing end, a
URI that cannot be parsed or names a scheme an end does not speak, a value of the wrong type:
each is a ``ValueError`` whose text names the key, which the API answers with 400. Whether a
host answers or a password is right is only known when the shovel runs: that is a
``terminated`` status with the reason, retried after ``reconnect-delay``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from broker.links.wire import redact

DEFAULT_PREFETCH = 1000  # RabbitMQ's src-prefetch-count default
MAX_PREFETCH = 65535  # in-flight messages per shovel: the bound on what it holds in memory
DEFAULT_RECONNECT_DELAY = 5.0  # seconds; RabbitMQ's default for dynamic shovels
MAX_RECONNECT_DELAY = 3600.0
ACK_MODES = ("on-confirm", "on-publish", "no-ack")
PROTOCOLS = ("amqp091",)

_KEYS = {
    "src-uri", "src-protocol", "src-queue", "src-queue-args", "src-exchange", "src-exchange-key",
    "src-prefetch-count", "src-delete-after", "src-consumer-args",
    "dest-uri", "dest-protocol", "dest-queue", "dest-queue-args", "dest-exchange", "dest-exchange-key",
    "dest-add-forward-headers", "dest-add-timestamp-header", "dest-publish-properties",
    "ack-mode", "reconnect-delay",
    # RabbitMQ's older spellings, still accepted by its plugin
    "delete-after", "prefetch-count", "add-forward-headers", "publish-properties",
}
_ALIASES = {"delete-after": "src-delete-after", "prefetch-count": "src-prefetch-count",
            "add-forward-headers": "dest-add-forward-headers",
            "publish-properties": "dest-publish-properties"}
_PUBLISH_PROPERTIES = {
    "content_type", "content_encoding", "headers", "delivery_mode", "priority", "correlation_id",
    "reply_to", "expiration", "message_id", "timestamp", "type", "user_id", "app_id", "cluster_id",
}


@dataclass(frozen=True)
class Uri:
    """One end's address. ``local``: this broker (a host-less ``amqp://``), no socket."""

    text: str
    scheme: str
    local: bool
    vhost: str

    @property
    def http(self) -> bool:
        return self.scheme in ("http", "https")

    def redacted(self) -> str:
        """The URI without its password, for the status and the logs."""
        return redact(self.text)


@dataclass(frozen=True)
class ShovelDef:
    vhost: str
    name: str
    src_uris: tuple[Uri, ...]
    dest_uris: tuple[Uri, ...]
    src_queue: str | None = None
    src_exchange: str | None = None
    src_exchange_key: str = "#"
    src_queue_args: dict[str, Any] = field(default_factory=dict)
    src_prefetch: int = DEFAULT_PREFETCH
    delete_after: str | int = "never"  # "never", "queue-length" or a count
    consumer_args: dict[str, Any] = field(default_factory=dict)
    dest_queue: str | None = None
    dest_queue_args: dict[str, Any] = field(default_factory=dict)
    dest_exchange: str | None = None
    dest_exchange_key: str | None = None
    forward_headers: bool = False
    timestamp_header: bool = False
    publish_properties: dict[str, Any] = field(default_factory=dict)
    ack_mode: str = "on-confirm"
    reconnect_delay: float = DEFAULT_RECONNECT_DELAY

    def destination(self, exchange: str, routing_key: str) -> tuple[str, str]:
        """Where a message that came from (``exchange``, ``routing_key``) is published: the
        destination queue through the default exchange, the destination exchange with its key (or
        the message's own), or else the exchange and key it had."""
        if self.dest_queue is not None:
            return "", self.dest_queue
        if self.dest_exchange is not None:
            return self.dest_exchange, self.dest_exchange_key if self.dest_exchange_key is not None \
                else routing_key
        return exchange, routing_key


def parse_uri(text: Any, key: str, http_ok: bool) -> Uri:
    if not isinstance(text, str) or not text:
        raise ValueError(f"'{key}' must be a non-empty URI string")
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError as exc:
        raise ValueError(f"'{key}': bad URI {text!r}: {exc}") from None
    schemes = ("amqp", "amqps", "http", "https") if http_ok else ("amqp", "amqps")
    if parts.scheme not in schemes:
        raise ValueError(f"'{key}': URI scheme of {text!r} must be one of {', '.join(schemes)}")
    if parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise ValueError(f"'{key}': an HTTP destination needs a host: {text!r}")
        return Uri(text, parts.scheme, False, "")
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if "/" in path:
        raise ValueError(f"'{key}': the vhost in {text!r} must be one path segment (%2F for '/')")
    vhost = unquote(path) if path else "/"
    local = not parts.netloc
    if local and parts.scheme != "amqp":
        raise ValueError(f"'{key}': this broker itself is 'amqp://' (no host), not {text!r}")
    return Uri(text, parts.scheme, local, vhost)


def _uris(value: Any, key: str, http_ok: bool) -> tuple[Uri, ...]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError(f"'{key}' must name at least one URI")
    uris = tuple(parse_uri(v, key, http_ok) for v in items)
    if any(u.http for u in uris) and len(uris) > 1:
        raise ValueError(f"'{key}': an HTTP destination is one URI")
    return uris


def _str(v: dict[str, Any], key: str) -> str | None:
    value = v.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string")
    return value


def _table(v: dict[str, Any], key: str) -> dict[str, Any]:
    value = v.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"'{key}' must be an object")
    return dict(value)


def _bool(v: dict[str, Any], key: str) -> bool:
    value = v.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"'{key}' must be true or false")
    return value


def _int(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"'{key}' must be an integer from {low} to {high}")
    return value


def parse(vhost: str, name: str, value: Any) -> ShovelDef:
    """The shovel ``value`` describes, or ValueError naming the first problem."""
    if not isinstance(value, dict):
        raise ValueError("a shovel's value must be a JSON object")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"unknown shovel parameter key(s): {', '.join(unknown)}")
    v: dict[str, Any] = {_ALIASES.get(str(k), str(k)): x for k, x in value.items()}
    for key in ("src-protocol", "dest-protocol"):
        if v.get(key, "amqp091") not in PROTOCOLS:
            raise ValueError(f"'{key}' must be 'amqp091' (AMQP 1.0 is not supported)")
    if "src-uri" not in v or "dest-uri" not in v:
        raise ValueError("a shovel needs 'src-uri' and 'dest-uri'")
    src_uris, dest_uris = _uris(v["src-uri"], "src-uri", False), _uris(v["dest-uri"], "dest-uri", True)
    src_queue, src_exchange = _str(v, "src-queue"), _str(v, "src-exchange")
    if (src_queue is None) == (src_exchange is None):
        raise ValueError("a shovel needs exactly one of 'src-queue' and 'src-exchange'")
    if _str(v, "src-exchange-key") is not None and src_exchange is None:
        raise ValueError("'src-exchange-key' needs 'src-exchange'")
    dest_queue, dest_exchange = _str(v, "dest-queue"), _str(v, "dest-exchange")
    if dest_queue is not None and dest_exchange is not None:
        raise ValueError("a shovel takes at most one of 'dest-queue' and 'dest-exchange'")
    if _str(v, "dest-exchange-key") is not None and dest_exchange is None:
        raise ValueError("'dest-exchange-key' needs 'dest-exchange'")
    delete_after: str | int = v.get("src-delete-after", "never")
    if delete_after not in ("never", "queue-length"):
        delete_after = _int(delete_after, "src-delete-after", 1, 2**62)
    if delete_after == "queue-length" and src_queue is None:
        raise ValueError("'src-delete-after' 'queue-length' needs 'src-queue'")
    ack_mode = v.get("ack-mode", "on-confirm")
    if ack_mode not in ACK_MODES:
        raise ValueError(f"'ack-mode' must be one of {', '.join(ACK_MODES)}")
    delay = v.get("reconnect-delay", DEFAULT_RECONNECT_DELAY)
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= MAX_RECONNECT_DELAY:
        raise ValueError(f"'reconnect-delay' must be a number of seconds from 0 to {MAX_RECONNECT_DELAY:g}")
    props = _table(v, "dest-publish-properties")
    bad = sorted(set(props) - _PUBLISH_PROPERTIES)
    if bad:
        raise ValueError(f"'dest-publish-properties': unknown properties {', '.join(bad)}")
    if any(u.http for u in dest_uris) and (dest_queue or dest_exchange):
        raise ValueError("an HTTP destination takes no 'dest-queue' or 'dest-exchange'")
    return ShovelDef(
        vhost=vhost, name=name, src_uris=src_uris, dest_uris=dest_uris,
        src_queue=src_queue, src_exchange=src_exchange,
        src_exchange_key=(_str(v, "src-exchange-key") or "#") if src_exchange is not None else "",
        src_queue_args=_table(v, "src-queue-args"),
        src_prefetch=_int(v.get("src-prefetch-count", DEFAULT_PREFETCH), "src-prefetch-count", 1,
                          MAX_PREFETCH),
        delete_after=delete_after, consumer_args=_table(v, "src-consumer-args"),
        dest_queue=dest_queue, dest_queue_args=_table(v, "dest-queue-args"),
        dest_exchange=dest_exchange, dest_exchange_key=_str(v, "dest-exchange-key"),
        forward_headers=_bool(v, "dest-add-forward-headers"),
        timestamp_header=_bool(v, "dest-add-timestamp-header"),
        publish_properties=props, ack_mode=ack_mode, reconnect_delay=float(delay),
    )


def validate(vhost: str, name: str, value: Any) -> Any:
    """The parameters store's validator: the value is kept as given once it parses."""
    parse(vhost, name, value)
    return value
