"""MQTT sessions in the management API (the UI's MQTT pages read them).

``GET /api/mqtt/sessions`` lists every session of the front ends that keep sessions
(``views.SessionsView``: MQTT), connected or a persistent one whose client is away;
``/api/mqtt/sessions/{vhost}`` those of one vhost and ``/api/mqtt/sessions/{vhost}/{client_id}``
one. Each carries its client id, whether it is clean or persistent, its subscriptions with their
QoS, its will (no payload: its size), its in-flight QoS 1 deliveries and whether it is connected.
Visibility is that of connections: administrators and monitoring users see every session of
every vhost; another user sees the sessions of vhosts it may use that it logged in itself (a
persistent session away from its client shows its pending will's user, if any). Lists take the
usual ``page``, ``page_size``, ``name``, ``sort`` parameters; ``name`` is the client id.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from broker.http.common import MGMT_KEY, can_see_vhost, not_found, paginate, sees_all, user_of, vhost_param
from broker.views import SessionsView

routes = web.RouteTableDef()


def _sessions(request: web.Request, vhost: str | None = None) -> list[dict[str, Any]]:
    mgmt = request.app[MGMT_KEY]
    user = user_of(request)
    everyone = sees_all(user)
    out: list[dict[str, Any]] = []
    for fe in mgmt.front_ends:
        if not isinstance(fe, SessionsView):
            continue
        for s in fe.sessions():
            if vhost is not None and s["vhost"] != vhost:
                continue
            if everyone or (s["user"] == user.name and can_see_vhost(request, s["vhost"])):
                out.append({**s, "name": s["client_id"], "node": mgmt.node_name,
                            "subscription_count": len(s["subscriptions"])})
    return out


@routes.get("/api/mqtt/sessions")
async def mqtt_sessions(request: web.Request) -> web.Response:
    return paginate(request, _sessions(request))


@routes.get("/api/mqtt/sessions/{vhost}")
async def vhost_mqtt_sessions(request: web.Request) -> web.Response:
    return paginate(request, _sessions(request, vhost_param(request)))


@routes.get("/api/mqtt/sessions/{vhost}/{client_id}")
async def mqtt_session(request: web.Request) -> web.Response:
    vhost = vhost_param(request)
    client_id = request.match_info["client_id"]
    for s in _sessions(request, vhost):
        if s["client_id"] == client_id:
            return web.json_response(s)
    raise not_found(f"no MQTT session '{client_id}' in vhost '{vhost}'")
