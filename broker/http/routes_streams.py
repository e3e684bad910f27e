"""Reading a stream queue over the management API: N messages from an offset, as JSON.

Theory of operation
-------------------
``GET /api/streams/{vhost}/{queue}/messages?offset=N&count=M`` is a read-only look at the log:
it positions a private ``StreamPosition`` (``StreamStore.seek``: a binary search over the
segment index plus a walk of one segment) and reads up to ``count`` records with
``read_next``. Nothing is consumed, no consumer offset is stored and no delivery is
counted, so it can be repeated and it never disturbs AMQP consumers. The start is an
integer offset (clamped to the retained range, like ``x-stream-offset``), ``first``,
``last`` or ``next``, or ``timestamp=MS`` (first message appended at or after it).

The answer carries the retained range (``first_offset``, ``next_offset``) so a client pages
with ``offset = last returned offset + 1``. Payloads are UTF-8 strings when they decode
(``encoding=auto``) else base64 (always with ``encoding=base64``); ``truncate`` caps the
payload bytes shown. Every request reads at most ``MAX_COUNT`` messages and stops after
``MAX_BYTES`` of payload (at least one message is returned), so a handler never holds the
event loop for long.

Authorisation is the management API's (basic auth via the middleware, the vhost must be
visible to the user) plus the AMQP ``read`` permission on the queue, as for
``POST /api/queues/{vhost}/{queue}/get``.
"""

from __future__ import annotations

from typing import Any, Final

from aiohttp import web

from broker.http.common import (
    MGMT_KEY,
    bad_request,
    check_name,
    check_perm,
    committed,
    created,
    get_args,
    get_int,
    json_body,
    no_content,
    not_found,
    vhost_param,
)
from broker.http.render import payload_json, properties_json
from broker.model import superstream
from broker.model.stream import StreamQueue, named_offset
from broker.model.vhost import VHost

routes = web.RouteTableDef()

MAX_COUNT: Final = 10_000
DEFAULT_COUNT: Final = 100
MAX_BYTES: Final = 16 << 20  # payload bytes per answer (the rest: ask again from the next offset)


def int_param(request: web.Request, key: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"'{key}' must be an integer") from None
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be between {lo} and {hi}")
    return value


def start_offset(request: web.Request, q: StreamQueue) -> int:
    s = q.stream
    if "timestamp" in request.query:
        if "offset" in request.query:
            raise bad_request("give either 'offset' or 'timestamp', not both")
        return s.offset_for_timestamp(int_param(request, "timestamp", 0, 0, 1 << 62))
    named = named_offset(s, request.query.get("offset", "first").strip().lower())
    return named if named is not None else int_param(request, "offset", 0, 0, 1 << 62)


def readable_stream(request: web.Request) -> tuple[str, str, StreamQueue]:
    """(vhost, name, stream) of the URL, which the user may read (``basic.consume``'s
    permission); 404 without such a queue, 401 without the permission, 400 if not a stream."""
    vhost = vhost_param(request)
    vh = request.app[MGMT_KEY].broker.vhosts[vhost]
    name = request.match_info["name"]
    q = vh.queues.get(name)
    if q is None:
        raise not_found(f"no queue '{name}' in vhost '{vhost}'")
    check_perm(request, "read", vhost, name)
    if not isinstance(q, StreamQueue):
        raise bad_request(f"queue '{name}' in vhost '{vhost}' is not a stream")
    return vhost, name, q


@routes.get("/api/streams/{vhost}/{name}/messages")
async def stream_messages(request: web.Request) -> web.Response:
    vhost, name, q = readable_stream(request)
    count = int_param(request, "count", DEFAULT_COUNT, 1, MAX_COUNT)
    encoding = request.query.get("encoding", "auto")
    if encoding not in ("auto", "base64"):
        raise bad_request("encoding must be 'auto' or 'base64'")
    truncate = int_param(request, "truncate", -1, 0, 1 << 31) if "truncate" in request.query else None
    store = q.stream
    pos = store.seek(start_offset(request, q))
    out: list[dict[str, Any]] = []
    shown_bytes = 0
    while len(out) < count and (not out or shown_bytes < MAX_BYTES):
        rec = store.read_next(pos)
        if rec is None:
            break
        offset, ts, exchange, routing_key, props, body = rec
        shown = body[:truncate] if truncate is not None else body
        shown_bytes += len(shown)
        out.append({
            "offset": offset,
            "timestamp": ts,
            "exchange": exchange.decode(errors="replace"),
            "routing_key": routing_key.decode(errors="replace"),
            "properties": properties_json(props),
            "payload_bytes": len(body),
            **payload_json(shown, encoding),
        })
    return web.json_response({
        "vhost": vhost, "queue": name,
        "first_offset": store.first_offset, "next_offset": store.next_offset,
        "messages": out,
    })


# ------------------------------------------------------------------ super streams
# ``PUT /api/super-streams/{vhost}/{name}`` with ``{"partitions": N}`` or ``{"binding_keys":
# [...]}`` (and optional stream ``arguments``) creates one (broker/model/superstream.py); on an
# existing super stream it grows it: a larger ``partitions`` adds the numbered partitions past
# the last, ``binding_keys`` adds those keys' partitions. ``DELETE`` removes the exchange and
# every partition; ``GET`` lists the partitions in order with their binding keys. ``"routing":
# "hash"`` at creation routes AMQP publishes by MurmurHash3 of the routing key.

def _super_plan(body: dict[str, Any]) -> tuple[int, list[str]]:
    parts = get_int(body, "partitions", 0, 0, superstream.MAX_PARTITIONS)
    keys = body.get("binding_keys", [])
    if isinstance(keys, str):
        keys = [k.strip() for k in keys.split(",") if k.strip()]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise bad_request("'binding_keys' must be a list of strings")
    if bool(parts) == bool(keys):
        raise bad_request("give either 'partitions' or 'binding_keys'")
    return parts, keys


def _existing_super_stream(request: web.Request) -> tuple[str, VHost, str]:
    """(vhost name, vhost, super stream name) of the URL; 404 unless it names a super stream."""
    vhost = vhost_param(request)
    vh = request.app[MGMT_KEY].broker.vhosts[vhost]
    name = request.match_info["name"]
    if not superstream.is_super_stream(vh, name):
        raise not_found(f"no super stream '{name}' in vhost '{vhost}'")
    return vhost, vh, name


@routes.get("/api/super-streams/{vhost}/{name}")
async def get_super_stream(request: web.Request) -> web.Response:
    vhost, vh, name = _existing_super_stream(request)
    bound = superstream.bindings(vh, name)
    routing = vh.exchanges[name].arguments.get(superstream.ROUTING_ARG, "key")
    return web.json_response({"vhost": vhost, "name": name, "partitions": [p for p, _ in bound],
                              "binding_keys": [k for _, k in bound], "routing": routing})


@routes.put("/api/super-streams/{vhost}/{name}")
async def put_super_stream(request: web.Request) -> web.Response:
    vhost = vhost_param(request)
    vh = request.app[MGMT_KEY].broker.vhosts[vhost]
    name = check_name("exchange", request.match_info["name"])
    body = await json_body(request)
    parts, keys = _super_plan(body)
    arguments = get_args(body)
    routing = body.get("routing", "key")
    if routing not in ("key", "hash"):
        raise bad_request("'routing' must be 'key' or 'hash'")
    exists = superstream.is_super_stream(vh, name)
    try:
        plan = superstream.layout(name, parts, keys) if not exists or keys else \
            superstream.layout(name, parts)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    for resource in [name, *(p for p, _ in plan)]:
        check_perm(request, "configure", vhost, resource)
    try:
        if not exists:
            superstream.create(vh, name, parts, keys, arguments, routing)
        elif parts and parts == len(superstream.partitions(vh, name)):
            return no_content()
        else:
            superstream.grow(vh, name, parts, keys, arguments)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    await committed(request.app[MGMT_KEY])
    return created() if not exists else no_content()


@routes.delete("/api/super-streams/{vhost}/{name}")
async def delete_super_stream(request: web.Request) -> web.Response:
    vhost, vh, name = _existing_super_stream(request)
    for resource in [name, *superstream.partitions(vh, name)]:
        check_perm(request, "configure", vhost, resource)
    superstream.delete(vh, name)
    await committed(request.app[MGMT_KEY])
    return no_content()
