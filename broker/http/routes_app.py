"""Stopping and starting the node's messaging side (``skredctl stop_app``/``start_app``).

``PUT /api/broker/stop`` and ``PUT /api/broker/start`` are LavinMQ's paths (its lavinmqctl
calls them; 204, administrators only). Stop closes every client listener and connection (each
with its protocol's close) and leaves the management API, the data and, in a cluster, the
node's membership as they are: RabbitMQ's ``stop_app``. Both are idempotent, as RabbitMQ's are:
stopping a stopped app is done. A node that cannot do it (several workers) answers 501 and does
nothing; ``/api/overview`` says ``app_running``.
"""

from __future__ import annotations

from aiohttp import web

from broker.http.common import MGMT_KEY, ApiError, no_content, require_admin
from broker.http.state import AppControl

routes = web.RouteTableDef()


def _app(request: web.Request) -> AppControl:
    app = request.app[MGMT_KEY].app
    if app is None:
        raise ApiError(501, "not_implemented", "this node cannot stop or start its app alone")
    return app


@routes.put("/api/broker/stop")
async def stop_app(request: web.Request) -> web.Response:
    require_admin(request)
    await _app(request).stop_app()
    return no_content()


@routes.put("/api/broker/start")
async def start_app(request: web.Request) -> web.Response:
    require_admin(request)
    await _app(request).start_app()
    return no_content()
