"""The management HTTP application (API + authenticated /metrics) and the open metrics listener.

``MgmtServer.start()`` sets up the management application and returns its
protocol factory: the node opens the management listeners with it (plain
``[mgmt] port`` and HTTPS ``[mgmt] tls_port``, with PROXY-header support: see
``broker.net.listener``) and records their addresses on ``Mgmt``. ``start``
also binds the Prometheus port (``[mgmt] metrics_bind/metrics_port``) and
starts the rate sampler; ``stop()`` closes everything. Failing to bind a
management or metrics port is fatal (an operator asked for it): ``ListenError``
names the option, and the node exits instead of running without a listener.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from broker import jsonbody
from broker.aio import any_segment
from broker.errors import ListenError
from broker.http import definitions, ui, websocket
from broker.http.common import (
    MAX_BODY,
    MGMT_KEY,
    auth_middleware,
    bad_request,
    committed,
    error_middleware,
    no_content,
    require_admin,
    require_monitor,
    vhost_param,
)
from broker.http.routes_access import routes as access_routes
from broker.http.routes_app import routes as app_routes
from broker.http.routes_federation import routes as federation_routes
from broker.http.routes_grants import routes as grant_routes
from broker.http.routes_health import routes as health_routes
from broker.http.routes_mqtt import routes as mqtt_routes
from broker.http.routes_node import routes as node_routes
from broker.http.routes_oauth import routes as oauth_routes
from broker.http.routes_shovels import routes as shovel_routes
from broker.http.routes_stream_protocol import routes as stream_protocol_routes
from broker.http.routes_stream_records import routes as stream_record_routes
from broker.http.routes_streams import routes as stream_routes
from broker.http.routes_topology import routes as topology_routes
from broker.http.state import Mgmt
from broker.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)

METRICS_KEY: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)


# ---------------------------------------------------------------- definitions
def _definitions_response(request: web.Request, doc: dict[str, Any]) -> web.Response:
    resp = web.json_response(doc, dumps=lambda d: json.dumps(d, indent=2))
    download = request.query.get("download")
    if download:
        safe = "".join(c for c in download if c.isalnum() or c in "._-") or "definitions.json"
        resp.headers["Content-Disposition"] = f'attachment; filename="{safe}"'
    return resp


async def _import(request: web.Request, vhost: str | None) -> web.Response:
    raw = await request.read()
    try:
        doc = jsonbody.loads(raw)
    except jsonbody.JSONBodyError as exc:
        raise bad_request(str(exc)) from None
    mgmt = request.app[MGMT_KEY]
    try:
        await definitions.import_definitions_async(mgmt, doc, vhost)
    except definitions.DefinitionsError as exc:
        raise bad_request(str(exc)) from None
    await committed(mgmt)  # fsynced and acked by every in-sync follower, like a durable declare
    return no_content()


async def get_definitions(request: web.Request) -> web.Response:
    require_admin(request)
    return _definitions_response(request, definitions.export(request.app[MGMT_KEY]))


async def post_definitions(request: web.Request) -> web.Response:
    require_admin(request)
    return await _import(request, None)


async def get_vhost_definitions(request: web.Request) -> web.Response:
    require_admin(request)
    return _definitions_response(request, definitions.export(request.app[MGMT_KEY], vhost_param(request)))


async def post_vhost_definitions(request: web.Request) -> web.Response:
    require_admin(request)
    return await _import(request, vhost_param(request))


# -------------------------------------------------------------------- metrics
async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].render(), headers={"Content-Type": CONTENT_TYPE})


async def metrics_detailed(request: web.Request) -> web.Response:
    families = request.query.getall("family", [])
    vhosts = request.query.getall("vhost", [])
    body = request.app[METRICS_KEY].render_detailed(families, vhosts)  # unknown families left out
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def metrics_per_object(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].render_per_object(),
                        headers={"Content-Type": CONTENT_TYPE})


async def mgmt_metrics_per_object(request: web.Request) -> web.Response:
    require_monitor(request)
    return await metrics_per_object(request)


async def mgmt_metrics(request: web.Request) -> web.Response:
    # On the management port /metrics needs a monitoring (or administrator) user.
    require_monitor(request)
    return await metrics(request)


async def mgmt_metrics_detailed(request: web.Request) -> web.Response:
    require_monitor(request)
    return await metrics_detailed(request)


# ----------------------------------------------------------------------- apps
@web.middleware
async def websocket_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """A WebSocket upgrade on any path is AMQP or MQTT (``broker/http/websocket.py``); the
    protocol inside authenticates as on its own port."""
    if not websocket.wants_websocket(request):
        response: web.StreamResponse = await handler(request)
        return response
    mgmt = request.app[MGMT_KEY]
    kind = websocket.choose(request, mgmt.websocket_protocols)
    if kind is None:
        raise bad_request("no protocol this broker serves over WebSocket was asked for (amqp, mqtt)")
    return await websocket.serve(request, kind, mgmt.websocket_protocols[kind], mgmt.websocket_max_message)


def build_app(mgmt: Mgmt, metrics_obj: Metrics) -> web.Application:
    app = web.Application(middlewares=[ui.no_browser_login_dialog, error_middleware, websocket_middleware,
                                       auth_middleware, *mgmt.middlewares], client_max_size=MAX_BODY)
    app[MGMT_KEY] = mgmt
    app[METRICS_KEY] = metrics_obj
    ui.add_routes(app)  # the web UI: "/" and its static files under /ui/
    app.router.add_get("/api/definitions", get_definitions)
    app.router.add_post("/api/definitions", post_definitions)
    app.router.add_get(any_segment("/api/definitions/{vhost}"), get_vhost_definitions)
    app.router.add_post(any_segment("/api/definitions/{vhost}"), post_vhost_definitions)
    app.router.add_get("/metrics", mgmt_metrics)
    app.router.add_get("/metrics/detailed", mgmt_metrics_detailed)
    app.router.add_get("/metrics/per-object", mgmt_metrics_per_object)
    # health: /api/health/checks/*; grants: topic permissions, user limits, global parameters;
    # streams: GET /api/streams/{vhost}/{queue}/messages and .../records (the Spark source's read)
    for table in (node_routes, health_routes, topology_routes, access_routes, grant_routes, stream_routes,
                  stream_record_routes,
                  oauth_routes, federation_routes, shovel_routes, mqtt_routes,
                  stream_protocol_routes, app_routes):
        _add_routes(app, table)
    return app


def _add_routes(app: web.Application, table: web.RouteTableDef) -> None:
    """``app.add_routes(table)``, with names in the path free to hold any character
    (``broker.aio.any_segment``: RabbitMQ's queue and exchange names)."""
    for route in table:
        if isinstance(route, web.RouteDef):
            route = web.RouteDef(route.method, any_segment(route.path), route.handler, route.kwargs)
        route.register(app.router)


def build_metrics_app(mgmt: Mgmt, metrics_obj: Metrics) -> web.Application:
    app = web.Application(middlewares=[error_middleware, *mgmt.metrics_middlewares])
    app[MGMT_KEY] = mgmt
    app[METRICS_KEY] = metrics_obj
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/metrics/detailed", metrics_detailed)
    app.router.add_get("/metrics/per-object", metrics_per_object)
    return app


def _bound(site: web.TCPSite) -> tuple[str, int]:
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    addr = sockets[0].getsockname()
    return str(addr[0]), int(addr[1])


class MgmtServer:
    def __init__(self, mgmt: Mgmt) -> None:
        self.mgmt = mgmt
        self.metrics = Metrics(mgmt)
        self._runners: list[web.AppRunner] = []
        self.reuse_port = False  # one of several workers on the node's ports (broker/shards)

    async def _serve(self, app: web.Application, host: str, port: int) -> tuple[str, int]:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=self.reuse_port or None)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runners.append(runner)
        return _bound(site)

    async def start(self, metrics_bind: str, metrics_port: int | None) -> Callable[[], Any]:
        """Set up the management app and the metrics port; returns the app's protocol factory."""
        mgmt = self.mgmt
        runner = web.AppRunner(build_app(mgmt, self.metrics), access_log=None, handle_signals=False)
        await runner.setup()
        self._runners.append(runner)
        assert runner.server is not None
        if metrics_port is not None:
            try:
                mgmt.metrics_address = await self._serve(build_metrics_app(mgmt, self.metrics),
                                                         metrics_bind, metrics_port)
            except OSError as exc:
                await self.stop_runners()
                raise ListenError("mgmt.metrics_bind/mgmt.metrics_port, --mgmt-metrics-bind/"
                                  "--mgmt-metrics-port", metrics_bind, metrics_port, exc) from None
        mgmt.rates.start()
        return runner.server

    async def start_private_metrics(self) -> tuple[str, int]:
        """The metrics app on a loopback port of this process's own (a worker's, broker/shards)."""
        return await self._serve(build_metrics_app(self.mgmt, self.metrics), "127.0.0.1", 0)

    async def stop(self) -> None:
        await self.mgmt.rates.stop()
        await self.stop_runners()

    async def stop_runners(self) -> None:
        runners, self._runners = self._runners, []
        for runner in runners:
            await runner.cleanup()
