"""Node-level endpoints: overview, whoami, nodes, aliveness-test, connections, channels, consumers."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

from aiohttp import web
from pamqp import commands

from broker import __version__
from broker.http import history_api, node_memory
from broker.http.common import (
    MGMT_KEY,
    bad_request,
    can_see_vhost,
    check_perm,
    close_session,
    forbidden,
    json_body,
    not_found,
    paginate,
    require_admin,
    require_monitor,
    sees_all,
    user_of,
    vhost_param,
    visible_sessions,
)
from broker.http.rates import GLOBAL_FIELDS
from broker.http.render import (
    channel_json,
    connection_json,
    every_consumer_json,
    message_totals,
    rate,
    with_rates,
)
from broker.http.state import Mgmt
from broker.model.exchange import EXCHANGE_TYPES
from broker.model.publish import PublishRequest
from broker.views import ConnectionView

routes = web.RouteTableDef()


def _totals(request: web.Request) -> dict[str, Any]:
    mgmt = request.app[MGMT_KEY]
    ready = unacked = consumers = queues = exchanges = 0
    for name, vh in mgmt.broker.vhosts.items():
        if not can_see_vhost(request, name):
            continue
        exchanges += len(vh.exchanges)
        for q in vh.queues.values():
            queues += 1
            ready += q.message_count
            unacked += q.store.unacked_count
            consumers += len(q.consumers)
    sessions = visible_sessions(request)
    return {"ready": ready, "unacked": unacked, "consumers": consumers, "queues": queues,
            "exchanges": exchanges, "connections": len(sessions),
            "channels": sum(len(s.chs) for s in sessions)}


def _node_message_stats(mgmt: Mgmt) -> dict[str, Any]:
    """The node's message counters (consumer deliveries and gets by ack mode, as RabbitMQ
    counts them) with their sampled rates."""
    names = GLOBAL_FIELDS
    now = dict(zip(names, mgmt.rates.global_counters(), strict=True))
    r = mgmt.rates.global_rates()

    def both(*fields: str, minus: tuple[str, ...] = ()) -> tuple[int, float]:
        return (sum(now[f] for f in fields) - sum(now[f] for f in minus),
                sum(r[f] for f in fields) - sum(r[f] for f in minus))

    return with_rates({
        "publish": both("published"), "confirm": both("confirmed"), "ack": both("acked"),
        "deliver_get": both("delivered"),
        "deliver": both("delivered", minus=("gets", "delivered_autoack")),
        "deliver_no_ack": both("delivered_autoack"),
        "get": both("gets", minus=("gets_autoack",)), "get_no_ack": both("gets_autoack"),
        "get_empty": both("gets_empty"), "redeliver": both("redelivered"),
        "return_unroutable": both("returned"), "drop_unroutable": both("unroutable", minus=("returned",)),
    })


def _churn(mgmt: Mgmt) -> dict[str, Any]:
    """RabbitMQ's churn counters: objects created and closed/deleted, with rates. A queue
    declare that created nothing is not counted (``queue_declared`` counts creations)."""
    now = dict(zip(GLOBAL_FIELDS, mgmt.rates.global_counters(), strict=True))
    r = mgmt.rates.global_rates()
    return with_rates({key: (now[field], r[field]) for key, field in (
        ("connection_created", "connections_opened"), ("connection_closed", "connections_closed"),
        ("channel_created", "channels_opened"), ("channel_closed", "channels_closed"),
        ("queue_declared", "queues_created"), ("queue_created", "queues_created"),
        ("queue_deleted", "queues_deleted"))})


@routes.get("/api/overview")
async def overview(request: web.Request) -> web.Response:
    mgmt = request.app[MGMT_KEY]
    t = _totals(request)
    listeners = [{"node": mgmt.listed_name, "protocol": proto, "ip_address": addr[0], "port": addr[1]}
                 for proto, addr in mgmt.client_listeners()]
    out = {
        "management_version": __version__,
        "product_name": "Skred",
        "product_version": __version__,
        "rabbitmq_version": "3.10.0",
        "erlang_version": f"Python {platform.python_version()}",
        "erlang_full_version": f"Python {platform.python_version()} on {platform.system()}",
        "cluster_name": mgmt.cluster_name,
        "node": mgmt.node_name,
        "app_running": mgmt.app is None or mgmt.app.app_running,  # skredctl stop_app
        "rates_mode": "basic",
        "disable_stats": False,
        "enable_queue_totals": True,
        "exchange_types": [{"name": t_, "description": "", "enabled": True} for t_ in EXCHANGE_TYPES],
        "message_stats": _node_message_stats(mgmt),
        "churn_rates": _churn(mgmt),
        "queue_totals": message_totals(t["ready"], t["unacked"], mgmt.rates.queue_totals_rates(
            vh for name, vh in mgmt.broker.vhosts.items() if can_see_vhost(request, name))),
        "object_totals": {k: t[k] for k in ("channels", "connections", "consumers", "exchanges", "queues")},
        "statistics_db_event_queue": 0,
        "listeners": listeners,
        "contexts": [{"node": mgmt.node_name, "description": "Skred Management", "path": "/",
                      "port": str((mgmt.http_address or mgmt.https_address or ("", ""))[1])}],
    }
    history_api.overview(request, out, (vh for name, vh in mgmt.broker.vhosts.items()
                                        if can_see_vhost(request, name)))
    return web.json_response(out)


@routes.get("/api/cluster")
async def cluster_status(request: web.Request) -> web.Response:
    """Skred's cluster view (not a RabbitMQ endpoint): leader, ISR, followers with lag in bytes.

    Served by the leader; a follower's HTTP port proxies to it. ``{"enabled": false}`` standalone.
    """
    require_monitor(request)
    info = request.app[MGMT_KEY].cluster
    return web.json_response(info.status() if info is not None else {"enabled": False})


@routes.get("/api/cluster-name")
async def cluster_name(request: web.Request) -> web.Response:
    return web.json_response({"name": request.app[MGMT_KEY].cluster_name})


@routes.get("/api/whoami")
async def whoami(request: web.Request) -> web.Response:
    user = user_of(request)
    return web.json_response({"name": user.name, "tags": list(user.tags)})


def _node_json(request: web.Request) -> dict[str, Any]:
    mgmt = request.app[MGMT_KEY]
    uptime_ms = int(mgmt.uptime_seconds() * 1000)
    return {
        "name": mgmt.listed_name,
        "type": "disc",
        "running": True,
        "being_drained": False,
        "os_pid": str(os.getpid()),
        "uptime": uptime_ms,
        "processors": os.cpu_count() or 1,
        "mem_used": mgmt.resident_memory(),
        "mem_limit": mgmt.broker.alarm.memory.limit,
        "mem_alarm": mgmt.broker.alarm.memory.active,
        "disk_free": mgmt.disk_free(),
        "disk_free_limit": mgmt.broker.alarm.disk.free_disk_min,
        "disk_free_alarm": mgmt.broker.alarm.disk.active,
        "fd_used": mgmt.open_fds(),
        "fd_total": mgmt.max_fds(),
        "sockets_used": len(mgmt.connections()),
        "sockets_total": mgmt.max_fds(),
        "proc_used": 1,
        "proc_total": 1,
        **{f"{k}_details": rate(v) for k, v in mgmt.rates.node_rates().items()},
        **_churn(mgmt),
        "run_queue": 0,
        "rates_mode": "basic",
        "applications": [{"name": "skred", "description": "Skred broker", "version": __version__}],
        "partitions": [],
    }


@routes.get("/api/nodes")
async def nodes(request: web.Request) -> web.Response:
    require_monitor(request)
    return paginate(request, [_node_json(request)])


@routes.get("/api/nodes/{node}")
async def node(request: web.Request) -> web.Response:
    require_monitor(request)
    if request.match_info["node"] != request.app[MGMT_KEY].listed_name:
        raise not_found()
    out = _node_json(request)
    if request.query.get("memory", "false").lower() == "true":
        out["memory"] = node_memory.breakdown(request.app[MGMT_KEY].rates.history_bytes())
    history_api.node(request, out)
    return web.json_response(out)


@routes.get("/api/nodes/{node}/memory")
async def node_memory_route(request: web.Request) -> web.Response:
    """RabbitMQ's memory breakdown of a node (``node_memory.py`` says what each key holds)."""
    require_monitor(request)
    if request.match_info["node"] != request.app[MGMT_KEY].listed_name:
        raise not_found()
    return web.json_response({"memory": node_memory.breakdown(request.app[MGMT_KEY].rates.history_bytes())})


ALIVENESS_QUEUE = "aliveness-test"


@routes.get("/api/aliveness-test/{vhost}")
async def aliveness(request: web.Request) -> web.Response:
    """Declare a queue, publish to it and get the message back, as RabbitMQ does: as the
    user, who needs access to the vhost (monitoring alone is not enough) and the permissions
    that declaring, publishing to and reading the queue take over AMQP."""
    vhost = vhost_param(request)
    mgmt = request.app[MGMT_KEY]
    user = user_of(request)
    if not mgmt.broker.users.has_vhost_access(user, vhost):
        raise forbidden(f"access to vhost '{vhost}' refused for user '{user.name}'")
    check_perm(request, "configure", vhost, ALIVENESS_QUEUE)
    check_perm(request, "write", vhost, "")
    check_perm(request, "read", vhost, ALIVENESS_QUEUE)
    vh = mgmt.broker.vhosts[vhost]
    q, _ = vh.declare_queue(ALIVENESS_QUEUE, durable=False, owner=None)
    q.purge()
    body = b"test_message"
    vh.publish(PublishRequest("", ALIVENESS_QUEUE, bytes(commands.Basic.Properties().marshal()), body,
                              int(time.time() * 1000), False))
    got = q.get()
    if got is None or got[4] != body:
        return web.json_response({"status": "failed", "reason": "message not returned"}, status=503)
    q.ack(got[0])
    return web.json_response({"status": "ok"})


@routes.get("/api/disk-free-limit")
async def get_disk_free_limit(request: web.Request) -> web.Response:
    """The free-disk alarm threshold in force (``[main] free_disk_min``), free space, alarm state."""
    require_monitor(request)
    alarm = request.app[MGMT_KEY].broker.alarm.disk
    return web.json_response({"limit": alarm.free_disk_min, "free": alarm.free(), "alarm": alarm.active})


@routes.put("/api/disk-free-limit")
async def put_disk_free_limit(request: web.Request) -> web.Response:
    """Change the threshold at runtime (like ``rabbitmqctl set_disk_free_limit``); the next
    one-second check raises or clears the alarm. Not persisted: the config option is."""
    require_admin(request)
    body = await json_body(request, required=("limit",))
    limit = body["limit"]
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise bad_request("limit must be a non-negative integer (bytes)")
    request.app[MGMT_KEY].broker.alarm.disk.free_disk_min = limit
    return web.Response(status=204)


# ---------------------------------------------------------------- connections
@routes.get("/api/connections")
async def connections(request: web.Request) -> web.Response:
    mgmt = request.app[MGMT_KEY]
    return paginate(request, [connection_json(mgmt, s) for s in visible_sessions(request)])


@routes.get("/api/vhosts/{vhost}/connections")
async def vhost_connections(request: web.Request) -> web.Response:
    vhost = vhost_param(request)
    mgmt = request.app[MGMT_KEY]
    return paginate(request, [connection_json(mgmt, s) for s in visible_sessions(request)
                              if s.vhost == vhost])


def _connection(request: web.Request) -> Any:
    mgmt = request.app[MGMT_KEY]
    session = mgmt.find_connection(request.match_info["name"])
    if session is None or session not in visible_sessions(request):
        raise not_found()
    return session


@routes.get("/api/connections/{name}")
async def connection(request: web.Request) -> web.Response:
    session = _connection(request)
    out = connection_json(request.app[MGMT_KEY], session)
    history_api.connection(request, out, session)
    return web.json_response(out)


@routes.delete("/api/connections/{name}")
async def close_connection(request: web.Request) -> web.Response:
    return close_session(request, _connection(request))


@routes.get("/api/connections/{name}/channels")
async def connection_channels(request: web.Request) -> web.Response:
    session = _connection(request)
    mgmt = request.app[MGMT_KEY]
    return paginate(request, [channel_json(mgmt, session, c) for c in session.chs.values()])


# ------------------------------------------------------------------- channels
def _all_channels(request: web.Request, vhost: str | None = None) -> list[dict[str, Any]]:
    mgmt = request.app[MGMT_KEY]
    return [channel_json(mgmt, s, c) for s in visible_sessions(request)
            if vhost is None or s.vhost == vhost for c in s.chs.values()]


@routes.get("/api/channels")
async def channels(request: web.Request) -> web.Response:
    return paginate(request, _all_channels(request))


@routes.get("/api/vhosts/{vhost}/channels")
async def vhost_channels(request: web.Request) -> web.Response:
    return paginate(request, _all_channels(request, vhost_param(request)))


@routes.get("/api/channels/{name}")
async def channel(request: web.Request) -> web.Response:
    """One channel; with ``?msg_rates_age=&msg_rates_incr=`` its own message rates' samples
    (publish, confirm, deliver_get, ack) from the history (``history_api.py``)."""
    name = request.match_info["name"]
    mgmt = request.app[MGMT_KEY]
    for s in visible_sessions(request):
        for c in s.chs.values():
            item = channel_json(mgmt, s, c)
            if item["name"] == name:
                history_api.channel(request, item, c)
                return web.json_response(item)
    raise not_found()


# ------------------------------------------------------------------ consumers
def _consumers(request: web.Request, vhost: str | None = None) -> list[dict[str, Any]]:
    user = user_of(request)

    def shown(s: ConnectionView) -> bool:
        return (vhost is None or s.vhost == vhost) and (sees_all(user) or can_see_vhost(request, s.vhost))
    return every_consumer_json(request.app[MGMT_KEY], shown)


@routes.get("/api/consumers")
async def consumers(request: web.Request) -> web.Response:
    return paginate(request, _consumers(request))


@routes.get("/api/consumers/{vhost}")
async def vhost_consumers(request: web.Request) -> web.Response:
    return paginate(request, _consumers(request, vhost_param(request)))
