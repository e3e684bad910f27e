"""Vhosts, users, permissions and policies."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from broker.auth.parameters import RuntimeParameters
from broker.auth.passwords import ALGORITHMS, HASHING_ALGORITHM
from broker.auth.users import User, UserStore
from broker.http import definitions, history_api
from broker.http.common import (
    MGMT_KEY,
    ApiError,
    bad_request,
    can_see_vhost,
    check_name,
    committed,
    created,
    forbidden,
    get_str,
    is_admin,
    json_body,
    no_content,
    not_found,
    paginate,
    require_admin,
    user_of,
    vhost_param,
)
from broker.http.policies import PolicyApi, validate_policy
from broker.http.render import message_totals, network_stats, queue_message_stats, vhost_message_stats

routes = web.RouteTableDef()


# --------------------------------------------------------------------- vhosts
def _vhost_json(request: web.Request, name: str) -> dict[str, Any]:
    mgmt = request.app[MGMT_KEY]
    vh = mgmt.broker.vhosts[name]
    queues = list(vh.queues.values())
    r = mgmt.rates.queue_totals_rates([vh])
    meta = vh.meta.to_json()
    return {
        "name": name, "description": meta["description"], "tags": meta["tags"], "tracing": vh.meta.tracing,
        "default_queue_type": meta["default_queue_type"], "metadata": meta,
        "cluster_state": {mgmt.node_name: "running"},
        **message_totals(sum(q.message_count for q in queues),
                         sum(q.store.unacked_count for q in queues), r),
        **network_stats([s for s in mgmt.broker.connections if s.vhost == name], mgmt),
        "message_stats": {**queue_message_stats(queues, r), **vhost_message_stats(vh, mgmt)},
    }


@routes.get("/api/vhosts")
async def vhosts(request: web.Request) -> web.Response:
    names = [n for n in sorted(request.app[MGMT_KEY].broker.vhosts) if can_see_vhost(request, n)]
    return paginate(request, [_vhost_json(request, n) for n in names])


@routes.get("/api/vhosts/{vhost}")
async def vhost(request: web.Request) -> web.Response:
    name = vhost_param(request)
    out = _vhost_json(request, name)
    history_api.vhost(request, out, request.app[MGMT_KEY].broker.vhosts[name])
    return web.json_response(out)


@routes.put("/api/vhosts/{vhost}")
async def put_vhost(request: web.Request) -> web.Response:
    user = require_admin(request)
    name = check_name("vhost", request.match_info["vhost"])
    body = await json_body(request)
    mgmt = request.app[MGMT_KEY]
    existed = name in mgmt.broker.vhosts
    try:
        meta = definitions.vhost_meta_fields(body)
        vh = mgmt.broker.vhosts[name] if existed else mgmt.create_vhost(name)
        if meta:
            vh.meta.update(**meta)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    if meta:  # tracing, description...: answered once durable (on a leader: on its followers)
        await committed(mgmt)
    if existed:
        return no_content()
    # As RabbitMQ does: the administrator who creates a vhost gets full permissions on it.
    mgmt.broker.users.set_permissions(user.name, name, ".*", ".*", ".*")
    return created()


@routes.delete("/api/vhosts/{vhost}")
async def delete_vhost(request: web.Request) -> web.Response:
    require_admin(request)
    name = vhost_param(request)
    request.app[MGMT_KEY].delete_vhost(name)
    return no_content()


@routes.get("/api/vhosts/{vhost}/permissions")
async def vhost_permissions(request: web.Request) -> web.Response:
    require_admin(request)
    name = vhost_param(request)
    return paginate(request, [p for p in _all_permissions(request) if p["vhost"] == name])


# ---------------------------------------------------------------------- users
def _user_json(user: User) -> dict[str, Any]:
    return {"name": user.name, "password_hash": user.password_hash,
            "hashing_algorithm": user.hashing_algorithm, "tags": list(user.tags),
            "limits": dict(sorted(user.limits.items()))}


def _parse_tags(value: Any) -> list[str]:
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return [t.strip() for t in value if t.strip()]
    raise bad_request("'tags' must be a comma-separated string or a list of strings")


def _admins(request: web.Request) -> list[str]:
    return [u.name for u in request.app[MGMT_KEY].broker.users.list() if is_admin(u)]


@routes.get("/api/users")
async def users(request: web.Request) -> web.Response:
    require_admin(request)
    return paginate(request, [_user_json(u) for u in request.app[MGMT_KEY].broker.users.list()])


@routes.get("/api/users/without-permissions")
async def users_without_permissions(request: web.Request) -> web.Response:
    require_admin(request)
    return paginate(request, [_user_json(u) for u in request.app[MGMT_KEY].broker.users.list()
                              if not u.permissions])


@routes.post("/api/users/bulk-delete")
async def bulk_delete_users(request: web.Request) -> web.Response:
    """RabbitMQ's bulk delete: every named user that exists is deleted; a name that does not
    exist makes the answer 400 (after the others are gone), as RabbitMQ does."""
    require_admin(request)
    body = await json_body(request, required=("users",))
    names = body["users"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise bad_request("'users' must be a list of user names")
    store = request.app[MGMT_KEY].broker.users
    missing = [n for n in names if store.get(n) is None]
    for n in names:
        u = store.get(n)
        if u is not None and not (is_admin(u) and _admins(request) == [n]):  # keep the last admin
            store.delete_user(n)
    if missing:
        raise bad_request(f"no_such_user: {missing[0]}")
    return no_content()


def _user(request: web.Request) -> User:
    user = request.app[MGMT_KEY].broker.users.get(request.match_info["user"])
    if user is None:
        raise not_found()
    return user


@routes.get("/api/users/{user}")
async def user(request: web.Request) -> web.Response:
    require_admin(request)
    return web.json_response(_user_json(_user(request)))


def apply_user(request: web.Request, name: str, body: dict[str, Any]) -> bool:
    """Create or update a user from a RabbitMQ user body; True when created. Validates first."""
    store = request.app[MGMT_KEY].broker.users
    check_name("user", name)
    password = body.get("password")
    password_hash = body.get("password_hash")
    if password is not None and not isinstance(password, str):
        raise bad_request("'password' must be a string")
    if password_hash is not None and not isinstance(password_hash, str):
        raise bad_request("'password_hash' must be a string")
    if password is not None and password_hash is not None:
        raise bad_request("give 'password' or 'password_hash', not both")
    algorithm = get_str(body, "hashing_algorithm", HASHING_ALGORITHM)
    if algorithm not in ALGORITHMS:
        raise bad_request(f"unknown hashing_algorithm '{algorithm}'")
    tags = _parse_tags(body.get("tags", []))
    existing = store.get(name)
    if existing is None and password is None and password_hash is None:
        raise bad_request("password or password_hash must be set")
    if existing is not None and is_admin(existing) and "administrator" not in tags \
            and _admins(request) == [name]:
        raise bad_request(f"cannot remove the administrator tag from the last administrator '{name}'")
    try:
        if existing is None:
            store.add_user(name, password, tags, password_hash=password_hash)
            if password_hash is not None and algorithm != HASHING_ALGORITHM:
                _set_hash(store, name, password_hash, algorithm)
            return True
        store.set_tags(name, tags)
        if password is not None:
            store.set_password(name, password)
        elif password_hash is not None:
            _set_hash(store, name, password_hash, algorithm)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return False


def _set_hash(store: UserStore, name: str, password_hash: str, algorithm: str) -> None:
    # UserStore has no public setter for an imported hash (nor add_user(hashing_algorithm=));
    # _replace is its single validated write path. TODO: a public set_password_hash().
    store._replace(name, password_hash=password_hash, hashing_algorithm=algorithm)


@routes.put("/api/users/{user}")
async def put_user(request: web.Request) -> web.Response:
    require_admin(request)
    body = await json_body(request)
    was_created = apply_user(request, request.match_info["user"], body)
    return created() if was_created else no_content()


@routes.delete("/api/users/{user}")
async def delete_user(request: web.Request) -> web.Response:
    require_admin(request)
    target = _user(request)
    if is_admin(target) and _admins(request) == [target.name]:
        raise bad_request(f"cannot delete the last administrator '{target.name}'")
    request.app[MGMT_KEY].broker.users.delete_user(target.name)
    return no_content()


@routes.get("/api/users/{user}/permissions")
async def user_permissions(request: web.Request) -> web.Response:
    require_admin(request)
    target = _user(request)
    return paginate(request, [p for p in _all_permissions(request) if p["user"] == target.name])


# ---------------------------------------------------------------- permissions
def _all_permissions(request: web.Request) -> list[dict[str, Any]]:
    return [
        {"user": u.name, "vhost": vhost, "configure": p.configure, "write": p.write, "read": p.read}
        for u in request.app[MGMT_KEY].broker.users.list()
        for vhost, p in sorted(u.permissions.items())
    ]


@routes.get("/api/permissions")
async def permissions(request: web.Request) -> web.Response:
    require_admin(request)
    return paginate(request, _all_permissions(request))


@routes.get("/api/permissions/{vhost}/{user}")
async def permission(request: web.Request) -> web.Response:
    require_admin(request)
    vhost_name = vhost_param(request, listed=True)
    target = _user(request)
    for p in _all_permissions(request):
        if p["user"] == target.name and p["vhost"] == vhost_name:
            return web.json_response(p)
    raise not_found()


@routes.put("/api/permissions/{vhost}/{user}")
async def put_permission(request: web.Request) -> web.Response:
    require_admin(request)
    vhost_name = vhost_param(request, listed=True)
    target = request.app[MGMT_KEY].broker.users.get(request.match_info["user"])
    if target is None:  # RabbitMQ: 400, not 404, for a permission of a user that does not exist
        raise bad_request(f"no_such_user: {request.match_info['user']}")
    body = await json_body(request, required=("configure", "write", "read"))
    values = [get_str(body, k) for k in ("configure", "write", "read")]
    store = request.app[MGMT_KEY].broker.users
    existed = vhost_name in target.permissions
    try:
        store.set_permissions(target.name, vhost_name, *values)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return no_content() if existed else created()


@routes.delete("/api/permissions/{vhost}/{user}")
async def delete_permission(request: web.Request) -> web.Response:
    require_admin(request)
    vhost_name = vhost_param(request, listed=True)
    target = _user(request)
    if vhost_name not in target.permissions:
        raise not_found()
    request.app[MGMT_KEY].broker.users.clear_permissions(target.name, vhost_name)
    return no_content()


# ---------------------------------------------------------------- vhost limits
def _limits_json(request: web.Request, name: str) -> dict[str, Any]:
    return {"vhost": name, "value": dict(request.app[MGMT_KEY].broker.vhosts[name].limits.values)}


@routes.get("/api/vhost-limits")
async def all_vhost_limits(request: web.Request) -> web.Response:
    vhosts = request.app[MGMT_KEY].broker.vhosts
    return web.json_response([_limits_json(request, n) for n in sorted(vhosts)
                              if can_see_vhost(request, n) and vhosts[n].limits.values])


@routes.get("/api/vhost-limits/{vhost}")
async def vhost_limits(request: web.Request) -> web.Response:
    name = vhost_param(request)
    found = request.app[MGMT_KEY].broker.vhosts[name].limits.values
    return web.json_response([_limits_json(request, name)] if found else [])


@routes.put("/api/vhost-limits/{vhost}/{name}")
async def put_vhost_limit(request: web.Request) -> web.Response:
    require_admin(request)
    vhost_name = vhost_param(request)
    body = await json_body(request, required=("value",))
    try:
        request.app[MGMT_KEY].broker.vhosts[vhost_name].limits.set(request.match_info["name"], body["value"])
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return no_content()


@routes.delete("/api/vhost-limits/{vhost}/{name}")
async def delete_vhost_limit(request: web.Request) -> web.Response:
    require_admin(request)
    vhost_name = vhost_param(request)
    if not request.app[MGMT_KEY].broker.vhosts[vhost_name].limits.delete(request.match_info["name"]):
        raise not_found()
    return no_content()


# ------------------------------------------------------- runtime parameters
# Components (shovel, federation) register with the node's ``RuntimeParameters``
# (broker/auth/parameters.py); a PUT to any other names an unknown component, as on a RabbitMQ
# without the plugin. Global parameters are kept apart (routes_grants.py).
def _runtime(request: web.Request) -> RuntimeParameters | None:
    return request.app[MGMT_KEY].parameters


@routes.get("/api/parameters")
@routes.get("/api/parameters/{component}")
async def parameters(request: web.Request) -> web.Response:
    """For policymakers (RabbitMQ's rule: a shovel's value holds its URIs' passwords)."""
    if not ({"administrator", "policymaker"} & set(user_of(request).tags)):
        raise forbidden("Not policymaker user")
    store = _runtime(request)
    found = [] if store is None else store.list(request.match_info.get("component"))
    return paginate(request, [p for p in found if can_see_vhost(request, p["vhost"])])


@routes.get("/api/parameters/{component}/{vhost}")
async def vhost_parameters(request: web.Request) -> web.Response:
    vhost_name = vhost_param(request)
    _require_policymaker(request, vhost_name)
    store = _runtime(request)
    return paginate(request, [] if store is None else store.list(request.match_info["component"], vhost_name))


@routes.get("/api/parameters/{component}/{vhost}/{name}")
async def parameter(request: web.Request) -> web.Response:
    vhost_name = vhost_param(request)
    _require_policymaker(request, vhost_name)
    store, component, name = _runtime(request), request.match_info["component"], request.match_info["name"]
    value = None if store is None else store.get(component, vhost_name, name)
    if value is None:
        raise not_found()
    return web.json_response({"vhost": vhost_name, "component": component, "name": name, "value": value})


@routes.put("/api/parameters/{component}/{vhost}/{name}")
async def put_parameter(request: web.Request) -> web.Response:
    vhost_name = vhost_param(request)
    _require_policymaker(request, vhost_name)  # RabbitMQ: parameters are for policymakers
    store, component = _runtime(request), request.match_info["component"]
    if store is None:
        raise bad_request(f"component '{component}' not found")
    body = await json_body(request, required=("value",))
    try:
        new = store.put(component, vhost_name, request.match_info["name"], body["value"],
                        user=user_of(request).name)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return created() if new else no_content()


@routes.delete("/api/parameters/{component}/{vhost}/{name}")
async def delete_parameter(request: web.Request) -> web.Response:
    """404 for a missing one, as RabbitMQ answers (rabbitmqadmin prints 'Not found' rather than
    failing on a 405)."""
    vhost_name = vhost_param(request)
    _require_policymaker(request, vhost_name)
    store, component, name = _runtime(request), request.match_info["component"], request.match_info["name"]
    if store is None or not store.delete(component, vhost_name, name):
        raise not_found()
    return no_content()


# ------------------------------------------------------------------- policies
def _require_policymaker(request: web.Request, vhost_name: str) -> None:
    user = user_of(request)
    if not ({"administrator", "policymaker"} & set(user.tags)):
        raise forbidden("Not policymaker user")
    if not request.app[MGMT_KEY].broker.users.has_vhost_access(user, vhost_name):
        raise forbidden(f"access to vhost '{vhost_name}' refused for user '{user.name}'")


def _policy_api(request: web.Request) -> PolicyApi:
    """Policies or operator policies, by the route's ``kind`` (both act on the vhost model)."""
    mgmt = request.app[MGMT_KEY]
    return mgmt.operator_policies if request.match_info.get("kind") == "operator-policies" else mgmt.policies


_KIND = "{kind:policies|operator-policies}"


@routes.get(f"/api/{_KIND}")
async def policies(request: web.Request) -> web.Response:
    return paginate(request, [p for p in _policy_api(request).list() if can_see_vhost(request, p["vhost"])])


@routes.get(f"/api/{_KIND}/{{vhost}}")
async def vhost_policies(request: web.Request) -> web.Response:
    return paginate(request, _policy_api(request).list(vhost_param(request)))


@routes.get(f"/api/{_KIND}/{{vhost}}/{{name}}")
async def policy(request: web.Request) -> web.Response:
    found = _policy_api(request).get(vhost_param(request), request.match_info["name"])
    if found is None:
        raise not_found()
    return web.json_response(found)


@routes.put(f"/api/{_KIND}/{{vhost}}/{{name}}")
async def put_policy(request: web.Request) -> web.Response:
    vhost_name = vhost_param(request)
    _require_policymaker(request, vhost_name)
    if request.match_info["kind"] == "operator-policies":
        require_admin(request)  # RabbitMQ: operator policies are for administrators
    body = await json_body(request)
    try:
        policy_doc = validate_policy(vhost_name, check_name("policy", request.match_info["name"]), body,
                                     known_keys_only=True)
        was_new = _policy_api(request).put(policy_doc)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return created() if was_new else no_content()


@routes.delete(f"/api/{_KIND}/{{vhost}}/{{name}}")
async def delete_policy(request: web.Request) -> web.Response:
    vhost_name = vhost_param(request)
    _require_policymaker(request, vhost_name)
    if request.match_info["kind"] == "operator-policies":
        require_admin(request)
    if not _policy_api(request).delete(vhost_name, request.match_info["name"]):
        raise not_found()
    return no_content()


__all__ = ["routes", "apply_user", "ApiError"]
