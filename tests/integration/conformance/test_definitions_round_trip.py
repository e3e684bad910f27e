"""Definitions round trip with a real RabbitMQ: export from RabbitMQ, import into Skred, export
from Skred, import back into RabbitMQ; the objects RabbitMQ wrote come back unchanged each way.

Covers what Skred used to drop on the way: user limits, global parameters, topic permissions and
non-durable queues (RabbitMQ exports every non-exclusive queue). Uses the conformance harness's
session brokers (``targets``); skips like the harness when RabbitMQ is not installed.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

import pytest

from ._harness import Target
from ._wire import Run
from .scenarios_http import call, q

pytestmark = pytest.mark.timeout(180)


def _call(t: Target, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return call(Run(t.name, t.host, t.port, t.mgmt_port), method, path, body, record=False)


def _ok(t: Target, method: str, path: str, body: Any = None) -> Any:
    status, parsed = _call(t, method, path, body)
    assert status in (200, 201, 204), (t.name, method, path, status, parsed)
    return parsed


def _ours(doc: dict[str, Any], vh: str, user: str, param: str) -> dict[str, Any]:
    """The part of an export that names this test's vhost, user and global parameter, sorted."""
    def key(x: dict[str, Any]) -> str:
        return json.dumps(x, sort_keys=True)

    def mine(x: dict[str, Any]) -> bool:
        return x.get("vhost") == vh or x.get("user") == user or x.get("name") in (user, param)
    doc = copy.deepcopy(doc)
    out: dict[str, Any] = {}
    for section in ("users", "permissions", "topic_permissions", "queues", "exchanges", "bindings",
                    "global_parameters", "parameters", "policies"):
        out[section] = sorted((x for x in doc.get(section, []) if mine(x)), key=key)
    for u in out["users"]:
        u.pop("password_hash", None)  # each broker hashes with its own salt when it imports
    return out


def test_definitions_round_trip_with_rabbitmq(targets: tuple[Target, Target]) -> None:
    rabbit, skred = targets
    tag = uuid.uuid4().hex[:8]
    vh, user, param = f"rt-vh-{tag}", f"rt-user-{tag}", f"rt-param-{tag}"
    _ok(rabbit, "PUT", f"/api/vhosts/{q(vh)}", {})
    _ok(rabbit, "PUT", f"/api/users/{q(user)}", {"password": "pw", "tags": "management"})
    _ok(rabbit, "PUT", f"/api/permissions/{q(vh)}/{q(user)}",
        {"configure": ".*", "write": ".*", "read": ".*"})
    _ok(rabbit, "PUT", f"/api/topic-permissions/{q(vh)}/{q(user)}",
        {"exchange": "amq.topic", "write": "^pub\\.", "read": "^sub\\."})
    _ok(rabbit, "PUT", f"/api/user-limits/{q(user)}/max-connections", {"value": 7})
    _ok(rabbit, "PUT", f"/api/user-limits/{q(user)}/max-channels", {"value": 20})
    _ok(rabbit, "PUT", f"/api/global-parameters/{q(param)}", {"value": {"region": "eu", "n": 3}})
    _ok(rabbit, "PUT", f"/api/queues/{q(vh)}/transient", {"durable": False, "auto_delete": False})
    _ok(rabbit, "PUT", f"/api/queues/{q(vh)}/kept", {"durable": True})
    _ok(rabbit, "POST", f"/api/bindings/{q(vh)}/e/amq.topic/q/transient", {"routing_key": "sub.#"})
    try:
        from_rabbit = _ok(rabbit, "GET", "/api/definitions")
        want = _ours(from_rabbit, vh, user, param)
        assert want["topic_permissions"] and want["global_parameters"], want
        assert {x["name"] for x in want["queues"]} == {"transient", "kept"}, want["queues"]

        # RabbitMQ -> Skred: the whole export imports, and Skred exports our objects as RabbitMQ did
        status, body = _call(skred, "POST", "/api/definitions", from_rabbit)
        assert status in (200, 204), body
        from_skred = _ok(skred, "GET", "/api/definitions")
        assert _ours(from_skred, vh, user, param) == want

        # Skred -> RabbitMQ: remove ours from RabbitMQ, import Skred's export, compare again
        _ok(rabbit, "DELETE", f"/api/vhosts/{q(vh)}")
        _ok(rabbit, "DELETE", f"/api/users/{q(user)}")
        _ok(rabbit, "DELETE", f"/api/global-parameters/{q(param)}")
        assert _ours(_ok(rabbit, "GET", "/api/definitions"), vh, user, param)["users"] == []
        _ok(rabbit, "POST", "/api/definitions", from_skred)
        assert _ours(_ok(rabbit, "GET", "/api/definitions"), vh, user, param) == want
    finally:
        for t in targets:
            _call(t, "DELETE", f"/api/vhosts/{q(vh)}")
            _call(t, "DELETE", f"/api/users/{q(user)}")
            _call(t, "DELETE", f"/api/global-parameters/{q(param)}")
