"""Shared pieces of the management API: JSON errors, auth, bodies, names, paging.

Theory of operation
-------------------
Handlers raise ``ApiError(status, error, reason)``; the error middleware turns
it (and aiohttp's own 404/405, a model ``AMQPError`` through ``errors.http_status``,
the mapping LMQ uses too, and a model ``ValueError``: 400) into RabbitMQ's JSON
error body ``{"error": ..., "reason": ...}``; a refusal is never a 500. The auth middleware checks HTTP
basic credentials against the user store on every request (a salted SHA-256,
cheap) and stores the ``User`` on the request; a user with none of the
management tags is refused like a bad password (401), as RabbitMQ does.
Privilege checks inside handlers (administrator-only, vhost access, AMQP
permissions) answer 401 ``not_authorized`` too, as RabbitMQ's API does (its
rabbitmqadmin prints "Access refused" for a 401 and a traceback for a 403), but
without the ``WWW-Authenticate`` challenge, so a browser does not ask again.

Bodies: like RabbitMQ, fields a handler does not use are ignored (rabbitmqadmin
sends ``name``, ``vhost`` and friends along with every declare).

List endpoints share ``paginate_objects``: ``sort``/``sort_reverse`` always apply,
``name`` filters (substring, or regex with ``use_regex=true``), and with
``page`` the answer becomes RabbitMQ's paged envelope (``items``,
``page_count``, ``filtered_count``...). ``columns`` keeps only the named
(dotted) fields. Long lists (queues, exchanges) hand it their objects and a
renderer, so the filter, a sort by name and the paging run on the objects and
only the page is rendered.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from aiohttp import web

from broker import errors, jsonbody
from broker.auth.names import name_problem
from broker.auth.sasl import http_credentials
from broker.auth.throttle import TooManyFailures, check_login
from broker.auth.users import User, UserStore
from broker.http.state import Mgmt
from broker.model.publish_api import Origin
from broker.patterns import PatternError, compile_pattern

if TYPE_CHECKING:
    from broker.views import ConnectionView

log = logging.getLogger(__name__)

MGMT_TAGS = frozenset({"administrator", "monitoring", "management", "policymaker"})
MAX_PAGE_SIZE = 500
MAX_BODY = 64 * 1024 * 1024  # definitions of a large broker fit; aiohttp refuses anything bigger
REALM = 'Basic realm="Skred Management"'

MGMT_KEY: web.AppKey[Mgmt] = web.AppKey("mgmt", Mgmt)
USER_KEY = "skred_user"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


class ApiError(Exception):
    def __init__(self, status: int, error: str, reason: str, challenge: bool = True) -> None:
        super().__init__(reason)
        self.status = status
        self.error = error
        self.reason = reason
        self.challenge = challenge  # a 401 asks for credentials (WWW-Authenticate)


def not_found(reason: str = "Not Found") -> ApiError:
    return ApiError(404, "Object Not Found", reason)


def bad_request(reason: str) -> ApiError:
    return ApiError(400, "bad_request", reason)


def forbidden(reason: str) -> ApiError:
    """A privilege refusal: 401 as RabbitMQ answers it, with no credentials challenge."""
    return ApiError(401, "not_authorized", reason, challenge=False)


# A request passed on to the worker or node that answers it (``shards/fanout.py`` across workers,
# ``http/forward.py`` across nodes) takes these of its headers, and its answer brings these back
# to the client: ONE pair of lists, so the two hops cannot drift apart. Retry-After is a client's
# pause after a busy 503 (the records budget, ``routes_stream_records``; the Spark reader honours
# it), WWW-Authenticate its challenge, Location where a created object is.
PASSED_ON: Final = ("Authorization", "Content-Type", "Accept")
PASSED_BACK: Final = ("Content-Type", "Location", "WWW-Authenticate", "Retry-After")
_PASSED_BACK = {h.lower(): h for h in PASSED_BACK}


def passed_back(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The headers of an answer passed back to the client (names matched in any case, as HTTP
    says, and written as ``PASSED_BACK`` spells them)."""
    return {_PASSED_BACK[k.lower()]: v for k, v in headers if k.lower() in _PASSED_BACK}


def error_response(status: int, error: str, reason: str, challenge: bool = True) -> web.Response:
    resp = web.json_response({"error": error, "reason": reason}, status=status)
    if status == 401 and challenge:
        resp.headers["WWW-Authenticate"] = REALM
    return resp


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.error, exc.reason, exc.challenge)
    except errors.AMQPError as exc:
        status = errors.http_status(exc)
        status = 401 if status == 403 else status  # RabbitMQ's API answers a refusal 401
        error = {404: "Object Not Found", 400: "bad_request", 401: "not_authorized"}.get(status, "error")
        return error_response(status, error, exc.reply_text, challenge=False)
    except ValueError as exc:  # the model's word for an argument it cannot take (a name, a value)
        return error_response(400, "bad_request", str(exc))
    except web.HTTPNotFound:
        return error_response(404, "Object Not Found", "Not Found")
    except web.HTTPMethodNotAllowed as exc:
        resp = error_response(405, "method_not_allowed", f"{request.method} is not allowed here")
        resp.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
        return resp
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, "bad_request", "request body too large")
    except (errors.DiskFull, OSError) as exc:
        if not errors.no_space(exc):
            raise
        # The stores changed nothing (a definition or JSON file is written before memory).
        log.warning("disk full: %s %s refused", request.method, request.path)
        return error_response(503, "disk_full", "disk full: nothing was changed")


async def authenticate(request: web.Request, need_tags: bool = True) -> User:
    """The request's user, after this source's login throttle (``broker.auth.throttle``): basic
    auth, or an OAuth 2 access token as ``Authorization: Bearer`` (``broker.auth.oauth``)."""
    return await login_of(request, request.app[MGMT_KEY].broker.users, need_tags)


async def login_of(request: web.Request, users: UserStore, need_tags: bool = True) -> User:
    """``authenticate`` against ``users`` (a follower's replicated users file: routes_app.py);
    ``need_tags=False`` takes a user without management tags (AMQP's rule: see ``RECORD_ROUTES``)."""
    creds = http_credentials(request.headers.get("Authorization", ""))
    if creds is None:
        raise ApiError(401, "not_authorized", "Login failed")
    name, secret, bearer = creds
    try:
        user = await check_login(users, name, secret, request.remote or "", "HTTP", bearer=bearer)
    except TooManyFailures:
        raise ApiError(429, "too_many_requests", "Too many failed logins from this address; retry later") \
            from None
    if user is None:
        raise ApiError(401, "not_authorized", "Login failed")
    if need_tags and not MGMT_TAGS & set(user.tags):
        raise ApiError(401, "not_authorized", "Not management user")
    return user


# read before a login: the UI's login settings, and its code-for-token relay (http/routes_oauth.py)
UNAUTHENTICATED = frozenset({"/api/auth", "/api/oauth/token"})
# routes that are a client protocol, not management: any user may log in, and the handler
# checks the AMQP permission the same operation needs (routes_stream_records.py: read)
RECORDS_PATH = "/api/streams/{vhost}/{name}/records"
RECORD_ROUTES = frozenset({RECORDS_PATH})  # as a route's canonical path


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if (request.path.startswith("/api/") and request.path not in UNAUTHENTICATED) \
            or request.path.startswith("/metrics"):
        route = request.match_info.route.resource
        need_tags = route is None or route.canonical not in RECORD_ROUTES
        request[USER_KEY] = await authenticate(request, need_tags)
    return await handler(request)


# ------------------------------------------------------------------ privileges
def user_of(request: web.Request) -> User:
    user: User = request[USER_KEY]
    return user


def origin_of(request: web.Request) -> Origin:
    """The user of a management request as firehose copies name a client (its publishes and
    gets: RabbitMQ traces the management API's too)."""
    return Origin(request.app[MGMT_KEY].node_name, user_of(request).name, f"HTTP {request.remote}", 0)


def is_admin(user: User) -> bool:
    return "administrator" in user.tags


def sees_all(user: User) -> bool:
    """Administrators and monitoring users see every vhost, connection and channel."""
    return bool({"administrator", "monitoring"} & set(user.tags))


def require_admin(request: web.Request) -> User:
    user = user_of(request)
    if not is_admin(user):
        raise forbidden("Not administrator user")
    return user


def require_monitor(request: web.Request) -> User:
    user = user_of(request)
    if not sees_all(user):
        raise forbidden("Not monitor user")
    return user


def can_see_vhost(request: web.Request, vhost: str) -> bool:
    user = user_of(request)
    return sees_all(user) or request.app[MGMT_KEY].broker.users.has_vhost_access(user, vhost)


def visible_sessions(request: web.Request) -> list[ConnectionView]:
    """Every connection for administrators and monitoring users; a user's own otherwise."""
    user = user_of(request)
    sessions = [s for s in request.app[MGMT_KEY].connections() if s.vhost]
    if sees_all(user):
        return sessions
    return [s for s in sessions if s.username == user.name]


def close_session(request: web.Request, session: ConnectionView) -> web.Response:
    """``DELETE`` of a connection: its own user or an administrator closes it, with the
    ``X-Reason`` header as the reason."""
    user = user_of(request)
    if not is_admin(user) and session.username != user.name:
        raise forbidden("Not administrator user")
    reason = request.headers.get("X-Reason", "Closed via management plugin")
    request.app[MGMT_KEY].close_connection(session, reason)
    return no_content()


def check_perm(request: web.Request, kind: str, vhost: str, resource: str) -> None:
    """The AMQP permission the same action would need (configure/write/read)."""
    users = request.app[MGMT_KEY].broker.users
    user = user_of(request)
    check = {"configure": users.can_configure, "write": users.can_write, "read": users.can_read}[kind]
    if not check(user, vhost, resource):
        raise forbidden(f"access to '{resource or 'amq.default'}' in vhost '{vhost}' refused "
                        f"for user '{user.name}' ({kind})")


# ------------------------------------------------------------ durability
async def committed(mgmt: Mgmt) -> None:
    """Return once the group commit covered what this request changed: fsynced and, in a
    cluster, acked by every in-sync follower. A durable declare or a definitions import is
    answered only then, as a durable declare is over AMQP (``broker/syncer.py``)."""
    synced: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def done(ok: bool) -> None:
        if not synced.done():  # the client may have gone (the handler was cancelled)
            synced.set_result(ok)

    mgmt.broker.syncer.after_sync(done)
    if not await synced:
        raise ApiError(503, "not_durable", "the change was made, but the sync that makes it durable "
                       "failed; see the broker log")


# ------------------------------------------------------------ names and bodies
def check_name(kind: str, name: str) -> str:
    problem = name_problem(kind, name)
    if problem is not None:
        raise bad_request(problem)
    # Names never become file paths (the store hashes them), but a '.'/'..' path segment in a
    # name is a traversal attempt or a client bug; refuse it rather than store it.
    if any(part in (".", "..") for part in name.split("/")):
        raise bad_request(f"{kind} name must not contain '.' or '..' path segments")
    return name


def match(request: web.Request, key: str) -> str:
    return request.match_info[key]


def vhost_param(request: web.Request, key: str = "vhost", listed: bool = False) -> str:
    """The vhost named in the path; 404 when it does not exist, 401 when the user may not use it.
    ``listed``: for the shared state about a vhost (permissions), any vhost in the node's vhost
    list counts, open here or not (a shard served by another node or worker)."""
    name = request.match_info[key]
    mgmt = request.app[MGMT_KEY]
    if name not in mgmt.broker.vhosts and not (listed and mgmt.vhost_store.exists(name)):
        raise not_found(f"vhost '{name}' not found")
    if not can_see_vhost(request, name):
        raise forbidden(f"access to vhost '{name}' refused for user '{user_of(request).name}'")
    return name


async def json_body(request: web.Request, *, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The request body as a JSON object (empty body: {}); 400 on anything else. Fields the
    caller does not read are ignored, as RabbitMQ ignores them."""
    raw = await request.read()
    if not raw.strip():
        body: Any = {}
    else:
        try:
            body = jsonbody.loads(raw)
        except jsonbody.JSONBodyError as exc:
            raise bad_request(str(exc)) from None
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    missing = [k for k in required if k not in body]
    if missing:
        raise bad_request(f"missing fields: {', '.join(missing)}")
    return body


def get_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return bool(value == "true")
    raise bad_request(f"'{key}' must be a boolean")


def get_str(body: dict[str, Any], key: str, default: str = "") -> str:
    value = body.get(key, default)
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string")
    return value


def get_int(body: dict[str, Any], key: str, default: int, lo: int = 0, hi: int = 1 << 31) -> int:
    value = body.get(key, default)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise bad_request(f"'{key}' must be an integer between {lo} and {hi}")
    return value


def get_args(body: dict[str, Any], key: str = "arguments") -> dict[str, Any]:
    value = body.get(key) or {}
    if not isinstance(value, dict):
        raise bad_request(f"'{key}' must be a JSON object")
    return value


# -------------------------------------------------------------------- paging
def _lookup(item: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(item, dict):
            return None
        item = item.get(part)
    return item


def _sort_key(value: Any) -> tuple[int, Any]:
    if value is None:
        return (0, 0)
    if isinstance(value, bool | int | float):
        return (1, value)
    return (2, str(value))


def _columns(items: list[dict[str, Any]], columns: str) -> list[dict[str, Any]]:
    wanted = [c.strip() for c in columns.split(",") if c.strip()]
    out = []
    for item in items:
        picked: dict[str, Any] = {}
        for col in wanted:
            value = _lookup(item, col)
            target = picked
            parts = col.split(".")
            for part in parts[:-1]:
                target = target.setdefault(part, {})
            target[parts[-1]] = value
        out.append(picked)
    return out


def paginate(request: web.Request, items: list[dict[str, Any]]) -> web.Response:
    """``paginate_objects`` for items that are rendered already."""
    return paginate_objects(request, items, _same, _item_name, {})


def _same(item: dict[str, Any]) -> dict[str, Any]:
    return item


def _item_name(item: dict[str, Any]) -> str:
    return str(item.get("name", ""))


def paginate_objects(request: web.Request, objects: Sequence[T], render: Callable[[T], dict[str, Any]],
                     name: Callable[[T], str], keys: Mapping[str, Callable[[T], Any]]) -> web.Response:
    """A list endpoint's answer: the ``name`` filter (substring, or ``use_regex``), ``sort``,
    ``columns`` and ``page``/``page_size`` applied to ``objects``, each ``render``ed to its JSON.

    The filter takes ``name(obj)`` and a sort by one of ``keys`` takes the object's own value,
    so both run before anything is rendered and a page renders only its own items (a page of
    10,000 queues renders 50 of them). Sorting by any other field renders the filtered objects
    first."""
    q = request.query
    total = len(objects)
    pattern = q.get("name")
    if pattern:
        if q.get("use_regex", "false").lower() == "true":
            try:
                rx = compile_pattern(pattern)
            except PatternError as exc:
                raise bad_request(f"invalid name regex: {exc}") from None
            objects = [o for o in objects if rx.search(name(o))]
        else:
            low = pattern.lower()
            objects = [o for o in objects if low in name(o).lower()]
    rendered: list[dict[str, Any]] | None = None
    sort = q.get("sort")
    if sort:
        reverse = q.get("sort_reverse", "false").lower() == "true"
        key = keys.get(sort)
        if key is not None:
            objects = sorted(objects, key=lambda o: _sort_key(key(o)), reverse=reverse)
        else:
            rendered = sorted((render(o) for o in objects), key=lambda i: _sort_key(_lookup(i, sort)),
                              reverse=reverse)
    if "page" not in q:
        items = rendered if rendered is not None else [render(o) for o in objects]
        return web.json_response(_columns(items, q["columns"]) if "columns" in q else items)
    try:
        page = int(q["page"])
        page_size = int(q.get("page_size", "100"))
    except ValueError:
        raise bad_request("page and page_size must be integers") from None
    if page < 1 or page_size < 1:
        raise bad_request("page and page_size must be at least 1")
    if page_size > MAX_PAGE_SIZE:
        raise bad_request(f"page_size must be at most {MAX_PAGE_SIZE}")
    filtered = len(objects) if rendered is None else len(rendered)
    page_count = max(1, math.ceil(filtered / page_size))
    if page > page_count:
        raise bad_request(f"page {page} is out of range (page_count {page_count})")
    lo, hi = (page - 1) * page_size, page * page_size
    chunk = rendered[lo:hi] if rendered is not None else [render(o) for o in objects[lo:hi]]
    if "columns" in q:
        chunk = _columns(chunk, q["columns"])
    return web.json_response({
        "filtered_count": filtered, "item_count": len(chunk), "items": chunk, "page": page,
        "page_count": page_count, "page_size": page_size, "total_count": total,
    })


def no_content() -> web.Response:
    return web.Response(status=204)


def created() -> web.Response:
    return web.Response(status=201)
