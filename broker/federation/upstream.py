"""The ``federation-upstream`` and ``federation-upstream-set`` parameters, in RabbitMQ's JSON.

An upstream names another broker (``uri``: one string or a list tried in turn, ``amqp://`` or
``amqps://`` with a host; a host-less ``amqp://`` or ``amqp:///vhost`` is this broker, reached
in-process through the model, no socket) and how to link to it. A set is a list of
``{"upstream": name, ...overrides}``; the implicit set ``all`` holds every upstream of the vhost.
A policy applies one upstream (``federation-upstream``) or one set (``federation-upstream-set``)
to exchanges and queues.

Validation is strict where RabbitMQ's is loose: an unknown key, a wrong type or a URI that is not
AMQP is refused with a message that names it (the API answers 400), so a typo never becomes a
link that silently does something else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote, urlsplit

UPSTREAM = "federation-upstream"
UPSTREAM_SET = "federation-upstream-set"
ACK_MODES = ("on-confirm", "on-publish", "no-ack")
MAX_URIS = 16
MAX_PREFETCH = 65535  # basic.qos prefetch-count is a short
MAX_RECONNECT_DELAY = 3600  # seconds: an hour between attempts is already "never"
MAX_SET = 64

# key -> (accepted types, check) ; the checks return an error text or None
_INT = (int,)


def _positive(v: Any) -> str | None:
    return None if v >= 1 else "must be at least 1"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must not be negative"


_KEYS: dict[str, tuple[tuple[type, ...], Any]] = {
    "prefetch-count": (_INT, lambda v: None if 1 <= v <= MAX_PREFETCH else f"must be 1 to {MAX_PREFETCH}"),
    "reconnect-delay": ((int, float), lambda v: None if 0 < v <= MAX_RECONNECT_DELAY
                        else f"must be over 0 and at most {MAX_RECONNECT_DELAY} seconds"),
    "ack-mode": ((str,), lambda v: None if v in ACK_MODES else f"must be one of {', '.join(ACK_MODES)}"),
    "trust-user-id": ((bool,), None),
    "exchange": ((str,), None),
    "queue": ((str,), None),
    "max-hops": (_INT, _positive),
    "expires": (_INT, _positive),
    "message-ttl": (_INT, _non_negative),
    "consumer-tag": ((str,), None),
    # RabbitMQ keys with no effect here, accepted so its definitions import unchanged
    "ha-policy": ((str,), None),
    "queue-type": ((str,), lambda v: None if v in ("classic", "quorum") else "must be classic or quorum"),
    "bind-nowait": ((bool,), None),
    "resource-cleanup-mode": ((str,), lambda v: None if v in ("default", "never")
                              else "must be default or never"),
    "channel-use-mode": ((str,), lambda v: None if v in ("multiple", "single")
                         else "must be multiple or single"),
}


@dataclass(frozen=True)
class Upstream:
    """One upstream as a link uses it (defaults are RabbitMQ's)."""

    name: str
    uris: tuple[str, ...]
    prefetch_count: int = 1000
    reconnect_delay: float = 5.0
    ack_mode: str = "on-confirm"
    trust_user_id: bool = False
    exchange: str | None = None
    queue: str | None = None
    max_hops: int = 1
    expires: int | None = None
    message_ttl: int | None = None
    consumer_tag: str | None = None
    queue_type: str = "classic"


def check_uri(uri: Any) -> str:
    """``uri`` if it is an AMQP URI a link can use; ValueError otherwise."""
    if not isinstance(uri, str) or not uri:
        raise ValueError("'uri' must be a non-empty string or a list of them")
    if len(uri) > 4096:
        raise ValueError("'uri' is too long")
    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad URI {scrub(uri)!r}: {exc}") from None
    if parts.scheme not in ("amqp", "amqps") or not uri.lower().startswith(("amqp://", "amqps://")):
        raise ValueError(f"bad URI {scrub(uri)!r}: the scheme must be amqp:// or amqps://")
    if not parts.hostname and (parts.scheme != "amqp" or parts.netloc):
        raise ValueError(f"bad URI {scrub(uri)!r}: it needs a host (or, for this broker in-process, "
                         "none at all: amqp:// or amqp:///vhost)")
    return uri


def scrub(uri: str) -> str:
    """The URI without its password (for status, logs and errors)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable URI>"
    if parts.password is None:
        return uri
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}@{netloc}" if user else netloc).geturl()


def local_vhost(uri: str, own: str) -> str | None:
    """The vhost of this broker a host-less URI names (``own`` when it names none), or None for a
    URI with a host."""
    parts = urlsplit(uri)
    if parts.hostname:
        return None
    return unquote(parts.path[1:]) if len(parts.path) > 1 else own


def _check_keys(value: dict[str, Any], where: str, allowed: dict[str, Any]) -> None:
    for key, v in value.items():
        spec = allowed.get(key)
        if spec is None:
            raise ValueError(f"{where}: unknown key '{key}'")
        types, check = spec
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            raise ValueError(f"{where}: '{key}' has the wrong type ({type(v).__name__})")
        problem = check(v) if check is not None else None
        if problem is not None:
            raise ValueError(f"{where}: '{key}' {problem}")


def check_upstream(value: Any) -> dict[str, Any]:
    """The ``federation-upstream`` value to store; ValueError names what is wrong."""
    if not isinstance(value, dict):
        raise ValueError("a federation upstream must be an object")
    if "uri" not in value:
        raise ValueError("a federation upstream needs a 'uri'")
    uris = value["uri"] if isinstance(value["uri"], list) else [value["uri"]]
    if not uris or len(uris) > MAX_URIS:
        raise ValueError(f"'uri' must name 1 to {MAX_URIS} URIs")
    for uri in uris:
        check_uri(uri)
    _check_keys({k: v for k, v in value.items() if k != "uri"}, "federation upstream", _KEYS)
    return dict(value)


def check_upstream_set(value: Any) -> list[dict[str, Any]]:
    """The ``federation-upstream-set`` value to store; ValueError names what is wrong."""
    if not isinstance(value, list) or not value or len(value) > MAX_SET:
        raise ValueError(f"a federation upstream set must be a list of 1 to {MAX_SET} objects")
    for i, e in enumerate(value):
        if not isinstance(e, dict) or not isinstance(e.get("upstream"), str):
            raise ValueError(f"federation upstream set[{i}]: needs an 'upstream' name")
        _check_keys({k: v for k, v in e.items() if k != "upstream"}, f"federation upstream set[{i}]", _KEYS)
    return list(value)


def make_upstream(name: str, value: dict[str, Any], overrides: dict[str, Any] | None = None) -> Upstream:
    merged = {**value, **(overrides or {})}
    uris = merged["uri"] if isinstance(merged["uri"], list) else [merged["uri"]]
    up = Upstream(name, tuple(uris))
    fields = {k.replace("-", "_"): v for k, v in merged.items() if k in _KEYS}
    known = {f for f in Upstream.__dataclass_fields__}
    return replace(up, **{k: v for k, v in fields.items() if k in known})


def resolve(definition: dict[str, Any], upstreams: dict[str, dict[str, Any]],
            sets: dict[str, list[dict[str, Any]]]) -> tuple[list[Upstream], str | None]:
    """The upstreams a policy definition applies, and the reason when it names one that is
    missing (the link status shows it)."""
    if UPSTREAM in definition:
        name = definition[UPSTREAM]
        if not isinstance(name, str) or name not in upstreams:
            return [], f"no federation upstream {name!r}"
        return [make_upstream(name, upstreams[name])], None
    set_name = definition.get(UPSTREAM_SET)
    if not isinstance(set_name, str):
        return [], None
    if set_name == "all":
        return [make_upstream(n, v) for n, v in sorted(upstreams.items())], None
    members = sets.get(set_name)
    if members is None:
        return [], f"no federation upstream set {set_name!r}"
    out: list[Upstream] = []
    missing: list[str] = []
    for e in members:
        found = upstreams.get(e["upstream"])
        if found is None:
            missing.append(e["upstream"])
        else:
            out.append(make_upstream(e["upstream"], found, {k: v for k, v in e.items() if k != "upstream"}))
    return out, (f"no federation upstream {', '.join(map(repr, missing))}" if missing else None)
