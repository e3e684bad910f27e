"""Shovel status and control (the shovels themselves are ``shovel`` runtime parameters).

- ``GET /api/shovels``, ``GET /api/shovels/{vhost}``: RabbitMQ's status list (``state``
  ``starting``/``running``/``terminated`` with ``reason``, or ``paused``), for every user who may
  use the vhost (URIs are shown without passwords).
- ``GET /api/shovels/vhost/{vhost}/{name}``: one shovel's status (RabbitMQ 3.12's path).
- ``DELETE /api/shovels/vhost/{vhost}/{name}/restart``: RabbitMQ's restart.
- ``PUT /api/shovels/{vhost}/{name}/pause`` and ``.../resume``: LavinMQ's pause and resume; a
  pause is kept beside the parameter, so it survives a restart and a failover.
Control is for policymakers with access to the vhost, like the parameters themselves.
"""

from __future__ import annotations

from aiohttp import web

from broker.http.common import (
    MGMT_KEY,
    can_see_vhost,
    forbidden,
    no_content,
    not_found,
    paginate,
    user_of,
    vhost_param,
)
from broker.http.state import ShovelsView

routes = web.RouteTableDef()


def _shovels(request: web.Request) -> ShovelsView:
    found = request.app[MGMT_KEY].shovels
    if found is None:
        raise not_found("this node runs no shovels")
    return found


def _control(request: web.Request) -> tuple[ShovelsView, str, str]:
    vhost = vhost_param(request)
    if not ({"administrator", "policymaker"} & set(user_of(request).tags)):
        raise forbidden("Not policymaker user")
    return _shovels(request), vhost, request.match_info["name"]


@routes.get("/api/shovels")
async def shovels(request: web.Request) -> web.Response:
    found = request.app[MGMT_KEY].shovels
    items = [] if found is None else found.status()
    return paginate(request, [s for s in items if can_see_vhost(request, s["vhost"])])


@routes.get("/api/shovels/{vhost}")
async def vhost_shovels(request: web.Request) -> web.Response:
    vhost = vhost_param(request)
    found = request.app[MGMT_KEY].shovels
    return paginate(request, [] if found is None else found.status(vhost))


@routes.get("/api/shovels/vhost/{vhost}/{name}")
async def shovel(request: web.Request) -> web.Response:
    vhost, name = vhost_param(request), request.match_info["name"]
    for s in _shovels(request).status(vhost):
        if s["name"] == name:
            return web.json_response(s)
    raise not_found()


@routes.delete("/api/shovels/vhost/{vhost}/{name}/{verb:restart}")
@routes.put("/api/shovels/{vhost}/{name}/{verb:pause|resume}")
async def control(request: web.Request) -> web.Response:
    """Restart (RabbitMQ's DELETE), pause or resume (LavinMQ's PUTs): 404 for no such shovel."""
    view, vhost, name = _control(request)
    act = {"restart": view.restart, "pause": view.pause, "resume": view.resume}[request.match_info["verb"]]
    if not act(vhost, name):
        raise not_found()
    return no_content()
