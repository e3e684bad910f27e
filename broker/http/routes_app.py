"""Stopping and starting the node's messaging side (``skredctl stop_app``/``start_app``).

``PUT /api/broker/stop`` and ``PUT /api/broker/start`` are LavinMQ's paths (its lavinmqctl
calls them; 204, administrators only). Stop closes every client listener and connection (each
with its protocol's close) and leaves the management API, the data and, in a cluster, the
node's membership as they are: RabbitMQ's ``stop_app``. Both are idempotent, as RabbitMQ's are:
stopping a stopped app is done. With several workers each worker stops its own listeners and
the request reaches every worker (``broker/shards/fanout.py``); a follower answers on its metrics
port (``follower_routes``). ``/api/overview`` says ``app_running``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from broker.auth.users import UserStore
from broker.http.common import (
    MGMT_KEY,
    ApiError,
    error_response,
    is_admin,
    login_of,
    no_content,
    require_admin,
)
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


# ---------------------------------------------------------------- on a cluster follower
# A follower runs no broker and its HTTP port is the leader's, so its own metrics port takes
# these two (and a short overview saying whether its app runs), for administrators of the
# replicated users file, behind the same login throttle as every login.
def follower_routes(control: Callable[[], AppControl | None], users: Callable[[], UserStore | None],
                    node_name: Callable[[], str]) -> Callable[[web.Application], None]:
    async def login(request: web.Request, admin: bool) -> web.Response | None:
        """None for a user who may, else the refusal (as the management API's own)."""
        store = users()
        if store is None:
            return error_response(503, "unavailable", "not synced with the leader yet")
        try:
            user = await login_of(request, store)
        except ApiError as exc:
            return error_response(exc.status, exc.error, exc.reason, exc.challenge)
        if admin and not is_admin(user):
            return error_response(401, "not_authorized", "Not administrator user", challenge=False)
        return None

    def switch(stop: bool) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            refused = await login(request, admin=True)
            if refused is not None:
                return refused
            app = control()
            if app is None:
                return error_response(501, "not_implemented", "this node cannot stop or start its app")
            await (app.stop_app() if stop else app.start_app())
            return no_content()
        return handler

    async def overview(request: web.Request) -> web.Response:
        refused = await login(request, admin=False)
        if refused is not None:
            return refused
        app = control()
        return web.json_response({"node": node_name(), "product_name": "Skred", "role": "follower",
                                  "app_running": app is None or app.app_running, "listeners": []})

    def add(app: web.Application) -> None:
        app.router.add_put("/api/broker/stop", switch(True))
        app.router.add_put("/api/broker/start", switch(False))
        app.router.add_get("/api/overview", overview)
    return add
