"""Definitions: export -> fresh broker -> import -> same topology; load_definitions at boot; bad docs."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import SkredProcess, unique
from .test_mgmt_api import Api, assert_error, pytestmark, q, start_mgmt_broker  # noqa: F401

__all__ = ["pytestmark"]


def topology(api: Api) -> dict[str, Any]:
    doc = api.get("/api/definitions")
    return {k: sorted(json.dumps(e, sort_keys=True) for e in doc[k])
            for k in ("users", "vhosts", "permissions", "policies", "queues", "exchanges", "bindings")}


def build(api: Api, vh: str) -> None:
    api.ok("PUT", f"/api/vhosts/{q(vh)}")
    api.ok("PUT", "/api/users/alice", {"password": "alice-pw", "tags": "management"})
    api.ok("PUT", f"/api/permissions/{q(vh)}/alice", {"configure": "^a.*", "write": ".*", "read": ".*"})
    api.ok("PUT", f"/api/exchanges/{q(vh)}/events", {"type": "topic", "durable": True})
    api.ok("PUT", f"/api/exchanges/{q(vh)}/fan", {"type": "fanout", "durable": True,
                                                  "arguments": {"alternate-exchange": "events"}})
    api.ok("PUT", f"/api/queues/{q(vh)}/orders", {"durable": True, "arguments": {"x-max-length": 100}})
    api.ok("PUT", "/api/queues/%2F/root-q", {"durable": True})
    api.ok("POST", f"/api/bindings/{q(vh)}/e/events/q/orders", {"routing_key": "order.*"})
    api.ok("POST", f"/api/bindings/{q(vh)}/e/fan/e/events", {"routing_key": ""})
    api.ok("PUT", f"/api/policies/{q(vh)}/lim", {"pattern": "^o", "definition": {"max-length": 5}})


@pytest.mark.timeout(60)
def test_round_trip_to_fresh_broker_and_boot_import(tmp_path: Path) -> None:
    vh = unique("vh")
    first = start_mgmt_broker(tmp_path / "a")
    try:
        api1 = Api(first.mgmt_port)
        build(api1, vh)
        doc = api1.get("/api/definitions")
        expected = topology(api1)
    finally:
        first.close()
    second = start_mgmt_broker(tmp_path / "b")
    try:
        api2 = Api(second.mgmt_port)
        assert topology(api2) != expected
        assert api2.call("POST", "/api/definitions", doc)[0] == 204
        # guest's hash differs per data dir; the imported one (same doc) replaced it
        assert topology(api2) == expected
        assert api2.call("POST", "/api/definitions", doc)[0] == 204  # importing twice is a no-op
        assert topology(api2) == expected
        # the imported user logs in over AMQP with the password hashed by the first broker
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", second.port, vh, pika.PlainCredentials("alice", "alice-pw"),
            socket_timeout=5, connection_attempts=1))
        conn.channel().basic_publish("events", "order.1", b"x")
        conn.close()
        api2.get(f"/api/queues/{q(vh)}/orders")
        per_vhost = api2.get(f"/api/definitions/{q(vh)}")
        assert "users" not in per_vhost and all("vhost" not in x for x in per_vhost["queues"])
    finally:
        second.close()
    path = tmp_path / "defs.json"
    path.write_text(json.dumps(doc))
    third = start_mgmt_broker(tmp_path / "c", ["--load-definitions", str(path)])
    try:
        assert topology(Api(third.mgmt_port)) == expected
    finally:
        third.close()


def test_bad_definitions_change_nothing(tmp_path: Path) -> None:
    b: SkredProcess = start_mgmt_broker(tmp_path)
    try:
        api = Api(b.mgmt_port)
        before = topology(api)
        qn = unique("q")
        good_queue = {"name": qn, "vhost": "/", "durable": True, "auto_delete": False, "arguments": {}}
        bad_docs: list[Any] = [
            [1, 2],
            {"queues": [good_queue, {**good_queue, "name": "t", "arguments": {"x-queue-type": "bogus"}}]},
            {"queues": [{**good_queue, "durable": False, "arguments": {"x-queue-type": "quorum"}}]},
            {"queues": [good_queue, {"name": "x", "vhost": "no-such-vhost", "durable": True}]},
            {"queues": [good_queue], "exchanges": [{"name": "e", "vhost": "/", "type": "nope"}]},
            {"queues": [good_queue], "bindings": [{"source": "missing", "vhost": "/", "destination": qn,
                                                   "destination_type": "queue", "routing_key": ""}]},
            {"users": [{"name": "u1", "password_hash": 5}]},
            {"queues": [{**good_queue, "durable": "yes"}]},
            {"permissions": [{"user": "nobody", "vhost": "/", "configure": "", "write": "", "read": ""}]},
        ]
        for doc in bad_docs:
            assert_error(api.call("POST", "/api/definitions", doc), 400)
        assert_error(api.call("POST", "/api/definitions", raw=b"{not json"), 400)
        assert_error(api.call("POST", "/api/definitions/no-such-vhost", {}), 404)
        assert topology(api) == before
        # and a bad file at boot stops the broker with a clear log line
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad_docs[3]))
        b.close()
        bad = SkredProcess(tmp_path / "data-bad", ["--load-definitions", str(path)])
        proc = bad.spawn()
        try:
            assert proc.wait(20) == 1
            assert "no-such-vhost" in bad.log_text()
        finally:
            bad.close()
    finally:
        b.close()


def _io_ops(pid: int) -> int:
    """System calls that read or wrote, of the broker's process (``/proc/<pid>/io``): a count of
    operations, which the machine's load does not change as it changes time."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["syscr"]) + int(fields["syscw"])


@pytest.mark.timeout(120)
def test_importing_queues_costs_in_proportion_to_their_number(tmp_path: Path) -> None:
    """1,000 queues (and a binding each) cost about twice what 500 cost, in the broker's read and
    write system calls: the import does a fixed amount of work per queue, none per queue already
    there (benchmarks/definitions_import.py times it; docs/performance.md)."""
    b = start_mgmt_broker(tmp_path)
    try:
        api = Api(b.mgmt_port)
        assert b.pid is not None
        ops = []
        for n in (500, 1000):
            vh = unique("imp")
            names = [f"q{i:05d}" for i in range(n)]
            doc = {"vhosts": [{"name": vh}],
                   "queues": [{"name": q, "vhost": vh, "durable": True, "auto_delete": False, "arguments": {}}
                              for q in names],
                   "bindings": [{"source": "amq.direct", "vhost": vh, "destination": q, "routing_key": q,
                                 "destination_type": "queue", "arguments": {}} for q in names]}
            before = _io_ops(b.pid)
            req = urllib.request.Request(api.base + "/api/definitions", data=json.dumps(doc).encode(),
                                         method="POST", headers={"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q=",
                                                                 "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=100) as resp:  # 1,000 queues take seconds
                assert resp.status == 204
            ops.append(_io_ops(b.pid) - before)
        print(f"read/write system calls: {ops[0]} for 500 queues, {ops[1]} for 1,000")
        assert 1.6 <= ops[1] / ops[0] <= 2.4, ops
    finally:
        b.close()
