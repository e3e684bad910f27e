"""Topic permissions, user limits and global parameters, as RabbitMQ's management API has them.

- ``/api/topic-permissions[/{vhost}/{user}]``, ``/api/users/{user}/topic-permissions``,
  ``/api/vhosts/{vhost}/topic-permissions``: per user, vhost and exchange, a ``write`` and a
  ``read`` pattern over routing keys, enforced on publishes and bindings (``auth/users.py``).
- ``/api/user-limits[/{user}[/{name}]]``: ``max-connections`` and ``max-channels`` per user.
- ``/api/global-parameters[/{name}]``: RabbitMQ's cluster-wide name -> value table.

Every change is for administrators (RabbitMQ: the same), and each is written to its JSON store
before it is answered, so definitions exports carry it and a follower that takes over has it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from broker.auth.users import User, UserStore, topic_permissions_json
from broker.http.common import (
    MGMT_KEY,
    bad_request,
    created,
    get_str,
    json_body,
    no_content,
    not_found,
    paginate,
    require_admin,
    vhost_param,
)

routes = web.RouteTableDef()


def _store(request: web.Request) -> UserStore:
    return request.app[MGMT_KEY].broker.users


def _target(request: web.Request) -> User:
    user = _store(request).get(request.match_info["user"])
    if user is None:
        raise not_found()
    return user


# ----------------------------------------------------------------- topic permissions
@routes.get("/api/topic-permissions")
async def all_topic_permissions(request: web.Request) -> web.Response:
    require_admin(request)
    return paginate(request, topic_permissions_json(_store(request).list()))


@routes.get("/api/users/{user}/topic-permissions")
async def user_topic_permissions(request: web.Request) -> web.Response:
    require_admin(request)
    return paginate(request, topic_permissions_json([_target(request)]))


@routes.get("/api/vhosts/{vhost}/topic-permissions")
async def vhost_topic_permissions(request: web.Request) -> web.Response:
    require_admin(request)
    vhost = vhost_param(request)
    found = topic_permissions_json(_store(request).list())
    return paginate(request, [p for p in found if p["vhost"] == vhost])


@routes.get("/api/topic-permissions/{vhost}/{user}")
async def topic_permission(request: web.Request) -> web.Response:
    require_admin(request)
    vhost = vhost_param(request, listed=True)
    found = [p for p in topic_permissions_json([_target(request)]) if p["vhost"] == vhost]
    if not found:
        raise not_found()
    return web.json_response(found)


@routes.put("/api/topic-permissions/{vhost}/{user}")
async def put_topic_permission(request: web.Request) -> web.Response:
    require_admin(request)
    vhost = vhost_param(request, listed=True)
    target = _store(request).get(request.match_info["user"])
    if target is None:  # as a permission of a user that does not exist: 400
        raise bad_request(f"no_such_user: {request.match_info['user']}")
    body = await json_body(request, required=("exchange", "write", "read"))
    exchange, write, read = (get_str(body, k) for k in ("exchange", "write", "read"))
    existed = (vhost, exchange) in target.topic_permissions
    try:
        _store(request).set_topic_permission(target.name, vhost, exchange, write, read)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return no_content() if existed else created()


@routes.delete("/api/topic-permissions/{vhost}/{user}")
async def delete_topic_permission(request: web.Request) -> web.Response:
    require_admin(request)
    vhost = vhost_param(request, listed=True)
    target = _target(request)
    if not _store(request).clear_topic_permissions(target.name, vhost):
        raise not_found()
    return no_content()


# ----------------------------------------------------------------------- user limits
def _limits_json(users: list[User]) -> list[dict[str, Any]]:
    return [{"user": u.name, "value": dict(sorted(u.limits.items()))} for u in users if u.limits]


@routes.get("/api/user-limits")
async def all_user_limits(request: web.Request) -> web.Response:
    require_admin(request)
    return web.json_response(_limits_json(_store(request).list()))


@routes.get("/api/user-limits/{user}")
async def user_limits(request: web.Request) -> web.Response:
    require_admin(request)
    return web.json_response(_limits_json([_target(request)]))


@routes.put("/api/user-limits/{user}/{name}")
async def put_user_limit(request: web.Request) -> web.Response:
    require_admin(request)
    target = _target(request)
    body = await json_body(request, required=("value",))
    try:
        _store(request).set_limit(target.name, request.match_info["name"], body["value"])
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return no_content()


@routes.delete("/api/user-limits/{user}/{name}")
async def delete_user_limit(request: web.Request) -> web.Response:
    require_admin(request)
    if not _store(request).clear_limit(_target(request).name, request.match_info["name"]):
        raise not_found()
    return no_content()


# ----------------------------------------------------------------- global parameters
@routes.get("/api/global-parameters")
async def global_parameters(request: web.Request) -> web.Response:
    require_admin(request)
    return paginate(request, request.app[MGMT_KEY].global_parameters.list())


@routes.get("/api/global-parameters/{name}")
async def global_parameter(request: web.Request) -> web.Response:
    require_admin(request)
    name = request.match_info["name"]
    params = request.app[MGMT_KEY].global_parameters
    if name not in params:
        raise not_found()
    return web.json_response({"name": name, "value": params.get(name)})


@routes.put("/api/global-parameters/{name}")
async def put_global_parameter(request: web.Request) -> web.Response:
    require_admin(request)
    body = await json_body(request, required=("value",))
    try:
        new = request.app[MGMT_KEY].global_parameters.put(request.match_info["name"], body["value"])
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return created() if new else no_content()


@routes.delete("/api/global-parameters/{name}")
async def delete_global_parameter(request: web.Request) -> web.Response:
    require_admin(request)
    if not request.app[MGMT_KEY].global_parameters.delete(request.match_info["name"]):
        raise not_found()
    return no_content()
