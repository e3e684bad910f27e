"""Policies over HTTP applied live, delayed messages, consumer timeout, consistent hash,
deduplication, vhost limits and the disk alarm (real broker, pika)."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pika
import pytest

from ._support import Broker, connect, drain, is_external, queue_count, unique, wait_until

pytestmark = pytest.mark.skipif(is_external(), reason="needs Skred's management API / process control")


def http(b: Broker, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    port = getattr(b, "mgmt_port")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, text = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read()
    return status, (json.loads(text) if text.strip() else None)


def wait_http(b: Broker) -> None:
    def up() -> bool:
        try:
            return http(b, "GET", "/api/overview")[0] == 200
        except OSError:
            return False
    wait_until(up, 10, "management API")


def qs(name: str) -> str:
    return urllib.parse.quote(name, safe="")


# ------------------------------------------------------------------ 1. policies over HTTP
def test_http_policy_applies_live_and_survives_restart(broker: Broker) -> None:
    wait_http(broker)
    conn = connect(broker)
    ch = conn.channel()
    q = unique("pol")
    ch.queue_declare(q, durable=True)
    for i in range(5):
        ch.basic_publish("", q, f"m{i}".encode())
    assert queue_count(conn, q) == 5
    # A max-length policy set over HTTP trims the existing queue at once (drop-head).
    st, _ = http(broker, "PUT", "/api/policies/%2F/lim",
                 {"pattern": "^" + q.replace(".", "\\.") + "$", "definition": {"max-length": 2},
                  "apply-to": "queues"})
    assert st == 201
    assert queue_count(conn, q) == 2
    for i in range(5, 8):
        ch.basic_publish("", q, f"m{i}".encode())
    assert queue_count(conn, q) == 2
    assert http(broker, "GET", "/api/policies/%2F/lim")[1]["definition"] == {"max-length": 2}
    # An operator policy caps lower; the model rejects max-priority in a policy (400).
    assert http(broker, "PUT", "/api/operator-policies/%2F/op",
                {"pattern": "^skredtest", "definition": {"max-length": 1}})[0] == 201
    assert queue_count(conn, q) == 1
    assert http(broker, "PUT", "/api/policies/%2F/bad",
                {"pattern": ".", "definition": {"max-priority": 3}})[0] == 400
    conn.close()
    broker.restart()
    wait_http(broker)
    conn = connect(broker)
    ch = conn.channel()
    assert [p["name"] for p in http(broker, "GET", "/api/policies/%2F")[1]] == ["lim"]
    assert [p["name"] for p in http(broker, "GET", "/api/operator-policies/%2F")[1]] == ["op"]
    assert http(broker, "DELETE", "/api/operator-policies/%2F/op")[0] == 204
    for i in range(3):
        ch.basic_publish("", q, f"n{i}".encode())
    assert queue_count(conn, q) == 2
    # Removing the policy lifts the limit live.
    assert http(broker, "DELETE", "/api/policies/%2F/lim")[0] == 204
    assert http(broker, "GET", "/api/policies/%2F/lim")[0] == 404
    for i in range(3):
        ch.basic_publish("", q, f"k{i}".encode())
    assert queue_count(conn, q) == 5
    # Definitions export carries the policy; import applies it.
    doc = {"policies": [{"vhost": "/", "name": "imp", "pattern": "^" + q.replace(".", "\\.") + "$",
                         "definition": {"max-length": 3}, "priority": 0, "apply-to": "queues"}]}
    assert http(broker, "POST", "/api/definitions", doc)[0] in (200, 201, 204)
    assert queue_count(conn, q) == 3
    assert any(p["name"] == "imp" for p in http(broker, "GET", "/api/definitions")[1]["policies"])
    conn.close()
