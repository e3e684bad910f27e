"""The commands of ``skredctl``: lavinmqctl's names and arguments next to the older
rabbitmqctl-style ones, each one or a few management API requests.

Every command is declared once (``command``): its name, help, arguments and handler; the
parser (``broker/ctl/__init__.py``) is built from this table, so ``skredctl CMD --help``
exists for each. Every list (``list <what>`` and each ``list_<what>``) goes through one
path, ``_list``, over the ``LISTS`` table: the API path (all vhosts, or one), the columns
``list`` prints and the columns lavinmqctl's ``list_*`` prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.auth.passwords import hash_password
from broker.ctl import offline
from broker.ctl.client import UNSUPPORTED, Client, CtlError, q
from broker.ctl.output import Out

UNHEALTHY = 1  # the one failure status of a container healthcheck (Docker reserves 2)


@dataclass(frozen=True)
class Listing:
    all_path: str
    vhost_path: str | None  # with {vhost}; None: not per vhost
    columns: list[str]  # what `list <what>` prints
    lavin: list[str]  # what lavinmqctl's list_<what> prints
    root_default: bool = True  # list_<what> without --vhost lists vhost '/' (lavinmqctl's default)
    feature: str | None = None  # an API another release may lack: 404 -> exit 3


LISTS: dict[str, Listing] = {
    "queues": Listing(
        "/api/queues",
        "/api/queues/{vhost}",
        ["vhost", "name", "durable", "messages_ready", "messages_unacknowledged", "consumers"],
        ["name", "messages"],
    ),
    "exchanges": Listing(
        "/api/exchanges",
        "/api/exchanges/{vhost}",
        ["vhost", "name", "type", "durable", "auto_delete", "internal"],
        ["name", "type"],
    ),
    "bindings": Listing(
        "/api/bindings",
        "/api/bindings/{vhost}",
        ["vhost", "source", "destination", "destination_type", "routing_key"],
        ["source", "destination", "destination_type", "routing_key"],
    ),
    "connections": Listing(
        "/api/connections",
        "/api/vhosts/{vhost}/connections",
        ["name", "user", "vhost", "channels"],
        ["user", "peer_host", "peer_port", "state"],
        root_default=False,
    ),
    "channels": Listing(
        "/api/channels",
        "/api/vhosts/{vhost}/channels",
        ["name", "user", "vhost", "consumer_count", "messages_unacknowledged"],
        ["name", "user", "consumer_count", "messages_unacknowledged"],
        root_default=False,
    ),
    "consumers": Listing(
        "/api/consumers",
        "/api/consumers/{vhost}",
        ["queue.vhost", "queue.name", "consumer_tag", "ack_required"],
        ["queue.name", "consumer_tag", "ack_required", "prefetch_count"],
    ),
    "users": Listing("/api/users", None, ["name", "tags"], ["name", "tags"]),
    "vhosts": Listing("/api/vhosts", None, ["name", "messages"], ["name"]),
    "permissions": Listing(
        "/api/permissions",
        "/api/vhosts/{vhost}/permissions",
        ["user", "vhost", "configure", "write", "read"],
        ["user", "configure", "write", "read"],
    ),
    "policies": Listing(
        "/api/policies",
        "/api/policies/{vhost}",
        ["vhost", "name", "pattern", "apply-to", "priority"],
        ["vhost", "name", "pattern", "apply-to", "definition", "priority"],
    ),
    "shovels": Listing(
        "/api/shovels",
        "/api/shovels/{vhost}",
        ["vhost", "name", "state"],
        ["name", "vhost", "state"],
        feature="shovel status (/api/shovels)",
    ),
    "federations": Listing(
        "/api/parameters/federation-upstream",
        "/api/parameters/federation-upstream/{vhost}",
        ["vhost", "name", "component"],
        ["name", "component"],
    ),
    "federation_links": Listing(
        "/api/federation-links",
        "/api/federation-links/{vhost}",
        ["vhost", "upstream", "type", "exchange", "queue", "status"],
        ["upstream", "type", "exchange", "queue", "status"],
        feature="federation links (/api/federation-links)",
    ),
}


class Ctx:
    """What a handler works with: the parsed arguments, the output and (made on first use,
    so offline commands need no broker) the API client."""

    def __init__(self, args: argparse.Namespace, out: Out, make_client: Callable[[], Client]) -> None:
        self.args = args
        self.out = out
        self._make_client = make_client
        self._client: Client | None = None

    @property
    def c(self) -> Client:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    @property
    def vhost(self) -> str:
        return self.vhost_or_none or "/"

    @property
    def vhost_or_none(self) -> str | None:
        a = self.args
        return getattr(a, "vhost", None) or getattr(a, "global_vhost", None)


Arg = tuple[tuple[str, ...], dict[str, Any]]
Handler = Callable[[Ctx], None]


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    args: tuple[Arg, ...]
    handler: Handler


COMMANDS: dict[str, Command] = {}


def arg(*names: str, **kw: Any) -> Arg:
    return names, kw


VHOST = arg("--vhost", help="the vhost (default '/'; also given before the command)")


def command(name: str, help: str, *args: Arg) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        COMMANDS[name] = Command(name, help, args, fn)
        return fn

    return register


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CtlError(f"{what} is not JSON: {exc}") from None


# ------------------------------------------------------------------------ lists
def _list(ctx: Ctx, what: str, lavin: bool) -> None:
    spec = LISTS[what]
    vhost = ctx.vhost_or_none
    if vhost is None and lavin and spec.root_default and spec.vhost_path is not None:
        vhost = "/"
    if vhost is not None and spec.vhost_path is None:
        raise CtlError(f"--vhost does not apply to {what}")
    path = spec.all_path if vhost is None else (spec.vhost_path or "").format(vhost=q(vhost))
    try:
        rows = ctx.c.request("GET", path)
    except CtlError as exc:
        if spec.feature and exc.http_status in (404, 405):
            raise CtlError(
                f"this broker does not offer {spec.feature} (GET {path} answered HTTP {exc.http_status})",
                status=UNSUPPORTED,
            ) from None
        raise
    columns: list[str] | None = list(getattr(ctx.args, "columns", None) or []) or None
    if columns is None and not ctx.out.json:
        columns = spec.lavin if lavin else spec.columns
    ctx.out.rows(rows if isinstance(rows, list) else [], columns)


@command(
    "list",
    "list objects (rabbitmqctl-style, all vhosts unless --vhost)",
    arg("what", choices=sorted(LISTS)),
    VHOST,
    arg("columns", nargs="*", help="columns to print (default: a useful few)"),
)
def list_any(ctx: Ctx) -> None:
    _list(ctx, ctx.args.what, lavin=False)


def _register_lists() -> None:
    for what, spec in LISTS.items():
        scope = (
            "for a vhost (default '/')"
            if spec.root_default and spec.vhost_path
            else ("(all vhosts unless --vhost)" if spec.vhost_path else "")
        )
        args: tuple[Arg, ...] = (
            arg("columns", nargs="*", help=f"columns (default: {' '.join(spec.lavin)})"),
        )
        if spec.vhost_path:
            args = (VHOST, *args)

        def handler(ctx: Ctx, what: str = what) -> None:
            _list(ctx, what, lavin=True)

        COMMANDS[f"list_{what}"] = Command(
            f"list_{what}", f"list {what.replace('_', ' ')} {scope}".strip(), args, handler
        )


_register_lists()


# ------------------------------------------------------------------------ users
def _user_tags(ctx: Ctx, name: str) -> list[str]:
    user = ctx.c.request("GET", f"/api/users/{q(name)}")
    tags = user.get("tags", []) if isinstance(user, dict) else []
    return [t for t in (tags.split(",") if isinstance(tags, str) else tags) if t]


@command(
    "add_user",
    "create or update a user",
    arg("name"),
    arg("new_password", metavar="password"),
    arg("--tags", default="", help="comma-separated tags, e.g. administrator"),
)
def add_user(ctx: Ctx) -> None:
    a = ctx.args
    tags = [t for t in a.tags.split(",") if t]
    ctx.c.request("PUT", f"/api/users/{q(a.name)}", {"password": a.new_password, "tags": tags})
    ctx.out.done(f"user '{a.name}' saved")


@command("delete_user", "delete a user", arg("name"))
def delete_user(ctx: Ctx) -> None:
    ctx.c.request("DELETE", f"/api/users/{q(ctx.args.name)}")
    ctx.out.done(f"user '{ctx.args.name}' deleted")


@command(
    "change_password",
    "set a user's password (its tags stay)",
    arg("name"),
    arg("new_password", metavar="new_password"),
)
def change_password(ctx: Ctx) -> None:
    a = ctx.args
    ctx.c.request(
        "PUT", f"/api/users/{q(a.name)}", {"password": a.new_password, "tags": _user_tags(ctx, a.name)}
    )
    ctx.out.done(f"password of user '{a.name}' changed")


@command(
    "set_user_tags",
    "replace a user's tags (none: no tags; its password stays)",
    arg("name"),
    arg("tags", nargs="*", help="tags, space- or comma-separated"),
)
def set_user_tags(ctx: Ctx) -> None:
    a = ctx.args
    tags = [t for part in a.tags for t in part.split(",") if t]
    _user_tags(ctx, a.name)  # a missing user is 'not found', not a user created without password
    ctx.c.request("PUT", f"/api/users/{q(a.name)}", {"tags": tags})
    ctx.out.done(f"tags of user '{a.name}' set to [{','.join(tags)}]")


@command(
    "set_permissions",
    "set a user's permissions on a vhost",
    arg("target_user", metavar="user"),
    arg("configure"),
    arg("write"),
    arg("read"),
    VHOST,
)
def set_permissions(ctx: Ctx) -> None:
    a = ctx.args
    ctx.c.request(
        "PUT",
        f"/api/permissions/{q(ctx.vhost)}/{q(a.target_user)}",
        {"configure": a.configure, "write": a.write, "read": a.read},
    )
    ctx.out.done(f"permissions of '{a.target_user}' on vhost '{ctx.vhost}' set")


@command(
    "hash_password",
    "print the password hash a definitions file holds (SHA-256, salted; offline)",
    arg("password"),
)
def hash_password_cmd(ctx: Ctx) -> None:
    digest = hash_password(ctx.args.password)
    ctx.out.obj({"password_hash": digest, "hashing_algorithm": "rabbit_password_hashing_sha256"}, digest)


# ----------------------------------------------------------------------- vhosts
@command("add_vhost", "create a vhost", arg("name"))
def add_vhost(ctx: Ctx) -> None:
    ctx.c.request("PUT", f"/api/vhosts/{q(ctx.args.name)}")
    ctx.out.done(f"vhost '{ctx.args.name}' created")


@command("delete_vhost", "delete a vhost and everything in it", arg("name"))
def delete_vhost(ctx: Ctx) -> None:
    ctx.c.request("DELETE", f"/api/vhosts/{q(ctx.args.name)}")
    ctx.out.done(f"vhost '{ctx.args.name}' deleted")


VHOST_LIMITS = ("max-connections", "max-queues")


@command(
    "set_vhost_limits",
    "set a vhost's limits from JSON, e.g. '{\"max-queues\": 10}' (-1: no limit)",
    arg("limits", metavar="json"),
    VHOST,
)
def set_vhost_limits(ctx: Ctx) -> None:
    doc = _json_arg(ctx.args.limits, "the limits")
    if (
        not isinstance(doc, dict)
        or not doc
        or set(doc) - set(VHOST_LIMITS)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in doc.values())
    ):
        raise CtlError(f"limits must be a JSON object of integers with keys among {', '.join(VHOST_LIMITS)}")
    for name, value in doc.items():
        ctx.c.request("PUT", f"/api/vhost-limits/{q(ctx.vhost)}/{name}", {"value": value})
    ctx.out.done(f"limits of vhost '{ctx.vhost}' set: {json.dumps(doc, sort_keys=True)}")


# ----------------------------------------------------------------------- queues
def _queue_path(ctx: Ctx, name: str) -> str:
    return f"/api/queues/{q(ctx.vhost)}/{q(name)}"


@command(
    "declare_queue",
    "declare a queue (durable unless --no-durable)",
    arg("name"),
    VHOST,
    arg("--durable", action=argparse.BooleanOptionalAction, default=True),
    arg("--auto-delete", action="store_true"),
)
def declare_queue(ctx: Ctx) -> None:
    a = ctx.args
    ctx.c.request("PUT", _queue_path(ctx, a.name), {"durable": a.durable, "auto_delete": a.auto_delete})
    ctx.out.done(f"queue '{a.name}' declared")


QUEUE_INT_ARGS = (
    ("--expires", "x-expires", "delete the queue after this many ms unused"),
    ("--max-length", "x-max-length", "at most this many messages"),
    ("--message-ttl", "x-message-ttl", "messages expire after this many ms"),
    ("--delivery-limit", "x-delivery-limit", "dead-letter a message after this many deliveries"),
)
QUEUE_STR_ARGS = (
    ("--dead-letter-exchange", "x-dead-letter-exchange", "the exchange dead letters go to"),
    ("--dead-letter-routing-key", "x-dead-letter-routing-key", "their routing key"),
)


@command(
    "create_queue",
    "create a queue (lavinmqctl: transient unless --durable)",
    arg("name"),
    VHOST,
    arg("--durable", action="store_true", help="survive a restart"),
    arg("--auto-delete", action="store_true", help="delete when its last consumer goes"),
    *(arg(flag, type=_int, metavar="N", help=h) for flag, _, h in QUEUE_INT_ARGS),
    *(arg(flag, metavar="NAME", help=h) for flag, _, h in QUEUE_STR_ARGS),
    arg(
        "--reject-on-overflow",
        action="store_true",
        help="refuse publishes when full (x-overflow reject-publish) instead of dropping the oldest",
    ),
    arg("--stream-queue", action="store_true", help="a stream queue (x-queue-type stream)"),
)
def create_queue(ctx: Ctx) -> None:
    a = ctx.args
    arguments: dict[str, Any] = {}
    for flag, key, _ in (*QUEUE_INT_ARGS, *QUEUE_STR_ARGS):
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None:
            arguments[key] = value
    if a.reject_on_overflow:
        arguments["x-overflow"] = "reject-publish"
    if a.stream_queue:
        arguments["x-queue-type"] = "stream"
    ctx.c.request(
        "PUT",
        _queue_path(ctx, a.name),
        {"durable": a.durable, "auto_delete": a.auto_delete, "arguments": arguments},
    )
    ctx.out.done(f"queue '{a.name}' created")


@command("delete_queue", "delete a queue", arg("name"), VHOST)
def delete_queue(ctx: Ctx) -> None:
    ctx.c.request("DELETE", _queue_path(ctx, ctx.args.name))
    ctx.out.done(f"queue '{ctx.args.name}' deleted")


@command("purge_queue", "remove every ready message of a queue", arg("name"), VHOST)
def purge_queue(ctx: Ctx) -> None:
    ctx.c.request("DELETE", _queue_path(ctx, ctx.args.name) + "/contents")
    ctx.out.done(f"queue '{ctx.args.name}' purged")


def _queue_op(op: str, done: str) -> Handler:
    def handler(ctx: Ctx) -> None:
        path = _queue_path(ctx, ctx.args.name)
        ctx.c.request("GET", path)  # a missing queue is 'not found' (1), not a missing feature (3)
        ctx.c.feature(f"{op}_queue", "PUT", f"{path}/{op}")
        ctx.out.done(f"queue '{ctx.args.name}' {done}")

    return handler


for _op, _help, _done in (
    ("pause", "stop deliveries from a queue (publishes continue)", "paused"),
    ("resume", "resume deliveries from a paused queue", "resumed"),
    ("restart", "restart a closed queue", "restarted"),
):
    COMMANDS[f"{_op}_queue"] = Command(f"{_op}_queue", _help, (arg("name"), VHOST), _queue_op(_op, _done))


# -------------------------------------------------------------------- exchanges
@command(
    "create_exchange",
    "create an exchange (transient unless --durable)",
    arg("type"),
    arg("name"),
    VHOST,
    arg("--durable", action="store_true"),
    arg("--auto-delete", action="store_true"),
    arg("--internal", action="store_true"),
    arg("--delayed", action="store_true", help="delay messages by their x-delay header"),
    arg("--alternate-exchange", metavar="NAME", help="where unroutable messages go"),
    arg("--persist-messages", type=_int, metavar="N", help="x-persist-messages (LavinMQ)"),
    arg("--persist-ms", type=_int, metavar="MS", help="x-persist-ms (LavinMQ)"),
)
def create_exchange(ctx: Ctx) -> None:
    a = ctx.args
    arguments: dict[str, Any] = {}
    if a.alternate_exchange is not None:
        arguments["alternate-exchange"] = a.alternate_exchange
    if a.persist_messages is not None:
        arguments["x-persist-messages"] = a.persist_messages
    if a.persist_ms is not None:
        arguments["x-persist-ms"] = a.persist_ms
    if a.delayed:
        arguments["x-delayed-exchange"] = True
    ctx.c.request(
        "PUT",
        f"/api/exchanges/{q(ctx.vhost)}/{q(a.name)}",
        {
            "type": a.type,
            "durable": a.durable,
            "auto_delete": a.auto_delete,
            "internal": a.internal,
            "arguments": arguments,
        },
    )
    ctx.out.done(f"exchange '{a.name}' created")


@command("delete_exchange", "delete an exchange", arg("name"), VHOST)
def delete_exchange(ctx: Ctx) -> None:
    ctx.c.request("DELETE", f"/api/exchanges/{q(ctx.vhost)}/{q(ctx.args.name)}")
    ctx.out.done(f"exchange '{ctx.args.name}' deleted")


# ------------------------------------------------------------------ connections
DEFAULT_REASON = "Closed via skredctl"


def _close(ctx: Ctx, name: str, reason: str) -> None:
    ctx.c.request("DELETE", f"/api/connections/{q(name)}", headers={"X-Reason": reason})


@command(
    "close_connection",
    "close a connection by name",
    arg("name"),
    arg("reason", nargs="?", default=DEFAULT_REASON),
)
def close_connection(ctx: Ctx) -> None:
    _close(ctx, ctx.args.name, ctx.args.reason)
    ctx.out.done(f"connection '{ctx.args.name}' closed")


@command(
    "close_all_connections",
    "close every connection (of --vhost if given)",
    arg("reason", nargs="?", default=DEFAULT_REASON),
    VHOST,
)
def close_all_connections(ctx: Ctx) -> None:
    vhost = ctx.vhost_or_none
    path = "/api/connections" if vhost is None else f"/api/vhosts/{q(vhost)}/connections"
    closed: list[dict[str, Any]] = []
    for conn in ctx.c.request("GET", path) or []:
        try:
            _close(ctx, conn["name"], ctx.args.reason)
        except CtlError as exc:
            if exc.http_status != 404:  # gone meanwhile: closed all the same
                raise
        closed.append({"closed_connections": conn["name"]})
    ctx.out.rows(closed, ["closed_connections"])


# --------------------------------------------------------------------- policies
@command(
    "set_policy",
    "create or replace a policy",
    arg("name"),
    arg("pattern"),
    arg("definition", help="JSON"),
    VHOST,
    arg("--priority", type=_int, default=0),
    arg(
        "--apply-to",
        default="all",
        choices=("all", "queues", "exchanges", "classic_queues", "quorum_queues", "streams"),
    ),
)
def set_policy(ctx: Ctx) -> None:
    a = ctx.args
    definition = _json_arg(a.definition, "the definition")
    ctx.c.request(
        "PUT",
        f"/api/policies/{q(ctx.vhost)}/{q(a.name)}",
        {"pattern": a.pattern, "definition": definition, "priority": a.priority, "apply-to": a.apply_to},
    )
    ctx.out.done(f"policy '{a.name}' set on vhost '{ctx.vhost}'")


@command("clear_policy", "delete a policy", arg("name"), VHOST)
def clear_policy(ctx: Ctx) -> None:
    ctx.c.request("DELETE", f"/api/policies/{q(ctx.vhost)}/{q(ctx.args.name)}")
    ctx.out.done(f"policy '{ctx.args.name}' cleared")


# ---------------------------------------------------------- shovels, federation
SHOVEL_ARGS = (
    ("--src-uri", str),
    ("--dest-uri", str),
    ("--src-queue", str),
    ("--dest-queue", str),
    ("--src-exchange", str),
    ("--dest-exchange", str),
    ("--src-exchange-key", str),
    ("--dest-exchange-key", str),
    ("--src-prefetch-count", _int),
    ("--src-delete-after", str),
    ("--ack-mode", str),
    ("--reconnect-delay", _int),
)
SHOVEL_DEFAULTS = {
    "src-prefetch-count": 1000,
    "reconnect-delay": 5,
    "ack-mode": "on-confirm",
    "src-delete-after": "never",
}
FEDERATION_ARGS = (
    ("--uri", str),
    ("--expires", _int),
    ("--message-ttl", _int),
    ("--max-hops", _int),
    ("--prefetch-count", _int),
    ("--reconnect-delay", _int),
    ("--ack-mode", str),
    ("--consumer-tag", str),
    ("--exchange", str),
    ("--queue", str),
)
FEDERATION_DEFAULTS = {"prefetch-count": 1000, "reconnect-delay": 1, "ack-mode": "on-confirm", "max-hops": 1}


def _value(ctx: Ctx, flags: tuple[tuple[str, Any], ...], defaults: dict[str, Any]) -> dict[str, Any]:
    value = dict(defaults)
    for flag, _ in flags:
        given = getattr(ctx.args, flag[2:].replace("-", "_"))
        if given is not None:
            value[flag[2:]] = given
    return value


def _parameter_path(component: str, vhost: str, name: str) -> str:
    return f"/api/parameters/{component}/{q(vhost)}/{q(name)}"


@dataclass(frozen=True)
class Component:
    """A runtime-parameters component skredctl adds and deletes: shovels, federation upstreams."""

    name: str  # the API's component
    noun: str  # lavinmqctl's command suffix
    what: str  # for messages
    flags: tuple[tuple[str, Any], ...]
    defaults: dict[str, Any]
    required: tuple[str, ...]


COMPONENTS = (
    Component("shovel", "shovel", "shovel", SHOVEL_ARGS, SHOVEL_DEFAULTS, ("--src-uri", "--dest-uri")),
    Component(
        "federation-upstream",
        "federation",
        "federation upstream",
        FEDERATION_ARGS,
        FEDERATION_DEFAULTS,
        ("--uri",),
    ),
)


def _add_parameter(comp: Component) -> Handler:
    def handler(ctx: Ctx) -> None:
        missing = [f for f in comp.required if not getattr(ctx.args, f[2:].replace("-", "_"))]
        if missing:
            raise CtlError(f"add_{comp.noun} needs {' and '.join(comp.required)}")
        value = _value(ctx, comp.flags, comp.defaults)
        ctx.c.feature(
            f"{comp.what}s", "PUT", _parameter_path(comp.name, ctx.vhost, ctx.args.name), {"value": value}
        )
        ctx.out.done(f"{comp.what} '{ctx.args.name}' saved")

    return handler


def _delete_parameter(comp: Component) -> Handler:
    def handler(ctx: Ctx) -> None:
        ctx.c.request("DELETE", _parameter_path(comp.name, ctx.vhost, ctx.args.name))
        ctx.out.done(f"{comp.what} '{ctx.args.name}' deleted")

    return handler


for _comp in COMPONENTS:
    _flags = tuple(arg(f, type=t, default=None) for f, t in _comp.flags)
    COMMANDS[f"add_{_comp.noun}"] = Command(
        f"add_{_comp.noun}",
        f"create or replace a {_comp.what}",
        (arg("name"), VHOST, *_flags),
        _add_parameter(_comp),
    )
    COMMANDS[f"delete_{_comp.noun}"] = Command(
        f"delete_{_comp.noun}", f"delete a {_comp.what}", (arg("name"), VHOST), _delete_parameter(_comp)
    )



def _shovel_op(method: str, path: str, done: str) -> Handler:
    def handler(ctx: Ctx) -> None:
        ctx.c.feature("shovel control", method, path.format(vhost=q(ctx.vhost), name=q(ctx.args.name)))
        ctx.out.done(f"shovel '{ctx.args.name}' {done}")

    return handler


for _verb, _method, _path, _done, _help in (
    ("pause", "PUT", "/api/shovels/{vhost}/{name}/pause", "paused",
     "pause a shovel (LavinMQ's path; kept across restarts)"),
    ("resume", "PUT", "/api/shovels/{vhost}/{name}/resume", "resumed", "resume a paused shovel"),
    ("restart", "DELETE", "/api/shovels/vhost/{vhost}/{name}/restart", "restarted",
     "restart a shovel (RabbitMQ's path)"),
):
    COMMANDS[f"{_verb}_shovel"] = Command(
        f"{_verb}_shovel", _help, (arg("name"), VHOST), _shovel_op(_method, _path, _done))



# --------------------------------------------------------------------- tracing
def _trace(on: bool) -> Handler:
    def handler(ctx: Ctx) -> None:
        ctx.c.feature("firehose tracing", "PUT", f"/api/vhosts/{q(ctx.vhost)}", {"tracing": on})
        ctx.out.done(f"tracing {'on' if on else 'off'} for vhost '{ctx.vhost}'")

    return handler


for _on in (True, False):
    COMMANDS[f"trace_{'on' if _on else 'off'}"] = Command(
        f"trace_{'on' if _on else 'off'}",
        f"firehose tracing {'on' if _on else 'off'} for a vhost (publish.<exchange> and "
        "deliver.<queue> copies to amq.rabbitmq.trace, as rabbitmqctl's)",
        (VHOST,), _trace(_on))

# ---------------------------------------------------------------- super streams
SUPER_STREAM_ARGS = (
    arg("name"),
    VHOST,
    arg("--partitions", type=_int, help="partitions NAME-0 .. NAME-(N-1), binding keys 0 .. N-1"),
    arg("--binding-keys", help="comma-separated keys: partitions NAME-KEY"),
    arg("--max-age", help="partition retention, e.g. 7D"),
    arg("--max-length-bytes", type=_int, help="partition retention in bytes"),
)


def _super_stream(grow: bool) -> Handler:
    def handler(ctx: Ctx) -> None:
        a = ctx.args
        if (a.partitions is None) == (a.binding_keys is None):
            raise CtlError("give exactly one of --partitions and --binding-keys")
        path = f"/api/super-streams/{q(ctx.vhost)}/{q(a.name)}"
        if grow:
            ctx.c.request("GET", path)  # 404 when there is none to grow
        elif _exists(ctx.c, path):
            raise CtlError(f"super stream '{a.name}' already exists in vhost '{ctx.vhost}'")
        body: dict[str, Any] = {"partitions": a.partitions} if a.partitions is not None else \
            {"binding_keys": [k for k in a.binding_keys.split(",") if k]}
        retention = {"x-max-age": a.max_age, "x-max-length-bytes": a.max_length_bytes}
        body["arguments"] = {k: v for k, v in retention.items() if v is not None}
        if not grow:
            body["routing"] = a.routing
        ctx.c.feature("super streams", "PUT", path, body)
        parts = ctx.c.request("GET", path)["partitions"]
        ctx.out.done(f"super stream '{a.name}' has partitions {', '.join(parts)}")

    return handler


def _exists(c: Client, path: str) -> bool:
    try:
        c.request("GET", path)
    except CtlError:
        return False
    return True


COMMANDS["add_super_stream"] = Command(
    "add_super_stream", "create a super stream: an exchange and its partition streams",
    (*SUPER_STREAM_ARGS,
     arg("--routing", choices=("key", "hash"), default="key",
         help="how AMQP publishes pick a partition: by binding key (default) or by MurmurHash3 of "
              "the routing key, as the stream clients' hash routing")),
    _super_stream(grow=False))
COMMANDS["grow_super_stream"] = Command(
    "grow_super_stream", "add partitions to a super stream (the total count, or new binding keys)",
    SUPER_STREAM_ARGS, _super_stream(grow=True))


@command("delete_super_stream", "delete a super stream and every partition", arg("name"), VHOST)
def delete_super_stream(ctx: Ctx) -> None:
    ctx.c.request("DELETE", f"/api/super-streams/{q(ctx.vhost)}/{q(ctx.args.name)}")
    ctx.out.done(f"super stream '{ctx.args.name}' deleted")

# ------------------------------------------------------------------ definitions
@command(
    "export_definitions",
    "write definitions JSON to FILE (or stdout)",
    arg("file", nargs="?", default="-"),
    VHOST,
)
def export_definitions(ctx: Ctx) -> None:
    vhost = ctx.vhost_or_none
    path = "/api/definitions" + (f"/{q(vhost)}" if vhost else "")
    text = json.dumps(ctx.c.request("GET", path), indent=2) + "\n"
    if ctx.args.file == "-":
        ctx.out.stream.write(text)
        return
    with open(ctx.args.file, "w", encoding="utf-8") as fh:
        fh.write(text)
    ctx.out.done(f"definitions written to {ctx.args.file}")


@command("import_definitions", "import definitions JSON from FILE ('-': stdin)", arg("file"), VHOST)
def import_definitions(ctx: Ctx) -> None:
    try:
        if ctx.args.file == "-":
            raw = sys.stdin.read()
        else:
            with open(ctx.args.file, encoding="utf-8") as fh:
                raw = fh.read()
        doc = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise CtlError(f"cannot read definitions from {ctx.args.file}: {exc}") from None
    vhost = ctx.vhost_or_none
    ctx.c.request("POST", "/api/definitions" + (f"/{q(vhost)}" if vhost else ""), doc)
    ctx.out.done(f"definitions imported from {ctx.args.file}")


@command(
    "definitions",
    "print the definitions JSON of a stopped node's data directory (offline)",
    arg("data_dir", metavar="datadir"),
)
def definitions(ctx: Ctx) -> None:
    try:
        doc = offline.definitions(ctx.args.data_dir)
    except offline.OfflineError as exc:
        raise CtlError(str(exc)) from None
    ctx.out.write(json.dumps(doc, indent=2))


# ------------------------------------------------------------------------- node
@command("status", "node overview")
def status(ctx: Ctx) -> None:
    ov = ctx.c.request("GET", "/api/overview")
    if ctx.out.json:
        ctx.out.obj(ov)
        return
    totals = ov.get("object_totals", {})
    qt = ov.get("queue_totals", {})
    lines = [f"node: {ov.get('node')}  product: {ov.get('product_name')} {ov.get('product_version')}"]
    if "app_running" in ov:  # skredctl stop_app/start_app
        lines.append(f"app: {'running' if ov['app_running'] else 'stopped'}")
    lines += [
        f"{key}: {totals.get(key, 0)}"
        for key in ("connections", "channels", "queues", "consumers", "exchanges")
    ]
    lines.append(
        f"messages: {qt.get('messages', 0)} (ready {qt.get('messages_ready', 0)}, "
        f"unacked {qt.get('messages_unacknowledged', 0)})"
    )
    lines += [
        f"listener: {x.get('protocol')} {x.get('ip_address')}:{x.get('port')}"
        for x in ov.get("listeners", [])
    ]
    ctx.out.write("\n".join(lines))


@command("cluster_status", "this node, its cluster role and its followers")
def cluster_status(ctx: Ctx) -> None:
    nodes = ctx.c.request("GET", "/api/nodes") or [{}]
    cluster = ctx.c.request("GET", "/api/cluster") or {}
    this = nodes[0] if nodes else {}
    doc = {
        "this_node": this.get("name"),
        "version": ctx.c.request("GET", "/api/overview").get("product_version"),
        "clustering": bool(cluster.get("enabled", True)),
        **{k: v for k, v in cluster.items() if k != "enabled"},
    }
    ctx.out.obj(doc)


@command(
    "aliveness",
    "the aliveness test (declare, publish, get) in a vhost; exit 0 when it passes, 1 "
    "otherwise: a container health command",
    VHOST,
)
def aliveness(ctx: Ctx) -> None:
    try:
        result = ctx.c.request("GET", f"/api/aliveness-test/{q(ctx.vhost)}")
    except CtlError as exc:
        raise CtlError(str(exc), status=UNHEALTHY) from None
    if not isinstance(result, dict) or result.get("status") != "ok":
        raise CtlError(f"aliveness test of vhost '{ctx.vhost}' failed: {result!r}", status=UNHEALTHY)
    ctx.out.obj(result, "ok")


@command("stop_app", "stop the node's messaging side: every client listener and connection closes; "
         "the management API and the data stay (PUT /api/broker/stop)")
def stop_app(ctx: Ctx) -> None:
    ctx.c.feature("stop_app", "PUT", "/api/broker/stop")
    ctx.out.done("app stopped")


@command("start_app", "open the node's client listeners again (PUT /api/broker/start)")
def start_app(ctx: Ctx) -> None:
    ctx.c.feature("start_app", "PUT", "/api/broker/start")
    ctx.out.done("app running")
