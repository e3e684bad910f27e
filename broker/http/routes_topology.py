"""Exchanges, queues and bindings: list, get, declare, delete, publish, get messages, purge."""

from __future__ import annotations

import base64
import binascii
import datetime
import errno
import struct
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pamqp import commands

from broker import errors, properties
from broker.http import history_api
from broker.http.common import (
    MGMT_KEY,
    bad_request,
    can_see_vhost,
    check_name,
    check_perm,
    committed,
    created,
    error_response,
    forbidden,
    get_args,
    get_bool,
    get_int,
    get_str,
    json_body,
    no_content,
    not_found,
    origin_of,
    paginate,
    paginate_objects,
    user_of,
    vhost_param,
    visible_sessions,
)
from broker.http.render import (
    PROPERTY_FIELDS,
    binding_json,
    every_consumer_json,
    exchange_json,
    payload_json,
    properties_json,
    queue_json,
    vhost_bindings,
)
from broker.model import trace
from broker.model.exchange import EXCHANGE_TYPES, Exchange
from broker.model.publish import PublishRequest
from broker.model.queue import Queue
from broker.model.vhost import VHost

routes = web.RouteTableDef()

DEFAULT_EXCHANGE_ALIAS = "amq.default"  # how the management API names the default exchange in URLs


def _vh(request: web.Request) -> VHost:
    return request.app[MGMT_KEY].broker.vhosts[vhost_param(request)]


def _exchange_name(request: web.Request, key: str = "name") -> str:
    name = request.match_info[key]
    return "" if name == DEFAULT_EXCHANGE_ALIAS else name


def _exchange(request: web.Request, vh: VHost, key: str = "name") -> Exchange:
    ex = vh.exchanges.get(_exchange_name(request, key))
    if ex is None:
        raise not_found()
    return ex


def _queue(request: web.Request, vh: VHost, key: str = "name") -> Queue:
    q = vh.queues.get(request.match_info[key])
    if q is None:
        raise not_found()
    return q


def _visible_vhosts(request: web.Request) -> list[VHost]:
    mgmt = request.app[MGMT_KEY]
    return [vh for name, vh in sorted(mgmt.broker.vhosts.items()) if can_see_vhost(request, name)]


# ------------------------------------------------------------------ exchanges
@routes.get("/api/exchanges")
async def exchanges(request: web.Request) -> web.Response:
    return _exchange_page(request, [(vh.name, ex) for vh in _visible_vhosts(request)
                                    for ex in vh.exchanges.values()])


@routes.get("/api/exchanges/{vhost}")
async def vhost_exchanges(request: web.Request) -> web.Response:
    vh = _vh(request)
    return _exchange_page(request, [(vh.name, ex) for ex in vh.exchanges.values()])


_EXCHANGE_KEYS: dict[str, Callable[[tuple[str, Exchange]], Any]] = {
    "name": lambda e: e[1].name, "vhost": lambda e: e[0]}


def _exchange_page(request: web.Request, exchanges: list[tuple[str, Exchange]]) -> web.Response:
    """Filtered, sorted and paged before rendering: only the page is rendered."""
    mgmt = request.app[MGMT_KEY]
    return paginate_objects(request, exchanges, lambda e: exchange_json(mgmt, e[0], e[1]),
                            lambda e: e[1].name, _EXCHANGE_KEYS)


@routes.get("/api/exchanges/{vhost}/{name}")
async def exchange(request: web.Request) -> web.Response:
    vh = _vh(request)
    ex = _exchange(request, vh)
    out = exchange_json(request.app[MGMT_KEY], vh.name, ex)
    history_api.exchange(request, out, ex)
    return web.json_response(out)


@routes.put("/api/exchanges/{vhost}/{name}")
async def put_exchange(request: web.Request) -> web.Response:
    vh = _vh(request)
    name = check_name("exchange", request.match_info["name"])
    body = await json_body(request, required=("type",))
    type_ = get_str(body, "type")
    if type_ not in EXCHANGE_TYPES:
        raise bad_request(f"unknown exchange type '{type_}'")
    durable = get_bool(body, "durable", True)
    auto_delete = get_bool(body, "auto_delete", False)
    internal = get_bool(body, "internal", False)
    arguments = get_args(body)
    check_perm(request, "configure", vh.name, name)
    existed = name in vh.exchanges
    vh.declare_exchange(name, type_, durable=durable, auto_delete=auto_delete, internal=internal,
                        arguments=arguments)
    if durable and not existed:
        await committed(request.app[MGMT_KEY])  # as exchange.declare-ok: after the group commit
    return no_content() if existed else created()


@routes.delete("/api/exchanges/{vhost}/{name}")
async def delete_exchange(request: web.Request) -> web.Response:
    vh = _vh(request)
    ex = _exchange(request, vh)
    check_perm(request, "configure", vh.name, ex.name)
    vh.delete_exchange(ex.name, if_unused=request.query.get("if-unused") == "true")
    return no_content()


@routes.get("/api/exchanges/{vhost}/{name}/bindings/source")
async def exchange_bindings_source(request: web.Request) -> web.Response:
    vh = _vh(request)
    ex = _exchange(request, vh)
    return paginate(request, [binding_json(vh.name, ex.name, d, rk, a) for d, rk, a in ex.bindings()])


@routes.get("/api/exchanges/{vhost}/{name}/bindings/destination")
async def exchange_bindings_destination(request: web.Request) -> web.Response:
    vh = _vh(request)
    ex = _exchange(request, vh)
    return paginate(request, [b for b in vhost_bindings(vh)
                              if b["destination_type"] == "exchange" and b["destination"] == ex.name])


def _properties(raw: Any) -> commands.Basic.Properties:
    if not isinstance(raw, dict):
        raise bad_request("'properties' must be a JSON object")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        field = PROPERTY_FIELDS.get(key)
        if field is None:
            raise bad_request(f"unknown message property '{key}'")
        if field == "timestamp" and isinstance(value, int):
            value = datetime.datetime.fromtimestamp(value, datetime.UTC)
        kwargs[field] = value
    try:
        props = commands.Basic.Properties(**kwargs)
        properties.encode(props)
    except (TypeError, ValueError, struct.error) as exc:
        raise bad_request(f"invalid message properties: {exc}") from None
    return props


@routes.post("/api/exchanges/{vhost}/{name}/publish")
async def publish(request: web.Request) -> web.Response:
    vh = _vh(request)
    ex = _exchange(request, vh)
    body = await json_body(request, required=("properties", "routing_key", "payload", "payload_encoding"))
    routing_key = get_str(body, "routing_key")
    if len(routing_key.encode()) > 255:
        raise bad_request("routing_key is longer than 255 bytes")
    encoding = get_str(body, "payload_encoding")
    payload = get_str(body, "payload")
    if encoding == "string":
        data = payload.encode("utf-8")
    elif encoding == "base64":
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise bad_request("payload is not valid base64") from None
    else:
        raise bad_request("payload_encoding must be 'string' or 'base64'")
    props = _properties(body["properties"])
    props_bytes = properties.encode(props)
    problem = properties.problem(props_bytes)
    if problem is not None:
        raise bad_request(f"invalid message properties: {problem}")
    if ex.internal:
        raise forbidden(f"cannot publish to internal exchange '{ex.name}'")
    check_perm(request, "write", vh.name, ex.name)
    _check_topic(request, vh.name, ex, routing_key, "write")
    broker = request.app[MGMT_KEY].broker
    broker.stats.published += 1
    broker.stats.sizes.observe(len(data))
    try:
        out = vh.publish(PublishRequest(ex.name, routing_key, props_bytes, data, int(time.time() * 1000),
                                        props.delivery_mode == 2, origin=origin_of(request)))
    except errors.AMQPError as exc:  # e.g. an expiration that is not a number
        raise bad_request(exc.text) from None
    except (errors.DiskFull, OSError) as exc:
        if not isinstance(exc, errors.DiskFull) and exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # as for an AMQP publisher: the disk alarm goes on at once, the message is refused
        broker.alarm.disk_full(len(data), broker.connections)
        return error_response(503, "disk_full", "disk full: message not stored")
    queues = out.queues
    if out.unroutable:
        broker.stats.unroutable += 1
        vh.n_unroutable += 1
    return web.json_response({"routed": bool(queues)})


# --------------------------------------------------------------------- queues
@routes.get("/api/queues")
async def queues(request: web.Request) -> web.Response:
    return _queue_page(request, [q for vh in _visible_vhosts(request) for q in vh.queues.values()])


@routes.get("/api/queues/{vhost}")
async def vhost_queues(request: web.Request) -> web.Response:
    return _queue_page(request, list(_vh(request).queues.values()))


# Sorts the UI's queue columns offer, on the queue's own values (as queue_json renders them), so
# sorting 10,000 queues by depth renders one page, not every queue.
_QUEUE_KEYS: dict[str, Callable[[Queue], Any]] = {
    "name": lambda q: q.name, "vhost": lambda q: q.vhost,
    "messages_ready": lambda q: q.message_count,
    "messages_unacknowledged": lambda q: q.store.unacked_count,
    "messages": lambda q: q.message_count + q.store.unacked_count,
    "consumers": lambda q: len(q.consumers)}


def _queue_page(request: web.Request, queues: list[Queue]) -> web.Response:
    """Filtered, sorted and paged before rendering: a page of 10,000 queues renders its own."""
    mgmt = request.app[MGMT_KEY]
    return paginate_objects(request, queues, lambda q: queue_json(mgmt, q), lambda q: q.name, _QUEUE_KEYS)


@routes.get("/api/queues/{vhost}/{name}")
async def queue(request: web.Request) -> web.Response:
    vh = _vh(request)
    mgmt = request.app[MGMT_KEY]
    q = _queue(request, vh)
    out = queue_json(mgmt, q)
    history_api.queue(request, out, q)
    visible = set(map(id, visible_sessions(request)))
    out["consumer_details"] = [c for c in every_consumer_json(mgmt, lambda s: id(s) in visible)
                               if c["queue"] == {"name": q.name, "vhost": q.vhost}]
    return web.json_response(out)


@routes.put("/api/queues/{vhost}/{name}")
async def put_queue(request: web.Request) -> web.Response:
    vh = _vh(request)
    name = check_name("queue", request.match_info["name"])
    body = await json_body(request)
    durable = get_bool(body, "durable", True)
    auto_delete = get_bool(body, "auto_delete", False)
    arguments = get_args(body)
    qtype = body.get("type")  # RabbitMQ's own field; x-queue-type in the arguments wins
    if qtype is not None and "x-queue-type" not in arguments:
        arguments["x-queue-type"] = qtype
    check_perm(request, "configure", vh.name, name)
    _q, was_created = vh.declare_queue(name, durable=durable, auto_delete=auto_delete,
                                       arguments=arguments, owner=None)
    if durable and was_created:
        await committed(request.app[MGMT_KEY])  # as queue.declare-ok: after the group commit
    return created() if was_created else no_content()


@routes.delete("/api/queues/{vhost}/{name}")
async def delete_queue(request: web.Request) -> web.Response:
    vh = _vh(request)
    q = _queue(request, vh)
    check_perm(request, "configure", vh.name, q.name)
    vh.delete_queue(q.name, if_unused=request.query.get("if-unused") == "true",
                    if_empty=request.query.get("if-empty") == "true", owner=q.exclusive_owner)
    return no_content()


@routes.delete("/api/queues/{vhost}/{name}/contents")
async def purge_queue(request: web.Request) -> web.Response:
    vh = _vh(request)
    q = _queue(request, vh)
    check_perm(request, "read", vh.name, q.name)
    q.purge()
    return no_content()


@routes.put("/api/queues/{vhost}/{name}/pause")
async def pause_queue(request: web.Request) -> web.Response:
    """LavinMQ's pause: deliveries stop, publishes go on; durable once answered."""
    return await _set_paused(request, True)


@routes.put("/api/queues/{vhost}/{name}/resume")
async def resume_queue(request: web.Request) -> web.Response:
    return await _set_paused(request, False)


async def _set_paused(request: web.Request, paused: bool) -> web.Response:
    vh = _vh(request)
    q = _queue(request, vh)
    check_perm(request, "configure", vh.name, q.name)
    vh.pause_queue(q.name, paused)
    if q.durable:
        await committed(request.app[MGMT_KEY])  # the state is in the log (and on the followers)
    return no_content()


@routes.put("/api/queues/{vhost}/{name}/restart")
async def restart_queue(request: web.Request) -> web.Response:
    """LavinMQ's restart: the queue's store closed and opened again from its files."""
    vh = _vh(request)
    q = _queue(request, vh)
    check_perm(request, "configure", vh.name, q.name)
    vh.restart_queue(q.name)
    return no_content()


@routes.get("/api/queues/{vhost}/{name}/bindings")
async def queue_bindings(request: web.Request) -> web.Response:
    vh = _vh(request)
    q = _queue(request, vh)
    return paginate(request, [b for b in vhost_bindings(vh)
                              if b["destination_type"] == "queue" and b["destination"] == q.name])


ACK_MODES = ("ack_requeue_true", "ack_requeue_false", "reject_requeue_true", "reject_requeue_false")


@routes.post("/api/queues/{vhost}/{name}/get")
async def get_messages(request: web.Request) -> web.Response:
    vh = _vh(request)
    q = _queue(request, vh)
    body = await json_body(request, required=("count", "ackmode", "encoding"))
    count = get_int(body, "count", 1, 1, 10_000)
    ackmode = get_str(body, "ackmode")
    if ackmode not in ACK_MODES:
        raise bad_request(f"ackmode must be one of {', '.join(ACK_MODES)}")
    encoding = get_str(body, "encoding")
    if encoding not in ("auto", "base64"):
        raise bad_request("encoding must be 'auto' or 'base64'")
    truncate = get_int(body, "truncate", 0, 0, 1 << 31) if "truncate" in body else None
    check_perm(request, "read", vh.name, q.name)
    taken = []
    for _ in range(count):
        got = q.get()
        if got is None:
            break
        taken.append((got, q.message_count))  # as RabbitMQ: the count left after this one
    out = []
    for (_msgid, exchange_b, rk, props, payload, redelivered), remaining in taken:
        shown = payload[:truncate] if truncate is not None else payload
        out.append({
            "payload_bytes": len(payload),
            "redelivered": redelivered,
            "exchange": exchange_b.decode(errors="replace"),
            "routing_key": rk.decode(errors="replace"),
            "message_count": remaining,
            "properties": properties_json(props),
            **payload_json(shown, encoding),
        })
    # Settle after taking them all, so a requeued message is not fetched twice in one request.
    requeue = ackmode.endswith("_true")
    stats = request.app[MGMT_KEY].broker.stats
    stats.delivered += len(taken)
    stats.gets += len(taken)  # RabbitMQ: the management plugin's basic.get (manual ack)
    if vh.meta.tracing:  # firehose: each is a delivery (deliver.<queue>)
        who, now = origin_of(request), int(time.time() * 1000)
        for (_msgid, exchange_b, rk, props, payload, redelivered), _remaining in taken:
            trace.delivered(vh, who, q.name, exchange_b, rk, props, payload, redelivered, now)
    for (msgid, *_rest), _remaining in taken:
        if requeue:
            q.reject(msgid, True)
        else:
            q.ack(msgid)
    return web.json_response(out)


# ------------------------------------------------------------------- bindings
@routes.get("/api/bindings")
async def bindings(request: web.Request) -> web.Response:
    return paginate(request, [b for vh in _visible_vhosts(request) for b in vhost_bindings(vh)])


@routes.get("/api/bindings/{vhost}")
async def vhost_bindings_route(request: web.Request) -> web.Response:
    return paginate(request, vhost_bindings(_vh(request)))


def _ends(request: web.Request) -> tuple[VHost, Exchange, Exchange | Queue]:
    vh = _vh(request)
    source = _exchange(request, vh, "source")
    kind = request.match_info["kind"]
    dest: Exchange | Queue
    if kind == "q":
        dest = _queue(request, vh, "dest")
    elif kind == "e":
        dest = _exchange(request, vh, "dest")
    else:
        raise not_found()
    return vh, source, dest


def _pair_bindings(vh: VHost, source: Exchange, dest: Exchange | Queue) -> list[dict[str, Any]]:
    return [binding_json(vh.name, source.name, d, rk, a) for d, rk, a in source.bindings() if d is dest]


@routes.get("/api/bindings/{vhost}/e/{source}/{kind:[qe]}/{dest}")
async def pair_bindings(request: web.Request) -> web.Response:
    vh, source, dest = _ends(request)
    return paginate(request, _pair_bindings(vh, source, dest))


@routes.post("/api/bindings/{vhost}/e/{source}/{kind:[qe]}/{dest}")
async def create_binding(request: web.Request) -> web.Response:
    vh, source, dest = _ends(request)
    body = await json_body(request)
    routing_key = get_str(body, "routing_key")
    if len(routing_key.encode()) > 255:
        raise bad_request("routing_key is longer than 255 bytes")
    arguments = get_args(body)
    check_perm(request, "write", vh.name, dest.name)
    check_perm(request, "read", vh.name, source.name)
    _check_topic(request, vh.name, source, routing_key, "read")
    if isinstance(dest, Queue):
        vh.bind_queue(dest.name, source.name, routing_key, arguments, owner=dest.exclusive_owner)
    else:
        vh.bind_exchange(dest.name, source.name, routing_key, arguments)
    resp = created()
    resp.headers["Location"] = binding_json(vh.name, source.name, dest, routing_key, arguments)[
        "properties_key"]
    return resp


def _check_topic(request: web.Request, vhost: str, ex: Exchange, routing_key: str, action: str) -> None:
    """The topic authorisation AMQP applies (``Session._topic_checked``): on a topic exchange, a
    user's topic permission must let the routing key through (401 here, as every refusal)."""
    users = request.app[MGMT_KEY].broker.users
    user = user_of(request)
    if ex.type == "topic" and not users.topic_allows(user, vhost, ex.name, action, routing_key):
        raise forbidden(f"access to topic '{routing_key}' in exchange '{ex.name}' in vhost '{vhost}' "
                        f"refused for user '{user.name}'")


def _find_binding(request: web.Request) -> tuple[VHost, Exchange, Exchange | Queue, dict[str, Any]]:
    vh, source, dest = _ends(request)
    props = request.match_info["props"]
    for b in _pair_bindings(vh, source, dest):
        key = b["properties_key"]
        if props in (key, urllib.parse.unquote(key)):
            return vh, source, dest, b
    raise not_found()


@routes.get("/api/bindings/{vhost}/e/{source}/{kind:[qe]}/{dest}/{props}")
async def binding(request: web.Request) -> web.Response:
    return web.json_response(_find_binding(request)[3])


@routes.delete("/api/bindings/{vhost}/e/{source}/{kind:[qe]}/{dest}/{props}")
async def delete_binding(request: web.Request) -> web.Response:
    vh, source, dest, b = _find_binding(request)
    check_perm(request, "write", vh.name, dest.name)
    check_perm(request, "read", vh.name, source.name)
    _check_topic(request, vh.name, source, b["routing_key"], "read")
    # Unbind with the model's own argument dict (JSON rendering may have changed value types).
    args = next(a for d, rk, a in source.bindings() if d is dest and rk == b["routing_key"]
                and binding_json(vh.name, source.name, d, rk, a)["properties_key"] == b["properties_key"])
    if isinstance(dest, Queue):
        vh.unbind_queue(dest.name, source.name, b["routing_key"], args, owner=dest.exclusive_owner)
    else:
        vh.unbind_exchange(dest.name, source.name, b["routing_key"], args)
    return no_content()
