"""LMQ's HTTP API (default port 9980), as the LMQ README specifies it.

``POST /messages/:name`` puts (answers ``{"accum": "no"|"new"|"yes"}``), ``GET /messages/:name``
takes (``t=`` seconds to wait, none: wait until a message comes; 204 when the wait ran out;
``cf=multipart|msgpack`` for compound messages), ``POST /messages/:name/:id?reply=ack|nack|ext``
(204, or 404 for an unknown or expired id), ``GET|POST /messages?qre=REGEX`` take from any / put
to every matching queue, ``DELETE /queues/:name``, and ``/properties`` (the default rules) and
``/properties/:name`` (one queue's).

Every request logs in with HTTP basic auth as a broker user (``[lmq] auth``, on by default; off:
a request without credentials acts as ``[lmq] anonymous_user``), and each operation needs the
AMQP permission ``broker.lmq.access`` maps it to (403 without it).

Errors: every refusal is a 4xx with a JSON body ``{"error": reason}``: LMQ's own (``LMQError``),
the model's (``errors.AMQPError``, through the one mapping ``errors.http_status``: a reserved
``amq.*`` name 403, another connection's exclusive queue 405...), bad properties, patterns and
JSON 400, a body over ``max_message_size`` 413. Anything else is a bug: logged once, answered
500 without a traceback. Limits: a body is admitted through the broker's memory gate (the one
AMQP bodies pass) before it is read, must arrive within ``[lmq] request_timeout`` (408), and a
connection with no request in progress for that long is closed (``broker.aio.RequestDeadline``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from broker import errors, jsonbody
from broker.aio import AnswerAfterEOF, RequestDeadline, any_segment
from broker.auth.sasl import http_credentials
from broker.auth.throttle import TooManyFailures
from broker.lmq.access import Access, Refused, anonymous
from broker.lmq.engine import LMQ, LMQError, Message, client_address, login
from broker.lmq.limits import Settings, admitted_bytes
from broker.lmq.props import PropsError, validate, validate_defaults

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


LMQ_KEY: web.AppKey[LMQ] = web.AppKey("lmq", LMQ)
SETTINGS_KEY: web.AppKey[Settings] = web.AppKey("lmq_settings", Settings)
ACCESS = "lmq_access"


def _error(status: int, reason: str) -> web.Response:
    resp = web.json_response({"error": reason}, status=status)
    if status == 401:
        resp.headers["WWW-Authenticate"] = 'Basic realm="Skred LMQ"'
    return resp


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place refusals become statuses (see the module's docstring)."""
    try:
        return await handler(request)
    except (LMQError, Refused) as exc:
        return _error(exc.status, exc.reason)
    except errors.AMQPError as exc:
        return _error(errors.http_status(exc), exc.reply_text)
    except (PropsError, jsonbody.JSONBodyError) as exc:
        return _error(400, str(exc))
    except ValueError as exc:  # the model's word for an argument it cannot take (a name, a value)
        return _error(400, str(exc))
    except web.HTTPRequestEntityTooLarge as exc:
        return _error(413, exc.text or "request body too large")
    except web.HTTPException as exc:
        if exc.status >= 400:
            resp = _error(exc.status, exc.reason)
            if exc.status == 405 and "Allow" in exc.headers:
                resp.headers["Allow"] = exc.headers["Allow"]
            return resp
        raise
    except errors.DiskFull:
        return _error(503, "disk full: nothing was stored")
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:  # a bug: the client gets a 500 without internals, the log gets the traceback
        log.exception("LMQ HTTP %s %s failed", request.method, request.path)
        return _error(500, "internal error (logged by the broker)")


@web.middleware
async def deadline_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Marks the request in progress for the connection's idle deadline."""
    proto = request.transport.get_protocol() if request.transport is not None else None
    if not isinstance(proto, RequestDeadline):
        return await handler(request)
    proto.started()
    try:
        return await handler(request)
    finally:
        proto.finished()


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    cfg = request.app[SETTINGS_KEY]
    vhost = request.app[LMQ_KEY].vhost.name
    source = client_address(cfg.peers, request.transport)
    creds = http_credentials(request.headers.get("Authorization", ""))  # Basic, or Bearer (a token)
    try:
        if creds is not None:
            who = await login(cfg.users, creds[0], creds[1], source, vhost, "LMQ HTTP", bearer=creds[2])
        elif cfg.auth:
            raise Refused(401, "login required (HTTP basic auth or an OAuth 2 bearer token)")
        else:
            who = anonymous(cfg.users, cfg.anonymous_user, source, vhost)
    except TooManyFailures:
        return _error(429, "too many failed logins from this address; retry later")
    request[ACCESS] = who
    return await handler(request)


def _who(request: web.Request) -> Access:
    who: Access = request[ACCESS]
    return who


def _alive(request: web.Request) -> Callable[[], bool]:
    """While the client is there: its connection open and not shut for sending (a client that
    half-closes after its request still gets one check's answer, at once)."""
    transport = request.transport
    proto = transport.get_protocol() if transport is not None else None
    return lambda: (transport is not None and not transport.is_closing()
                    and not (isinstance(proto, AnswerAfterEOF) and proto.eof))


async def _body(request: web.Request) -> bytes:
    """The request body, within the size limit, admitted by the memory gate, and arrived within
    the request timeout."""
    lmq, cfg = request.app[LMQ_KEY], request.app[SETTINGS_KEY]
    size = request.content_length
    if size is not None and size > lmq.max_message_size:
        raise LMQError(413, f"body of {size} bytes is larger than max_message_size "
                            f"({lmq.max_message_size} bytes)")
    async with admitted_bytes(cfg.gate, size or 0, cfg.request_timeout):
        try:
            async with asyncio.timeout(cfg.request_timeout):
                return await request.read()
        except TimeoutError:
            raise LMQError(408, f"the body did not arrive within {cfg.request_timeout:g} s") from None


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
    timeout, cf = _timeout(request), _format(request)
    msg = await lmq.take(request.match_info["name"], timeout, _who(request), _alive(request))
    return _response(msg, cf)


async def post_message(request: web.Request) -> web.Response:
    lmq = request.app[LMQ_KEY]
    body = await _body(request)
    flag = await lmq.put(request.match_info["name"], body, request.headers.get("Content-Type"),
                         _who(request))
    return web.json_response({"accum": flag})


async def get_any(request: web.Request) -> web.Response:
    lmq = request.app[LMQ_KEY]
    regex = _regex(request)
    timeout, cf = _timeout(request), _format(request)
    return _response(await lmq.take_any(regex, timeout, _who(request), _alive(request)), cf)


async def post_all(request: web.Request) -> web.Response:
    lmq = request.app[LMQ_KEY]
    who = _who(request)
    matcher = lmq.matcher(_regex(request), who)  # a bad pattern is a 400 before the body is read
    who.write()
    body = await _body(request)
    content_type = request.headers.get("Content-Type")
    out: dict[str, Any] = {}
    for q in await matcher.queues():
        out[q.name] = {"accum": await lmq.put(q.name, body, content_type, who)}
    return web.json_response(out)


def _regex(request: web.Request) -> str:
    regex = request.query.get("qre")
    if not regex:
        raise LMQError(400, "qre (a regular expression of queue names) is required")
    return regex


async def reply(request: web.Request) -> web.Response:
    kind = request.query.get("reply")
    if kind not in ("ack", "nack", "ext"):
        raise LMQError(400, "reply must be ack, nack or ext")
    request.app[LMQ_KEY].settle(kind, request.match_info["name"], request.match_info["id"], _who(request))
    return web.Response(status=204)


async def delete_queue(request: web.Request) -> web.Response:
    request.app[LMQ_KEY].delete(request.match_info["name"], _who(request))
    return web.Response(status=204)


async def _json(request: web.Request) -> Any:
    return jsonbody.loads(await _body(request))


async def get_defaults(request: web.Request) -> web.Response:
    return web.json_response(request.app[LMQ_KEY].props.defaults)


async def put_defaults(request: web.Request) -> web.Response:
    _who(request).set_policy()
    request.app[LMQ_KEY].props.set_defaults(validate_defaults(await _json(request)))
    return web.Response(status=204)


async def delete_defaults(request: web.Request) -> web.Response:
    _who(request).set_policy()
    request.app[LMQ_KEY].props.set_defaults([])
    return web.Response(status=204)


async def get_props(request: web.Request) -> web.Response:
    return web.json_response(request.app[LMQ_KEY].props.resolve(request.match_info["name"]))


async def patch_props(request: web.Request) -> web.Response:
    lmq, who = request.app[LMQ_KEY], _who(request)
    name = request.match_info["name"]
    who.configure(name)
    props = validate(await _json(request))
    lmq.ensure(name, who)
    lmq.props.update_queue(name, props)
    return web.Response(status=204)


async def delete_props(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    _who(request).configure(name)
    request.app[LMQ_KEY].props.reset_queue(name)
    return web.Response(status=204)


def build_app(lmq: LMQ, settings: Settings) -> web.Application:
    # aiohttp refuses a body over client_max_size itself (413) when it comes without a length
    app = web.Application(middlewares=[errors_middleware, deadline_middleware, auth_middleware],
                          client_max_size=lmq.max_message_size)
    app[LMQ_KEY] = lmq
    app[SETTINGS_KEY] = settings
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
