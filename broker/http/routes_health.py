"""Health checks (``/api/health/checks/*``) and the small endpoints the management UI and tools probe.

RabbitMQ's health checks answer 200 ``{"status": "ok", ...}`` when the check passes and 503
``{"status": "failed", "reason": ...}`` with the details when it does not; a malformed argument
(an unknown time unit, a port that is not a number) is 400. Skred answers the same shapes
(pinned by the conformance harness against RabbitMQ 3.10):

- ``alarms``, ``local-alarms``: the node's resource alarms (disk, memory).
- ``certificate-expiration/{within}/{unit}``: the configured TLS certificates must stay valid
  for that long (``days``, ``weeks``, ``months``, ``years``).
- ``port-listener/{port}``, ``protocol-listener/{protocol}``: a listener on that port or for that
  protocol exists (protocol names as RabbitMQ accepts them: ``amqp``, ``amqp091``, ``amqps``, ...).
- ``virtual-hosts``: every vhost is running (always, in Skred: a vhost has no process to fail).
- ``/api/healthchecks/node[/{node}]`` (RabbitMQ's older check): 200 ``{"status": "ok"}``, 503
  while the node's app is stopped.
- ``node-is-mirror-sync-critical``, ``node-is-quorum-critical``: Skred has neither classic
  mirrored queues nor per-queue Raft groups, so a node is never critical for them.
"""

from __future__ import annotations

import ssl
import time
from typing import Any

from aiohttp import web

from broker.http.common import MGMT_KEY, bad_request, not_found, user_of

routes = web.RouteTableDef()

_UNIT_SECONDS = {"days": 86400, "weeks": 7 * 86400, "months": 30 * 86400, "years": 365 * 86400}
# RabbitMQ's protocol aliases (rabbit_mgmt_wm_health_check_protocol_listener) -> Skred's names
_PROTOCOLS = {"amqp": "amqp", "amqp091": "amqp", "amqp0.9.1": "amqp", "amqp0-9-1": "amqp",
              "amqps": "amqp/ssl", "amqp/ssl": "amqp/ssl", "amqp091/ssl": "amqp/ssl",
              "http": "http", "management": "http", "https": "https", "management/ssl": "https",
              "prometheus": "http/prometheus", "http/prometheus": "http/prometheus"}


def _ok(**extra: Any) -> web.Response:
    return web.json_response({"status": "ok", **extra})


def _failed(reason: str, **extra: Any) -> web.Response:
    return web.json_response({"status": "failed", "reason": reason, **extra}, status=503)


def _listeners(request: web.Request) -> list[tuple[str, int]]:
    return [(proto, int(addr[1])) for proto, addr in request.app[MGMT_KEY].listeners()]


@routes.get("/api/health/checks/alarms")
@routes.get("/api/health/checks/local-alarms")
async def health_alarms(request: web.Request) -> web.Response:
    user_of(request)
    mgmt = request.app[MGMT_KEY]
    resources = mgmt.broker.alarm.resources()
    if resources:
        return _failed("resource alarm(s) in effect",
                       alarms=[{"resource": r, "node": mgmt.node_name} for r in resources])
    return _ok()


@routes.get("/api/health/checks/certificate-expiration/{within}/{unit}")
async def health_certificates(request: web.Request) -> web.Response:
    user_of(request)
    unit = request.match_info["unit"]
    try:
        within = int(request.match_info["within"])
    except ValueError:
        raise bad_request("Time period must be a non-negative integer.") from None
    if unit not in _UNIT_SECONDS or within < 0:
        raise bad_request("Time unit not recognised. Supported units: days, weeks, months, years.")
    deadline = time.time() + within * _UNIT_SECONDS[unit]
    expiring = []
    for path in request.app[MGMT_KEY].tls_certs:
        not_after = _not_after(path)
        if not_after is not None and not_after < deadline:
            expiring.append({"node": request.app[MGMT_KEY].node_name, "certfile": path,
                             "expiration_date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime(not_after))})
    if expiring:
        return _failed("Certificates expiring", expired=expiring)
    return _ok()


def _not_after(path: str) -> float | None:
    """The certificate file's notAfter as a Unix time; None when it cannot be read."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        return float(ssl.cert_time_to_seconds(decode(path)["notAfter"]))
    except (OSError, ValueError, KeyError, ssl.SSLError):
        return None


@routes.get("/api/health/checks/port-listener/{port}")
async def health_port(request: web.Request) -> web.Response:
    user_of(request)
    try:
        port = int(request.match_info["port"])
    except ValueError:
        raise bad_request("Invalid port value") from None
    ports = [p for _, p in _listeners(request)]
    if port in ports:
        return _ok(port=port)
    return _failed("No active listener", missing=port, ports=ports)


@routes.get("/api/health/checks/protocol-listener/{protocol}")
async def health_protocol(request: web.Request) -> web.Response:
    user_of(request)
    asked = request.match_info["protocol"]
    wanted = _PROTOCOLS.get(asked.lower(), asked)
    protocols = sorted({p for p, _ in _listeners(request)})
    if wanted in protocols:
        return _ok(protocol=wanted)
    return _failed("No active listener", missing=asked, protocols=protocols)


@routes.get("/api/health/checks/virtual-hosts")
async def health_vhosts(request: web.Request) -> web.Response:
    user_of(request)
    return _ok()


@routes.get("/api/health/checks/node-is-mirror-sync-critical")
@routes.get("/api/health/checks/node-is-quorum-critical")
async def health_critical(request: web.Request) -> web.Response:
    user_of(request)
    if request.app[MGMT_KEY].cluster is None:
        return _ok(reason="single node cluster")
    return _ok(reason="no queue depends on this node alone for a quorum or a mirror sync")


@routes.get("/api/healthchecks/node")
@routes.get("/api/healthchecks/node/{node}")
async def healthchecks_node(request: web.Request) -> web.Response:
    """RabbitMQ's older node check (kept by 3.10-3.12, used by load balancers and charts): the
    node answers, so it is ok, unless its app is stopped (``skredctl stop_app``). Another
    node's name is 404 (a follower is asked on its own port)."""
    user_of(request)
    mgmt = request.app[MGMT_KEY]
    node = request.match_info.get("node")
    if node is not None and node != mgmt.node_name:
        raise not_found(f"node '{node}' not found")
    if mgmt.app is not None and not mgmt.app.app_running:
        return _failed("the node's app is stopped (skredctl stop_app)")
    return _ok()


# -- small endpoints the management UI and tools read --------------------------------------------
@routes.get("/api/extensions")
async def extensions(request: web.Request) -> web.Response:
    user_of(request)
    return web.json_response([])  # no management-UI plugins


@routes.get("/api/feature-flags")
async def feature_flags(request: web.Request) -> web.Response:
    user_of(request)
    return web.json_response([])  # Skred has no feature flags: every node runs every feature
