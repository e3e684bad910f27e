"""Definitions as RabbitMQ 3.x/4.x write them: quorum and stream queues, vhost metadata and
default queue type, vhost limits and operator policies (both exported by RabbitMQ as runtime
``parameters``), and export -> wipe -> import -> export giving the identical document."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import unique, wait_until
from .test_mgmt_api import Api, http_ready, pytestmark, q, start_mgmt_broker

__all__ = ["pytestmark"]

# The shape of `rabbitmqctl export_definitions` / GET /api/definitions on RabbitMQ 4.0.
RABBITMQ4_EXPORT: dict[str, Any] = {
    "bindings": [
        {"arguments": {}, "destination": "tasks", "destination_type": "queue", "routing_key": "tasks",
         "source": "celery", "vhost": "prod"},
        {"arguments": {}, "destination": "events", "destination_type": "queue", "routing_key": "#",
         "source": "amq.topic", "vhost": "prod"},
    ],
    "exchanges": [
        {"arguments": {}, "auto_delete": False, "durable": True, "name": "celery", "type": "direct",
         "vhost": "prod"},
    ],
    "global_parameters": [
        {"name": "cluster_name", "value": "rabbit@rmq-0"},
        {"name": "internal_cluster_id", "value": "rabbitmq-cluster-id-0vPL8mEqnRXW3DeJYmo7Fg"},
    ],
    "parameters": [
        {"component": "vhost-limits", "name": "limits", "value": {"max-connections": 50, "max-queues": 200},
         "vhost": "prod"},
        {"component": "operator_policy", "name": "cap",
         "value": {"apply-to": "queues", "definition": {"max-length": 100000}, "pattern": ".*",
                   "priority": 0}, "vhost": "prod"},
    ],
    "permissions": [
        {"configure": ".*", "read": ".*", "user": "app", "vhost": "prod", "write": ".*"},
    ],
    "policies": [
        {"apply-to": "queues", "definition": {"delivery-limit": 5}, "name": "dl", "pattern": "^tasks$",
         "priority": 1, "vhost": "prod"},
    ],
    "product_name": "RabbitMQ",
    "product_version": "4.0.5",
    "queues": [
        {"arguments": {"x-queue-type": "quorum"}, "auto_delete": False, "durable": True, "name": "tasks",
         "type": "quorum", "vhost": "prod"},
        {"arguments": {"x-queue-type": "stream", "x-max-length-bytes": 20000000000},
         "auto_delete": False, "durable": True, "name": "events", "type": "stream", "vhost": "prod"},
        {"arguments": {"x-queue-type": "classic"}, "auto_delete": False, "durable": True, "name": "legacy",
         "type": "classic", "vhost": "prod"},
        {"arguments": {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish",
                       "x-queue-type": "quorum", "x-dead-letter-exchange": ""},
         "auto_delete": False, "durable": True, "name": "tasks.dlq-safe", "type": "quorum", "vhost": "prod"},
    ],
    "rabbit_version": "4.0.5",
    "rabbitmq_version": "4.0.5",
    "topic_permissions": [
        {"exchange": "amq.topic", "read": ".*", "user": "app", "vhost": "prod", "write": ".*"},
    ],
    "users": [
        {"hashing_algorithm": "rabbit_password_hashing_sha256", "limits": {}, "name": "app",
         "password_hash": "0vp/e8Hgn3DGcrlUAjAwXBq8w7FwbeD4atJE1N+jPX3Ww+a0", "tags": ["management"]},
    ],
    "vhosts": [
        {"default_queue_type": "quorum", "description": "production", "limits": [],
         "metadata": {"default_queue_type": "quorum", "description": "production", "tags": ["prod"]},
         "name": "prod", "tags": ["prod"]},
    ],
}


def test_rabbitmq4_export_imports_whole(tmp_path: Path) -> None:
    b = start_mgmt_broker(tmp_path)
    try:
        api = Api(b.mgmt_port)
        status, body, _ = api.call("POST", "/api/definitions", RABBITMQ4_EXPORT)
        assert status == 204, body
        types = {x["name"]: x["type"] for x in api.get("/api/queues/prod")}
        assert types == {"tasks": "quorum", "events": "stream", "legacy": "classic",
                         "tasks.dlq-safe": "quorum"}
        vhost = api.get("/api/vhosts/prod")
        assert vhost["default_queue_type"] == "quorum" and vhost["description"] == "production"
        assert vhost["tags"] == ["prod"]
        assert api.get("/api/vhost-limits/prod")[0]["value"] == {"max-connections": 50, "max-queues": 200}
        assert [p["name"] for p in api.get("/api/operator-policies/prod")] == ["cap"]
        assert [p["name"] for p in api.get("/api/policies/prod")] == ["dl"]
        # the vhost's default type applies to a queue declared without one
        api.ok("PUT", "/api/permissions/prod/guest", {"configure": ".*", "write": ".*", "read": ".*"})
        api.ok("PUT", "/api/queues/prod/fresh", {"durable": True})
        assert api.get("/api/queues/prod/fresh")["type"] == "quorum"
        # and the whole document goes back out with what RabbitMQ puts in it
        doc = api.get("/api/definitions")
        params = {(p["component"], p["name"]): p["value"] for p in doc["parameters"]}
        assert params[("vhost-limits", "limits")] == {"max-connections": 50, "max-queues": 200}
        assert params[("operator_policy", "cap")]["definition"] == {"max-length": 100000}
        prod = next(v for v in doc["vhosts"] if v["name"] == "prod")
        assert prod["default_queue_type"] == "quorum"
        assert prod["metadata"]["default_queue_type"] == "quorum"
    finally:
        b.close()


def _build(api: Api, vh: str) -> None:
    api.ok("PUT", f"/api/vhosts/{q(vh)}", {"description": "d", "tags": "a,b",
                                           "default_queue_type": "quorum"})
    api.ok("PUT", f"/api/queues/{q(vh)}/st", {"durable": True, "arguments": {"x-queue-type": "stream"}})
    api.ok("PUT", f"/api/queues/{q(vh)}/qq", {"durable": True, "type": "quorum"})
    api.ok("PUT", f"/api/queues/{q(vh)}/dq", {"durable": True})  # the vhost default: quorum
    api.ok("PUT", f"/api/queues/{q(vh)}/cq", {"durable": True, "arguments": {"x-queue-type": "classic"}})
    api.ok("PUT", f"/api/exchanges/{q(vh)}/ex", {"type": "topic"})
    api.ok("POST", f"/api/bindings/{q(vh)}/e/ex/q/st", {"routing_key": "s.#"})
    api.ok("PUT", f"/api/vhost-limits/{q(vh)}/max-queues", {"value": 100})
    api.ok("PUT", f"/api/operator-policies/{q(vh)}/cap", {"pattern": ".*", "definition": {"max-length": 10},
                                                          "apply-to": "queues"})
    api.ok("PUT", f"/api/policies/{q(vh)}/ttl", {"pattern": "^c", "definition": {"message-ttl": 1000}})


@pytest.mark.timeout(90)
def test_export_wipe_import_export_is_identical(tmp_path: Path) -> None:
    b = start_mgmt_broker(tmp_path)
    try:
        api = Api(b.mgmt_port)
        vh = unique("vh")
        _build(api, vh)
        assert {x["name"]: x["type"] for x in api.get(f"/api/queues/{q(vh)}")} == {
            "st": "stream", "qq": "quorum", "dq": "quorum", "cq": "classic"}
        first = api.get("/api/definitions")
        b.stop()
        shutil.rmtree(b.data_dir)  # wipe
        b.data_dir.mkdir()
        b.start()
        wait_until(lambda: http_ready(b.mgmt_port), 10, "management HTTP listener")
        assert api.get("/api/definitions") != first
        status, body, _ = api.call("POST", "/api/definitions", first)
        assert status == 204, body
        assert api.get("/api/definitions") == first
        # and a restart keeps every type
        b.stop()
        b.start()
        wait_until(lambda: http_ready(b.mgmt_port), 10, "management HTTP listener")
        assert api.get("/api/definitions") == first
    finally:
        b.close()


def test_real_rabbitmq_310_export_imports_whole(tmp_path: Path) -> None:
    """data/rabbitmq-3.10-definitions.json is GET /api/definitions of a RabbitMQ 3.10.8 (one vhost
    kept): quorum, stream and classic queues, vhost limits and an operator policy as parameters,
    topic permissions, a user with RabbitMQ's own password hash."""
    doc = json.loads((Path(__file__).parent / "data" / "rabbitmq-3.10-definitions.json").read_text())
    b = start_mgmt_broker(tmp_path)
    try:
        api = Api(b.mgmt_port)
        status, body, _ = api.call("POST", "/api/definitions", doc)
        assert status == 204, body
        assert {x["name"]: x["type"] for x in api.get("/api/queues/prod")} == {
            "dq": "classic", "events": "stream", "legacy": "classic", "tasks": "quorum"}
        assert api.get("/api/vhost-limits/prod")[0]["value"] == {"max-connections": 50, "max-queues": 200}
        assert [p["name"] for p in api.get("/api/operator-policies/prod")] == ["cap"]
        assert {(x["source"], x["destination"]) for x in api.get("/api/bindings/prod")} >= {
            ("amq.topic", "events"), ("celery", "tasks")}
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", b.port, "prod", pika.PlainCredentials("app", "app-pw")))
        conn.close()
    finally:
        b.close()
