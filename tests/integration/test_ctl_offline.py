"""``skredctl definitions DATADIR``: a stopped node's definitions read from its files equal what
the running node exported, after kill -9, and reading changes nothing (a torn last record is
skipped, not trimmed). Single node: a follower's data directory is the leader's, replicated."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika

from ._support import SkredProcess, unique, wait_until
from .test_ctl_lavinmq import js, ok
from .test_mgmt_api import http_ready, pytestmark  # noqa: F401


def _topology(doc: dict[str, Any]) -> dict[str, Any]:
    def rows(key: str, *fields: str) -> list[tuple[Any, ...]]:
        return sorted(tuple(json.dumps(e.get(f), sort_keys=True) for f in fields) for e in doc[key])

    return {
        "queues": rows("queues", "vhost", "name", "durable", "auto_delete", "arguments"),
        "exchanges": rows(
            "exchanges", "vhost", "name", "type", "durable", "auto_delete", "internal", "arguments"
        ),
        "bindings": rows(
            "bindings", "vhost", "source", "destination", "destination_type", "routing_key", "arguments"
        ),
        "policies": rows("policies", "vhost", "name", "pattern", "definition", "priority", "apply-to"),
        "users": rows("users", "name", "password_hash", "tags"),
        "permissions": rows("permissions", "user", "vhost", "configure", "write", "read"),
        "vhosts": sorted(v["name"] for v in doc["vhosts"]),
        "parameters": rows("parameters", "vhost", "component", "name", "value"),
    }


def test_definitions_of_a_killed_node(broker: SkredProcess) -> None:
    wait_until(lambda: http_ready(broker.mgmt_port), 10, "management HTTP listener")
    vh, q1, q2, x, user = unique("vh"), unique("q"), unique("q"), unique("x"), unique("u")
    ok(broker, "add_vhost", vh)
    ok(broker, "add_user", user, "pw", "--tags", "monitoring")
    ok(broker, "set_permissions", user, ".*", "", "^r", "--vhost", vh)
    ok(broker, "create_queue", q1, "--durable", "--vhost", vh, "--max-length", "5")
    ok(broker, "create_queue", q2, "--durable", "--vhost", vh)
    ok(broker, "create_exchange", "topic", x, "--durable", "--vhost", vh)
    ok(broker, "set_policy", "pol", "^none", '{"message-ttl": 1000}', "--vhost", vh)
    ok(broker, "set_vhost_limits", '{"max-queues": 50}', "--vhost", vh)
    conn = pika.BlockingConnection(pika.URLParameters(broker.url.replace("%2F", quote(vh, safe=""))))
    try:
        ch = conn.channel()
        ch.queue_bind(q1, x, "a.#")
        ch.queue_bind(q2, x, "b.*")
        ch.exchange_bind(x, "amq.direct", "k")
        ch.queue_unbind(q2, x, "b.*")
        ch.queue_delete(q2)  # deleted: not in the offline document
        ch.queue_declare("", exclusive=True)  # transient: not there either
    finally:
        conn.close()
    exported = js(broker, "export_definitions")
    broker.kill9()  # the harder case than a clean stop: nothing flushed on the way out
    wait_until(lambda: not broker.alive(), 10, "the node stopped")
    log = next(
        p for p in Path(broker.data_dir).glob("*/definitions.amqp") if (p.parent / ".vhost").read_text() == vh
    )
    with log.open("ab") as fh:  # a torn last record, as a crash mid-append leaves
        fh.write(b"\x40\x00\x00\x00partial")
    before = hashlib.sha256(log.read_bytes()).hexdigest()
    offline = js(broker, "definitions", str(broker.data_dir))
    assert hashlib.sha256(log.read_bytes()).hexdigest() == before  # read only
    assert _topology(offline) == _topology(exported)
    assert q2 not in {q["name"] for q in offline["queues"]}
    assert {b["destination_type"] for b in offline["bindings"]} == {"queue", "exchange"}


def test_definitions_of_what_is_not_a_data_dir(tmp_path: Path) -> None:
    from .test_ctl_lavinmq import run

    class Nowhere:  # no broker at all: the command must not need one
        mgmt_port = 1
        url = "amqp://guest:guest@127.0.0.1:1/%2F"

    r = run(Nowhere(), "definitions", str(tmp_path))  # type: ignore[arg-type]
    assert r.returncode == 1 and "not a Skred data directory" in r.stderr
