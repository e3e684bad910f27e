"""``GET /api/federation-links[/{vhost}]``: the federation links this node runs (RabbitMQ's
federation-management paths and fields), read through ``Mgmt.federation_links``, which the
node sets to the running ``broker.federation`` supervisor (http never imports it). On a cluster
follower the request is proxied to the leader, which runs the links, like every API call."""

from __future__ import annotations

from aiohttp import web

from broker.http.common import MGMT_KEY, can_see_vhost, paginate, vhost_param

routes = web.RouteTableDef()


@routes.get("/api/federation-links")
async def federation_links(request: web.Request) -> web.Response:
    found = request.app[MGMT_KEY].federation_links(None)
    return paginate(request, [e for e in found if can_see_vhost(request, e["vhost"])])


@routes.get("/api/federation-links/{vhost}")
async def vhost_federation_links(request: web.Request) -> web.Response:
    return paginate(request, request.app[MGMT_KEY].federation_links(vhost_param(request)))
