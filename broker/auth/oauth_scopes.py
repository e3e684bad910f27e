"""Permissions from an OAuth 2 access token's scopes, in RabbitMQ's scope format.

Theory of operation
-------------------
A token carries scopes (the ``scope`` claim: a space-separated string or a list, plus an
optional extra claim). Those that start with the scope prefix (default
``<resource_server_id>.``) grant, as RabbitMQ's OAuth 2 backend reads them:

=========================================  ==============================================
scope (after the prefix)                   grant
=========================================  ==============================================
``configure:<vhost>/<name>``               configure on resources ``<name>`` of ``<vhost>``
``write:<vhost>/<name>[/<routing key>]``   write (publish, bind to); the routing key part
                                           restricts topic exchanges (topic permission)
``read:<vhost>/<name>[/<routing key>]``    read (consume, get, bind from)
``tag:<tag>``                              the user tag ``<tag>`` (``administrator``, ...)
=========================================  ==============================================

Each part is a wildcard pattern (``*`` is any run of characters, everything else literal,
matched against the whole name) and is percent-decoded after the split on ``/``, so the
default vhost is written ``%2F``. Scopes without the prefix, and malformed ones, grant
nothing. A wildcard with a ``*`` inside is an anchored RE2 expression, compiled once per
pattern text (``broker.patterns``: linear time whatever the client sent); ``*`` alone and
literals are compared directly. A token holds at most ``MAX_SCOPES`` scopes.

``ScopeGrants`` answers the questions ``UserStore`` asks of a user's permissions, so a
token's user is checked on every path an internal user is (``broker.auth.users``).
"""

from __future__ import annotations

import functools
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from broker.patterns import compile_pattern

ACTIONS = ("configure", "write", "read")
MAX_SCOPES = 256  # far beyond a real token's; bounds the work one login costs
MAX_SCOPE_LENGTH = 1024


class Wildcard(Protocol):
    def fullmatch(self, text: str) -> bool: ...


@dataclass(frozen=True)
class _Literal:
    """A part without ``*``: the name itself."""

    text: str

    def fullmatch(self, text: str) -> bool:
        return text == self.text


class _Anything:
    """``*``: every name."""

    def fullmatch(self, text: str) -> bool:
        return True


_ANYTHING = _Anything()


def wildcard(pattern: str) -> Wildcard:
    """RabbitMQ's scope wildcard: ``*`` any run, the rest literal, matched against the whole
    name. ``*`` alone and literals need no regex; the rest become anchored RE2 patterns."""
    if pattern == "*":
        return _ANYTHING
    if "*" not in pattern:
        return _Literal(pattern)
    return compile_pattern("^" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$")


@dataclass(frozen=True)
class ScopeGrant:
    """One resource scope: an action on names matching ``name`` in vhosts matching ``vhost``."""

    action: str
    vhost: Wildcard
    name: Wildcard
    routing_key: Wildcard | None  # None: any routing key (no third part)
    text: str

    def covers(self, vhost: str, name: str) -> bool:
        return self.vhost.fullmatch(vhost) and self.name.fullmatch(name)


@dataclass(frozen=True)
class ScopeGrants:
    """What a token's scopes grant (``parse_scopes``)."""

    grants: tuple[ScopeGrant, ...]
    tags: tuple[str, ...]

    def vhost_access(self, vhost: str) -> bool:
        return any(g.vhost.fullmatch(vhost) for g in self.grants)

    def allows(self, action: str, vhost: str, name: str) -> bool:
        return any(g.action == action and g.covers(vhost, name) for g in self.grants)

    def has_topic_patterns(self, vhost: str, exchange: str) -> bool:
        return any(g.routing_key is not None and g.covers(vhost, exchange) for g in self.grants)

    def topic_allows(self, action: str, vhost: str, exchange: str, routing_key: str) -> bool:
        """A scope of ``action`` on the exchange whose routing-key part (if any) matches."""
        return any(g.action == action and g.covers(vhost, exchange)
                   and (g.routing_key is None or g.routing_key.fullmatch(routing_key))
                   for g in self.grants)


def scope_list(value: object) -> list[str]:
    """Scopes from a claim: a space-separated string or a list of strings (else none)."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [s for item in value if isinstance(item, str) for s in item.split()]
    return []


def parse_scopes(scopes: Iterable[str], prefix: str) -> ScopeGrants:
    """The grants of ``scopes`` that start with ``prefix``; the others are ignored. ValueError
    when a token carries more than ``MAX_SCOPES`` or a scope longer than ``MAX_SCOPE_LENGTH``."""
    grants: list[ScopeGrant] = []
    tags: list[str] = []
    for count, scope in enumerate(scopes, 1):
        if count > MAX_SCOPES or len(scope) > MAX_SCOPE_LENGTH:
            raise ValueError(f"too many or too long scopes (at most {MAX_SCOPES} of {MAX_SCOPE_LENGTH})")
        grant = _scope(scope, prefix)
        if isinstance(grant, ScopeGrant):
            grants.append(grant)
        elif grant and grant not in tags:
            tags.append(grant)
    return ScopeGrants(tuple(grants), tuple(tags))


@functools.lru_cache(maxsize=4096)
def _scope(scope: str, prefix: str) -> ScopeGrant | str:
    """One scope read: a resource grant, a tag, or "" (not ours, unknown or malformed). Tokens
    of one provider repeat their scopes: each is read once (remembered, bounded)."""
    if not scope.startswith(prefix):
        return ""
    kind, sep, rest = scope[len(prefix):].partition(":")
    if not sep:
        return ""
    if kind == "tag":
        return rest
    if kind not in ACTIONS:
        return ""
    parts = [urllib.parse.unquote(p) for p in rest.split("/")]
    if len(parts) == 2 or (len(parts) == 3 and kind != "configure"):
        routing_key = wildcard(parts[2]) if len(parts) == 3 else None
        return ScopeGrant(kind, wildcard(parts[0]), wildcard(parts[1]), routing_key, scope)
    return ""
