"""LMQ's HTTP API (default port 9980), as the LMQ README specifies it.

``POST /messages/:name`` puts (answers ``{"accum": "no"|"new"|"yes"}``), ``GET /messages/:name``
takes (``t=`` seconds to wait, none: wait until a message comes; 204 when the wait ran out;
``cf=multipart|msgpack`` for compound messages), ``POST /messages/:name/:id?reply=ack|nack|ext``
(204, or 404 for an unknown or expired id), ``GET|POST /messages?qre=REGEX`` take from any / put
to every matching queue, ``DELETE /queues/:name``, and ``/properties`` (the default rules) and
``/properties/:name`` (one queue's). With ``[lmq] auth`` on, every request needs HTTP basic auth
of a broker user with read and write permission on the LMQ vhost.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from broker.aio import any_segment
from broker.auth.sasl import basic_credentials
from broker.auth.throttle import TooManyFailures
from broker.auth.users import UserStore
from broker.lmq.engine import LMQ, LMQError, Message, Peer, admitted, client_address
from broker.lmq.props import PropsError, validate, validate_defaults

log = logging.getLogger(__name__)

LMQ_KEY: web.AppKey[LMQ] = web.AppKey("lmq", LMQ)
AUTH_KEY: web.AppKey[UserStore | None] = web.AppKey("lmq_auth", object)  # type: ignore[arg-type]
PEERS_KEY: web.AppKey[Mapping[Peer, Peer]] = web.AppKey("lmq_peers", object)  # type: ignore[arg-type]
MAX_BODY = 128 * 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except LMQError as exc:
        return _error(exc.status, exc.reason)
    except PropsError as exc:
        return _error(400, str(exc))
    except web.HTTPException as exc:
        if exc.status >= 400:
            return _error(exc.status, exc.reason)
        raise


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    users = request.app[AUTH_KEY]
    if users is not None:
        creds = basic_credentials(request.headers.get("Authorization", ""))
        vhost = request.app[LMQ_KEY].vhost.name
        source = client_address(request.app[PEERS_KEY], request.transport)
        try:
            ok = creds is not None and await admitted(users, *creds, source, vhost, "LMQ HTTP")
        except TooManyFailures:
            return _error(429, "too many failed logins from this address; retry later")
        if not ok:
            resp = _error(401, "login failed")
            resp.headers["WWW-Authenticate"] = 'Basic realm="Skred LMQ"'
            return resp
    return await handler(request)


def _timeout(request: web.Request) -> float | None:
    raw = request.query.get("t")
    if raw is None:
        return None
    try:
        t = float(raw)
    except ValueError:
        raise LMQError(400, "t must be a number of seconds") from None
    if not 0 <= t <= 86400:
        raise LMQError(400, "t must be between 0 and 86400 seconds")
    return t


def _format(request: web.Request) -> str:
    cf = request.query.get("cf", "multipart")
    if cf not in ("multipart", "msgpack"):
        raise LMQError(400, "cf must be multipart or msgpack")
    return cf


def _multipart(boundary: str, parts: list[tuple[dict[str, str], bytes]]) -> bytes:
    out: list[bytes] = []
    for meta, body in parts:
        out.append(f"\r\n--{boundary}\r\n".encode())
        for key, value in meta.items():
            out.append(f"{key}: {value}\r\n".encode())
        out.append(b"content-transfer-encoding: binary\r\n\r\n")
        out.append(body)
    out.append(f"\r\n--{boundary}--\r\n".encode())
    return b"".join(out)


def _response(msg: Message | None, cf: str) -> web.Response:
    if msg is None:
        return web.Response(status=204)
    headers = {"x-lmq-queue-name": msg.queue, "x-lmq-message-id": msg.id,
               "x-lmq-message-type": "compound" if msg.compound else "normal",
               "x-lmq-retry-remaining": str(msg.retry_remaining)}
    if not msg.compound:
        headers["Content-Type"] = msg.content_type
        return web.Response(body=msg.body, headers=headers)
    if cf == "msgpack":
        headers["Content-Type"] = "application/x-msgpack"
        return web.Response(body=msg.body, headers=headers)
    headers["Content-Type"] = f"multipart/mixed; boundary={msg.id}"
    return web.Response(body=_multipart(msg.id, msg.parts()), headers=headers)


async def get_message(request: web.Request) -> web.Response:
    lmq = request.app[LMQ_KEY]
    name = request.match_info["name"]
    timeout, cf = _timeout(request), _format(request)
    q = lmq.ensure(name)  # created on first use, as LMQ does
    return _response(await lmq.take(lambda: [q], timeout), cf)


async def post_message(request: web.Request) -> web.Response:
    lmq = request.app[LMQ_KEY]
    body = await request.read()
    flag = await lmq.put(request.match_info["name"], body, request.headers.get("Content-Type"))
    return web.json_response({"accum": flag})


async def get_any(request: web.Request) -> web.Response:
    lmq = request.app[LMQ_KEY]
    regex = _regex(request)
    timeout, cf = _timeout(request), _format(request)
    lmq.matching(regex)  # a bad regex is a 400 before any wait
    return _response(await lmq.take(lambda: lmq.matching(regex), timeout), cf)


async def post_all(request: web.Request) -> web.Response:
    lmq = request.app[LMQ_KEY]
    regex = _regex(request)
    body = await request.read()
    content_type = request.headers.get("Content-Type")
    out: dict[str, Any] = {}
    for q in lmq.matching(regex):
        out[q.name] = {"accum": await lmq.put(q.name, body, content_type)}
    return web.json_response(out)


def _regex(request: web.Request) -> str:
    regex = request.query.get("qre")
    if not regex:
        raise LMQError(400, "qre (a regular expression of queue names) is required")
    return regex


async def reply(request: web.Request) -> web.Response:
    lmq = request.app[LMQ_KEY]
    name, msg_id = request.match_info["name"], request.match_info["id"]
    kind = request.query.get("reply")
    if kind == "ack":
        lmq.ack(name, msg_id)
    elif kind == "nack":
        lmq.nack(name, msg_id)
    elif kind == "ext":
        lmq.extend(name, msg_id)
    else:
        raise LMQError(400, "reply must be ack, nack or ext")
    return web.Response(status=204)


async def delete_queue(request: web.Request) -> web.Response:
    request.app[LMQ_KEY].delete(request.match_info["name"])
    return web.Response(status=204)


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise LMQError(400, f"body is not valid JSON: {exc}") from None


async def get_defaults(request: web.Request) -> web.Response:
    return web.json_response(request.app[LMQ_KEY].props.defaults)


async def put_defaults(request: web.Request) -> web.Response:
    request.app[LMQ_KEY].props.set_defaults(validate_defaults(await _json(request)))
    return web.Response(status=204)


async def delete_defaults(request: web.Request) -> web.Response:
    request.app[LMQ_KEY].props.set_defaults([])
    return web.Response(status=204)


async def get_props(request: web.Request) -> web.Response:
    return web.json_response(request.app[LMQ_KEY].props.resolve(request.match_info["name"]))


async def patch_props(request: web.Request) -> web.Response:
    lmq = request.app[LMQ_KEY]
    name = request.match_info["name"]
    props = validate(await _json(request))
    lmq.ensure(name)
    lmq.props.update_queue(name, props)
    return web.Response(status=204)


async def delete_props(request: web.Request) -> web.Response:
    request.app[LMQ_KEY].props.reset_queue(request.match_info["name"])
    return web.Response(status=204)


def build_app(lmq: LMQ, users: UserStore | None, peers: Mapping[Peer, Peer]) -> web.Application:
    app = web.Application(middlewares=[errors_middleware, auth_middleware], client_max_size=MAX_BODY)
    app[LMQ_KEY] = lmq
    app[AUTH_KEY] = users
    app[PEERS_KEY] = peers
    r = app.router
    r.add_get("/messages", get_any)
    r.add_post("/messages", post_all)
    r.add_get(any_segment("/messages/{name}"), get_message)
    r.add_post(any_segment("/messages/{name}"), post_message)
    r.add_post(any_segment("/messages/{name}/{id}"), reply)
    r.add_delete(any_segment("/queues/{name}"), delete_queue)
    r.add_get("/properties", get_defaults)
    r.add_put("/properties", put_defaults)
    r.add_delete("/properties", delete_defaults)
    r.add_get(any_segment("/properties/{name}"), get_props)
    r.add_patch(any_segment("/properties/{name}"), patch_props)
    r.add_delete(any_segment("/properties/{name}"), delete_props)
    return app
