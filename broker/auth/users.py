"""Users, tags and per-vhost permissions, persisted in ``users.json``.

Theory of operation
-------------------
The store keeps every user in memory as an immutable ``User``; each change
builds a new ``User``, replaces it in the table and rewrites the whole file
through ``broker.store.jsonstore.write_json`` (atomic replace, and handed to the
replication sink so followers get the same file). The file is small and changes
rarely, so rewriting it whole is simpler than a log and never half-applied.

The file mirrors the ``users`` (with their ``limits``), ``permissions`` and
``topic_permissions`` lists of a RabbitMQ definitions export, so definitions
move between the two brokers unchanged.
When no file exists (first start) the default user from the config is created
with the ``administrator`` tag and ``.*`` permissions on vhost ``/``.

Permissions follow RabbitMQ's model: per user and vhost, three regular
expressions (configure, write, read) matched against a resource name. Here the
pattern may match anywhere in the name (anchor it with ``^...$``), as in RabbitMQ. Each pattern
is compiled once, when the permission is set or loaded, with RE2 (``broker.patterns``: linear
time, no backreferences or lookaround). The default exchange ``""`` is checked under
the name ``amq.default``, as RabbitMQ does, so a pattern of ``""`` grants
nothing. Topic permissions (per user, vhost and exchange) restrict routing keys on topic
exchanges on top of that (``TopicPermission``, on RE2 too), and user limits cap a user's
connections and channels; every change is announced to ``on_change`` listeners so that open
connections drop the checks they remembered. Users in ``loopback_users`` (``guest`` by
default, as in RabbitMQ) may log in only from a loopback address.

Logins walk ``backends`` in order (``[main] auth_backends``): ``internal`` is this table,
``oauth`` an access token (``broker.auth.oauth``), whose user is not in the table but carries
its own grants (``User.grants``) and expiry: the checks below answer from those for such a
user, and treat it as unknown once it has expired.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from broker.auth.names import check_name
from broker.auth.passwords import HASHING_ALGORITHM, check_password, hash_password
from broker.auth.throttle import LoginThrottle, login_key
from broker.errors import StoreError
from broker.patterns import Pattern, PatternError, compile_pattern
from broker.store.jsonstore import read_json, write_json
from broker.store.sink import ReplicationSink

if TYPE_CHECKING:
    from broker.auth.oauth_scopes import ScopeGrants

log = logging.getLogger(__name__)

FILE_NAME = "users.json"
FILE_VERSION = 1
KNOWN_TAGS = ("administrator", "monitoring", "management", "policymaker", "impersonator")
DEFAULT_VHOST = "/"
LOOPBACK_USERS = ("guest",)
USER_LIMITS = ("max-connections", "max-channels")  # RabbitMQ's per-user limits
# Compared against when the user does not exist, so a miss costs the same time as a hit.
_DUMMY_HASH = hash_password("", b"\x00\x00\x00\x00")


_NOTHING = "[^\\s\\S]"  # a pattern that matches no name


def _compile(kind: str, pattern: str) -> Pattern:
    try:
        return compile_pattern(pattern)
    except PatternError as exc:
        raise ValueError(f"invalid {kind} regex: {exc}") from None


@dataclass(frozen=True)
class Permission:
    """Three regexes for one user on one vhost; compiled once on construction."""

    configure: str
    write: str
    read: str
    _configure_re: Pattern = field(init=False, repr=False, compare=False)
    _write_re: Pattern = field(init=False, repr=False, compare=False)
    _read_re: Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Frozen dataclass: the cached compiled patterns are set through object.__setattr__.
        object.__setattr__(self, "_configure_re", _compile("configure", self.configure))
        object.__setattr__(self, "_write_re", _compile("write", self.write))
        object.__setattr__(self, "_read_re", _compile("read", self.read))

    @classmethod
    def loaded(cls, configure: str, write: str, read: str, where: str) -> Permission:
        """A permission read from users.json: one whose regexes RE2 cannot run (a lookaround set
        before patterns moved to RE2) keeps its text but grants nothing, logged; never a crash."""
        try:
            return cls(configure, write, read)
        except ValueError as exc:
            log.error("%s: permission grants nothing until it is set again: %s", where, exc)
            perm = cls(_NOTHING, _NOTHING, _NOTHING)
            for key, value in (("configure", configure), ("write", write), ("read", read)):
                object.__setattr__(perm, key, value)
            return perm

    def allows(self, action: str, resource: str) -> bool:
        pattern = {"configure": self._configure_re, "write": self._write_re, "read": self._read_re}[action]
        # RabbitMQ semantics: an empty pattern grants nothing; otherwise the regex may match
        # anywhere in the name (anchor it with ^...$ to match whole names).
        if not pattern.pattern or not getattr(self, action):
            return False
        return pattern.search(resource or "amq.default")


FULL_ACCESS = Permission(".*", ".*", ".*")


@dataclass(frozen=True)
class TopicPermission:
    """RabbitMQ's topic authorisation for one user, vhost and topic exchange: a publish's routing
    key must match ``write``, a binding's key ``read`` (on top of the exchange's permissions).
    As RabbitMQ: the pattern may match anywhere in the key, an empty pattern is ``^$``, and
    ``{username}`` and ``{vhost}`` are replaced before matching (unescaped, as RabbitMQ does)."""

    write: str
    read: str

    def __post_init__(self) -> None:
        _compile("topic write", self.write)  # refuse a bad pattern when it is set or loaded
        _compile("topic read", self.read)

    def allows(self, action: str, routing_key: str, username: str, vhost: str) -> bool:
        pattern = (self.write if action == "write" else self.read) or "^$"
        if "{" in pattern:
            pattern = pattern.replace("{username}", username).replace("{vhost}", vhost)
        try:
            return _compile_cached(pattern).search(routing_key)
        except ValueError:  # a substituted name made the pattern invalid: refuse
            return False


@functools.lru_cache(maxsize=1024)
def _compile_cached(pattern: str) -> Pattern:
    return _compile("topic", pattern)


@dataclass(frozen=True)
class User:
    name: str
    password_hash: str
    tags: tuple[str, ...] = ()
    permissions: Mapping[str, Permission] = field(default_factory=dict)
    hashing_algorithm: str = HASHING_ALGORITHM
    # (vhost, exchange) -> topic permission; RabbitMQ's per-user limits (max-connections, ...)
    topic_permissions: Mapping[tuple[str, str], TopicPermission] = field(default_factory=dict)
    limits: Mapping[str, int] = field(default_factory=dict)
    # a token's user (broker.auth.oauth): what its scopes grant, and when it expires (time.time())
    grants: ScopeGrants | None = field(default=None, compare=False)
    expires_at: float | None = None

    @property
    def is_administrator(self) -> bool:
        return "administrator" in self.tags

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at


class Fetch(Awaitable[None], Protocol):
    """A fetch under way (an asyncio future): awaited by the asyncio front ends, or told to call
    back by the sans-IO AMQP session."""

    def add_done_callback(self, fn: Callable[[Any], object], /) -> None: ...


class TokenBackend(Protocol):
    """What the user store asks of the ``oauth`` backend (``broker.auth.oauth.TokenAuth``)."""

    def user(self, secret: str) -> User:
        """The token's user; ValueError (its reason, for the log) when refused."""

    def pending(self, secret: str) -> Fetch | None:
        """What to await before ``user(secret)`` (a fetch of the issuer's keys), or None."""


BACKENDS = ("internal", "oauth")


def _normalise_tags(tags: Iterable[str]) -> tuple[str, ...]:
    result: list[str] = []
    for tag in tags:
        tag = tag.strip()
        if not tag or "," in tag:
            raise ValueError(f"invalid tag {tag!r}")
        if tag not in result:
            result.append(tag)
    return tuple(result)


UNIX_PEER = "unix"  # the peer address of a client on a Unix socket (local by nature)


def is_loopback(peer_ip: str) -> bool:
    """True for 127.0.0.0/8, ::1, IPv4-mapped loopback (``::ffff:127.0.0.1``) and a Unix socket."""
    if peer_ip == UNIX_PEER:
        return True
    try:
        address = ipaddress.ip_address(peer_ip.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


class UserStore:
    """The user table of one node, backed by ``path`` (normally ``<data_dir>/users.json``)."""

    def __init__(
        self,
        path: Path,
        sink: ReplicationSink,
        default_user: str = "guest",
        default_password: str = "guest",
        loopback_users: Iterable[str] = LOOPBACK_USERS,
        throttle: LoginThrottle | None = None,
    ) -> None:
        self._path = path
        self._sink = sink
        self._loopback_users = frozenset(loopback_users)
        # failed logins per source address (AMQP and HTTP share it); runtime only, not persisted
        self.throttle = throttle if throttle is not None else LoginThrottle()
        self._users: dict[str, User] = {}
        self.backends: tuple[str, ...] = ("internal",)  # [main] auth_backends, in order
        self.tokens: TokenBackend | None = None  # the oauth backend, set by the node
        # called after every change: front ends forget the permission checks they remembered
        self.on_change: list[Callable[[], None]] = []
        data = read_json(path, None)
        if data is None:
            self._users[default_user] = User(
                name=default_user,
                password_hash=hash_password(default_password),
                tags=("administrator",),
                permissions={DEFAULT_VHOST: FULL_ACCESS},
            )
            self._save()
            logging.getLogger("skred").info(
                "created default user %r (tag administrator, full access to vhost %r)%s", default_user,
                DEFAULT_VHOST, "; it may log in from loopback only" if default_user in self._loopback_users
                else "")
        else:
            self._users = _users_from_json(path, data)

    @property
    def path(self) -> Path:
        return self._path

    def reload(self) -> None:
        """Read the file again (another worker of this node changed it: broker/shards); front
        ends forget the permission checks they remembered, as after a change made here."""
        data = read_json(self._path, None)
        if data is not None:
            self._users = _users_from_json(self._path, data)
            for listener in self.on_change:
                listener()

    # -- queries ------------------------------------------------------------------------------
    def get(self, name: str) -> User | None:
        return self._users.get(name)

    def list(self) -> list[User]:
        return [self._users[name] for name in sorted(self._users)]

    def authenticate(self, username: str, password: str) -> User | None:
        """The user the credentials log in as, by the first backend that accepts them, else None
        (unknown users take as long). An ``oauth`` login is the token's user, whatever
        ``username`` says (as RabbitMQ)."""
        return self._login(username, password)[0]

    def _login(self, username: str, password: str, backends: tuple[str, ...] | None = None
               ) -> tuple[User | None, str]:
        reasons: list[str] = []
        for backend in self.backends if backends is None else backends:
            if backend == "oauth" and self.tokens is not None:
                try:
                    return self.tokens.user(password), ""
                except ValueError as exc:
                    reasons.append(f"token refused: {exc}")
            elif backend == "internal":
                user = self._users.get(username)
                if user is None or not user.password_hash:
                    check_password(password, _DUMMY_HASH)
                    reasons.append("unknown user" if user is None else "user has no password")
                elif check_password(password, user.password_hash, user.hashing_algorithm):
                    return user, ""
                else:
                    reasons.append("wrong password")
        return None, "; ".join(reasons) or "no authentication backend"

    def pending(self, password: str) -> Fetch | None:
        """What a front end awaits before checking ``password`` (a token's keys), or None."""
        if self.tokens is None or "oauth" not in self.backends:
            return None
        return self.tokens.pending(password)

    def login_refusal(self, username: str, password: str, peer_ip: str) -> str | None:
        """Why a login is refused (None: accepted): for the log, never for the client."""
        return self.login(username, password, peer_ip)[1]

    def login(self, username: str, password: str, peer_ip: str, *, bearer: bool = False
              ) -> tuple[User | None, str | None]:
        """(the user, None) for an accepted login, (None, why it was refused) otherwise.
        ``bearer``: ``password`` is an access token (HTTP ``Authorization: Bearer``), for the
        oauth backend alone."""
        chain = (("oauth",) if "oauth" in self.backends else ()) if bearer else None
        user, reason = self._login(username, password, chain)
        if user is None:
            return None, reason
        if not self.allowed_from(user, peer_ip):
            return None, f"user {user.name!r} may only log in from a loopback address, not {peer_ip}"
        return user, None

    def throttle_key(self, peer_ip: str, username: str) -> str:
        """The login throttle's key of a login as ``username`` from ``peer_ip``."""
        return login_key(peer_ip, username, username in self._users)

    def allowed_from(self, user: User | str, peer_ip: str) -> bool:
        """False when a loopback-only user (``guest``) connects from a non-loopback address."""
        name = user if isinstance(user, str) else user.name
        return name not in self._loopback_users or is_loopback(peer_ip)

    def has_vhost_access(self, user: User | str, vhost: str) -> bool:
        found = self._resolve(user)
        if found is not None and found.grants is not None:
            return found.grants.vhost_access(vhost)
        return found is not None and vhost in found.permissions

    def can_configure(self, user: User | str, vhost: str, resource_name: str) -> bool:
        return self._allows(user, vhost, "configure", resource_name)

    def can_write(self, user: User | str, vhost: str, resource_name: str) -> bool:
        return self._allows(user, vhost, "write", resource_name)

    def can_read(self, user: User | str, vhost: str, resource_name: str) -> bool:
        return self._allows(user, vhost, "read", resource_name)

    def topic_allows(self, user: User | str, vhost: str, exchange: str, action: str,
                     routing_key: str) -> bool:
        """RabbitMQ's topic check: true unless the user has a topic permission on this exchange
        whose ``action`` (write/read) pattern the routing key does not match."""
        found = self._resolve(user)
        if found is None:
            return False
        if found.grants is not None:
            return found.grants.topic_allows(action, vhost, exchange, routing_key)
        topic = found.topic_permissions.get((vhost, exchange))
        return topic is None or topic.allows(action, routing_key, found.name, vhost)

    def has_topic_permission(self, user: User | str, vhost: str, exchange: str) -> bool:
        found = self._resolve(user)
        if found is not None and found.grants is not None:
            return found.grants.has_topic_patterns(vhost, exchange)
        return found is not None and (vhost, exchange) in found.topic_permissions

    # -- changes (each rewrites users.json) ---------------------------------------------------
    def set_topic_permission(self, user: str, vhost: str, exchange: str, write: str, read: str) -> User:
        check_name("vhost", vhost)
        check_name("exchange", exchange)
        topics = dict(self._require(user).topic_permissions)
        topics[(vhost, exchange)] = TopicPermission(write, read)  # raises ValueError on a bad regex
        return self._replace(user, topic_permissions=topics)

    def clear_topic_permissions(self, user: str, vhost: str, exchange: str | None = None) -> bool:
        """Drop the user's topic permissions on ``vhost`` (one exchange's, or all); False if none."""
        old = self._require(user).topic_permissions
        topics = {k: v for k, v in old.items() if not (k[0] == vhost and exchange in (None, k[1]))}
        if len(topics) == len(old):
            return False
        self._replace(user, topic_permissions=topics)
        return True

    def set_limit(self, user: str, name: str, value: int) -> User:
        check_limit(name, value)
        return self._replace(user, limits={**self._require(user).limits, name: value})

    def clear_limit(self, user: str, name: str) -> bool:
        limits = dict(self._require(user).limits)
        if limits.pop(name, None) is None:
            return False
        self._replace(user, limits=limits)
        return True

    def add_user(
        self,
        name: str,
        password: str | None = None,
        tags: Iterable[str] = (),
        *,
        password_hash: str | None = None,
    ) -> User:
        """Create a user from a password or an existing RabbitMQ-style hash (neither: no login)."""
        check_name("user", name)
        if name in self._users:
            raise ValueError(f"user {name!r} already exists")
        if password is not None and password_hash is not None:
            raise ValueError("give a password or a password hash, not both")
        if password is not None:
            password_hash = hash_password(password)
        user = User(name=name, password_hash=password_hash or "", tags=_normalise_tags(tags))
        self._commit({**self._users, name: user})
        return user

    def delete_user(self, name: str) -> None:
        self._require(name)
        self._commit({k: u for k, u in self._users.items() if k != name})

    def set_password(self, name: str, password: str) -> User:
        return self._replace(name, password_hash=hash_password(password), hashing_algorithm=HASHING_ALGORITHM)

    def set_tags(self, name: str, tags: Iterable[str]) -> User:
        return self._replace(name, tags=_normalise_tags(tags))

    def set_permissions(self, user: str, vhost: str, configure: str, write: str, read: str) -> User:
        check_name("vhost", vhost)
        permission = Permission(configure, write, read)  # raises ValueError on a bad regex
        permissions = dict(self._require(user).permissions)
        permissions[vhost] = permission
        return self._replace(user, permissions=permissions)

    def clear_permissions(self, user: str, vhost: str) -> User:
        permissions = dict(self._require(user).permissions)
        if permissions.pop(vhost, None) is None:
            return self._users[user]
        return self._replace(user, permissions=permissions)

    def clear_vhost(self, vhost: str) -> None:
        """Drop every user's permissions on ``vhost`` (called when the vhost is deleted)."""
        users = dict(self._users)
        changed = False
        for name, user in self._users.items():
            if vhost in user.permissions or any(k[0] == vhost for k in user.topic_permissions):
                permissions = {k: v for k, v in user.permissions.items() if k != vhost}
                topics = {k: v for k, v in user.topic_permissions.items() if k[0] != vhost}
                users[name] = dataclasses.replace(user, permissions=permissions, topic_permissions=topics)
                changed = True
        if changed:
            self._commit(users)

    def resolve(self, user: User | str) -> User | None:
        """The user as checks see it now: a token's user itself (None once expired), else the
        stored user of that name (None if deleted); its tags and limits are what apply."""
        return self._resolve(user)

    # -- internals ----------------------------------------------------------------------------
    def _resolve(self, user: User | str) -> User | None:
        # Look the name up even for a User object, so a deleted or changed user loses access at once;
        # a token's user is its own record, until it expires.
        if isinstance(user, User) and user.grants is not None:
            return None if user.expired() else user
        return self._users.get(user if isinstance(user, str) else user.name)

    def _allows(self, user: User | str, vhost: str, action: str, resource_name: str) -> bool:
        found = self._resolve(user)
        if found is None:
            return False
        if found.grants is not None:
            return found.grants.allows(action, vhost, resource_name or "amq.default")
        permission = found.permissions.get(vhost)
        return permission is not None and permission.allows(action, resource_name)

    def _require(self, name: str) -> User:
        user = self._users.get(name)
        if user is None:
            raise KeyError(f"no user {name!r}")
        return user

    def restore(self, users: Iterable[User]) -> None:
        """Put back the users ``list()`` returned before (undoing a failed import)."""
        self._commit({u.name: u for u in users})

    def _replace(self, name: str, **changes: Any) -> User:
        user = dataclasses.replace(self._require(name), **changes)
        self._commit({**self._users, name: user})
        return user

    def _commit(self, users: dict[str, User]) -> None:
        """users.json first, then memory: a full disk (DiskFull) changes neither."""
        write_json(self._path, users_to_json(users.values()), self._sink)
        self._users = users
        for listener in self.on_change:
            listener()

    def _save(self) -> None:
        write_json(self._path, users_to_json(self._users.values()), self._sink)


def users_to_json(users: Iterable[User]) -> dict[str, Any]:
    """The ``users.json`` document: RabbitMQ definitions' ``users`` and ``permissions`` lists."""
    ordered = sorted(users, key=lambda u: u.name)
    return {
        "version": FILE_VERSION,
        "users": [
            {
                "name": u.name,
                "password_hash": u.password_hash,
                "hashing_algorithm": u.hashing_algorithm,
                "tags": list(u.tags),
                "limits": dict(sorted(u.limits.items())),
            }
            for u in ordered
        ],
        "topic_permissions": topic_permissions_json(ordered),
        "permissions": [
            {"user": u.name, "vhost": vhost, "configure": p.configure, "write": p.write, "read": p.read}
            for u in ordered
            for vhost, p in sorted(u.permissions.items())
        ],
    }


def check_limit(name: str, value: Any) -> None:
    """ValueError unless ``name`` is a user limit and ``value`` a valid setting of it."""
    if name not in USER_LIMITS:
        raise ValueError(f"unknown user limit {name!r} (known: {', '.join(USER_LIMITS)})")
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"user limit {name} must be an integer >= -1 (-1: no limit)")


def topic_permissions_json(users: Iterable[User]) -> list[dict[str, Any]]:
    """The users' topic permissions as RabbitMQ's API and definitions list them."""
    return [{"user": u.name, "vhost": vhost, "exchange": exchange, "write": t.write, "read": t.read}
            for u in users for (vhost, exchange), t in sorted(u.topic_permissions.items())]


def _users_from_json(path: Path, data: Any) -> dict[str, User]:
    try:
        users: dict[str, User] = {}
        for entry in data["users"]:
            tags = entry.get("tags", [])
            if isinstance(tags, str):  # RabbitMQ exports tags as "a,b" in older versions
                tags = [t for t in tags.split(",") if t.strip()]
            users[entry["name"]] = User(
                name=str(entry["name"]),
                password_hash=str(entry.get("password_hash", "")),
                tags=_normalise_tags(tags),
                hashing_algorithm=str(entry.get("hashing_algorithm", HASHING_ALGORITHM)),
                limits={str(k): int(v) for k, v in (entry.get("limits") or {}).items()},
            )
        grants: dict[str, dict[str, Permission]] = {}
        for entry in data.get("permissions", []):
            grants.setdefault(entry["user"], {})[entry["vhost"]] = Permission.loaded(
                str(entry["configure"]), str(entry["write"]), str(entry["read"]),
                f"{path}: user {entry['user']!r} on vhost {entry['vhost']!r}")
        topics: dict[str, dict[tuple[str, str], TopicPermission]] = {}
        for entry in data.get("topic_permissions", []):
            topics.setdefault(entry["user"], {})[(str(entry["vhost"]), str(entry["exchange"]))] = \
                TopicPermission(str(entry["write"]), str(entry["read"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StoreError(f"{path}: malformed users file ({type(exc).__name__}: {exc})") from None
    for name, permissions in grants.items():
        if name in users:
            users[name] = dataclasses.replace(users[name], permissions=permissions)
    for name, topic in topics.items():
        if name in users:
            users[name] = dataclasses.replace(users[name], topic_permissions=topic)
    return users
