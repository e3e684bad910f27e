"""The stream protocol's connections, publishers and consumers as RabbitMQ's stream management
plugin (``rabbitmq_stream_management``) serves them.

Paths, as RabbitMQ's:

* ``GET /api/stream/connections`` (and ``/{vhost}``): the stream connections, each shaped as in
  ``/api/connections``; ``GET`` / ``DELETE /api/stream/connections/{vhost}/{name}`` one of them
  (``DELETE`` closes it, the ``X-Reason`` header as the reason), found by its name as
  ``/api/connections`` names it; ``.../{name}/publishers`` and ``.../{name}/consumers`` its
  publishers and subscriptions.
* ``GET /api/stream/publishers`` (``/{vhost}``, ``/{vhost}/{stream}``): every publisher with
  ``publisher_id``, ``reference``, ``published``, ``confirmed``, ``errored``.
* ``GET /api/stream/consumers`` (``/{vhost}``): every subscription with ``subscription_id``,
  ``credits`` (chunks it may still be sent), ``consumed``, ``offset`` (after the last message
  sent), ``offset_lag`` (messages stored past it), ``properties``, ``active`` and ``activity_status``.

Publishers and consumers carry ``queue`` (``name``, ``vhost``) and ``connection_details``
(``name``, ``user``, ``node``, ``peer_host``, ``peer_port``). Visibility is that of
connections (``visible_sessions``): administrators and monitoring users see every one, other
users their own. The front end offering them is a ``views.StreamEntitiesView``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web

from broker.http.common import (
    MGMT_KEY,
    close_session,
    not_found,
    paginate,
    vhost_param,
    visible_sessions,
)
from broker.http.render import connection_json
from broker.views import ConnectionView, FrontEndView, StreamEntitiesView

routes = web.RouteTableDef()


def _front_ends(request: web.Request) -> list[FrontEndView]:
    """The stream protocol's front ends (those that offer its publishers and consumers)."""
    return [fe for fe in request.app[MGMT_KEY].front_ends if isinstance(fe, StreamEntitiesView)]


def _stream_sessions(request: web.Request, vhost: str | None = None) -> list[ConnectionView]:
    ours = {id(c) for fe in _front_ends(request) for c in fe.open_connections()}
    return [s for s in visible_sessions(request) if id(s) in ours and (vhost is None or s.vhost == vhost)]


def _entities(request: web.Request, kind: str, sessions: list[ConnectionView],
              stream: str | None = None) -> list[dict[str, Any]]:
    mgmt = request.app[MGMT_KEY]
    shown = {id(s) for s in sessions}
    out: list[dict[str, Any]] = []
    for fe in _front_ends(request):
        assert isinstance(fe, StreamEntitiesView)
        found: Iterable[tuple[ConnectionView, dict[str, Any]]] = (
            fe.stream_publishers() if kind == "publishers" else fe.stream_consumers())
        for s, info in found:
            if id(s) not in shown or (stream is not None and info["stream"] != stream):
                continue
            entry = {k: v for k, v in info.items() if k != "stream"}
            entry["queue"] = {"name": info["stream"], "vhost": s.vhost}
            entry["connection_details"] = {"name": mgmt.connection_name(s), "user": s.username,
                                           "node": mgmt.node_name, "peer_host": s.peer[0],
                                           "peer_port": s.peer[1]}
            out.append(entry)
    return out


def _connection(request: web.Request) -> ConnectionView:
    vhost = vhost_param(request)
    session = request.app[MGMT_KEY].find_connection(request.match_info["name"])
    if session is None or session not in _stream_sessions(request, vhost):
        raise not_found(f"no stream connection '{request.match_info['name']}' in vhost '{vhost}'")
    return session


@routes.get("/api/stream/connections")
async def stream_connections(request: web.Request) -> web.Response:
    mgmt = request.app[MGMT_KEY]
    return paginate(request, [connection_json(mgmt, s) for s in _stream_sessions(request)])


@routes.get("/api/stream/connections/{vhost}")
async def vhost_stream_connections(request: web.Request) -> web.Response:
    mgmt = request.app[MGMT_KEY]
    vhost = vhost_param(request)
    return paginate(request, [connection_json(mgmt, s) for s in _stream_sessions(request, vhost)])


@routes.get("/api/stream/connections/{vhost}/{name}")
async def stream_connection(request: web.Request) -> web.Response:
    return web.json_response(connection_json(request.app[MGMT_KEY], _connection(request)))


@routes.delete("/api/stream/connections/{vhost}/{name}")
async def close_stream_connection(request: web.Request) -> web.Response:
    return close_session(request, _connection(request))


@routes.get("/api/stream/connections/{vhost}/{name}/publishers")
async def stream_connection_publishers(request: web.Request) -> web.Response:
    return paginate(request, _entities(request, "publishers", [_connection(request)]))


@routes.get("/api/stream/connections/{vhost}/{name}/consumers")
async def stream_connection_consumers(request: web.Request) -> web.Response:
    return paginate(request, _entities(request, "consumers", [_connection(request)]))


def _listing(request: web.Request, kind: str) -> web.Response:
    """Every publisher or consumer, or those of the path's vhost."""
    vhost = vhost_param(request) if "vhost" in request.match_info else None
    return paginate(request, _entities(request, kind, _stream_sessions(request, vhost)))


@routes.get("/api/stream/publishers")
@routes.get("/api/stream/publishers/{vhost}")
async def stream_publishers(request: web.Request) -> web.Response:
    return _listing(request, "publishers")


@routes.get("/api/stream/publishers/{vhost}/{stream}")
async def stream_publishers_of(request: web.Request) -> web.Response:
    vhost = vhost_param(request)
    stream = request.match_info["stream"]
    if stream not in request.app[MGMT_KEY].broker.vhosts[vhost].queues:
        raise not_found(f"no stream '{stream}' in vhost '{vhost}'")
    return paginate(request, _entities(request, "publishers", _stream_sessions(request, vhost), stream))


@routes.get("/api/stream/consumers")
@routes.get("/api/stream/consumers/{vhost}")
async def stream_consumers(request: web.Request) -> web.Response:
    return _listing(request, "consumers")
