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

A list finds the sessions as ``views.SessionEntry`` tuples (vhost, client id, connected, user: no
subscription read, nothing built), filters and sorts them on those, and renders only the page it
answers (``paginate_objects``), so ``?page=1&page_size=100&sort=client_id`` at 10,000 sessions
builds 100 sessions' JSON, not 10,000 (``benchmarks/mqtt_sessions.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from broker.http.common import (
    MGMT_KEY,
    can_see_vhost,
    not_found,
    paginate_objects,
    sees_all,
    user_of,
    vhost_param,
)
from broker.views import SessionEntry, SessionsView

routes = web.RouteTableDef()

Found = tuple[SessionsView, SessionEntry]
# Sorts on what a session's entry holds, before anything is rendered (the UI sorts by client id):
# a page of 10,000 sessions renders its own 100. Sorting by any other field renders them all.
_KEYS: dict[str, Callable[[Found], Any]] = {
    "name": lambda f: f[1][1], "client_id": lambda f: f[1][1], "vhost": lambda f: f[1][0],
    "connected": lambda f: f[1][2], "user": lambda f: f[1][3]}


def _found(request: web.Request, vhost: str | None = None) -> list[Found]:
    """The sessions the user may see (of ``vhost``, or of every vhost), unrendered."""
    user = user_of(request)
    everyone = sees_all(user)
    out: list[Found] = []
    for fe in request.app[MGMT_KEY].front_ends:
        if isinstance(fe, SessionsView):
            out.extend((fe, e) for e in fe.session_entries(vhost)
                       if everyone or (e[3] == user.name and can_see_vhost(request, e[0])))
    return out


def _shown(s: dict[str, Any], node: str) -> dict[str, Any]:
    """A front end's session as the API answers it (the list's ``name`` is its client id)."""
    return {**s, "name": s["client_id"], "node": node, "subscription_count": len(s["subscriptions"])}


def _renderer(request: web.Request) -> Callable[[Found], dict[str, Any]]:
    node = request.app[MGMT_KEY].node_name

    def render(f: Found) -> dict[str, Any]:
        fe, (vhost, client_id, connected, user) = f
        s = fe.session(vhost, client_id)
        if s is None:  # not there any more (cannot happen within one request: no await between)
            s = {"vhost": vhost, "client_id": client_id, "connected": connected, "user": user,
                 "subscriptions": []}
        return _shown(s, node)
    return render


def _page(request: web.Request, vhost: str | None = None) -> web.Response:
    return paginate_objects(request, _found(request, vhost), _renderer(request), lambda f: f[1][1], _KEYS)


@routes.get("/api/mqtt/sessions")
async def mqtt_sessions(request: web.Request) -> web.Response:
    return _page(request)


@routes.get("/api/mqtt/sessions/{vhost}")
async def vhost_mqtt_sessions(request: web.Request) -> web.Response:
    return _page(request, vhost_param(request))


@routes.get("/api/mqtt/sessions/{vhost}/{client_id}")
async def mqtt_session(request: web.Request) -> web.Response:
    vhost = vhost_param(request)
    client_id = request.match_info["client_id"]
    user = user_of(request)
    for fe in request.app[MGMT_KEY].front_ends:
        if not isinstance(fe, SessionsView):
            continue
        s = fe.session(vhost, client_id)
        if s is not None and (sees_all(user) or (s["user"] == user.name and can_see_vhost(request, vhost))):
            return web.json_response(_shown(s, request.app[MGMT_KEY].node_name))
    raise not_found(f"no MQTT session '{client_id}' in vhost '{vhost}'")
