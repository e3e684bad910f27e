"""Super streams built by skredctl, the management API and definitions; AMQP publishers routing
into them. On a single node, a cluster's leader and through a follower (``cluster_modes``)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any

import mmh3
import pika
import pytest

from ._support import REPO_ROOT, Broker, connect

pytestmark = pytest.mark.cluster_modes


def _creds(b: Broker) -> tuple[str, str]:
    url = urllib.parse.urlparse(b.url)
    return url.username or "guest", url.password or "guest"


def api(b: Broker, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    user, password = _creds(b)
    req = urllib.request.Request(f"http://{b.host}:{b.mgmt_port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw.strip() else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def ctl(b: Broker, *args: str) -> subprocess.CompletedProcess[str]:
    user, password = _creds(b)
    return subprocess.run([sys.executable, "-m", "broker.ctl", "--url", f"http://{b.host}:{b.mgmt_port}",
                           "-u", user, "-p", password, *args], capture_output=True, text=True, timeout=30,
                          cwd=str(REPO_ROOT))


def _messages(b: Broker, stream: str) -> list[str]:
    name = urllib.parse.quote(stream, safe="")
    status, body = api(b, "GET", f"/api/streams/%2F/{name}/messages?offset=first")
    assert status == 200, body
    return [m["payload"] for m in body["messages"]]


def test_skredctl_creates_grows_and_deletes_a_super_stream(shared_broker: Broker) -> None:
    ss = f"ss-{uuid.uuid4().hex[:8]}"
    r = ctl(shared_broker, "add_super_stream", ss, "--partitions", "3", "--max-age", "7D")
    assert r.returncode == 0, r.stderr
    assert f"{ss}-0, {ss}-1, {ss}-2" in r.stdout
    assert ctl(shared_broker, "add_super_stream", ss, "--partitions", "3").returncode != 0  # exists
    status, ex = api(shared_broker, "GET", f"/api/exchanges/%2F/{ss}")
    assert status == 200 and ex["type"] == "direct" and ex["arguments"] == {"x-super-stream": True}
    status, q = api(shared_broker, "GET", f"/api/queues/%2F/{ss}-1")
    assert status == 200 and q["arguments"] == {"x-queue-type": "stream", "x-max-age": "7D"}
    status, bindings = api(shared_broker, "GET", f"/api/exchanges/%2F/{ss}/bindings/source")
    assert sorted((x["destination"], x["routing_key"], x["arguments"]["x-stream-partition-order"])
                  for x in bindings) == [(f"{ss}-{i}", str(i), i) for i in range(3)]
    conn = connect(shared_broker)
    try:  # an AMQP publisher routes by routing key, with confirms
        ch = conn.channel()
        ch.confirm_delivery()
        for key in ("2", "0", "2"):
            ch.basic_publish(ss, key, f"to-{key}".encode(), pika.BasicProperties(delivery_mode=2),
                             mandatory=True)
    finally:
        conn.close()
    assert _messages(shared_broker, f"{ss}-2") == ["to-2", "to-2"]
    assert _messages(shared_broker, f"{ss}-0") == ["to-0"] and _messages(shared_broker, f"{ss}-1") == []
    r = ctl(shared_broker, "grow_super_stream", ss, "--partitions", "5")
    assert r.returncode == 0, r.stderr
    status, doc = api(shared_broker, "GET", f"/api/super-streams/%2F/{ss}")
    assert doc["partitions"] == [f"{ss}-{i}" for i in range(5)] and doc["binding_keys"] == list("01234")
    assert doc["routing"] == "key"
    assert _messages(shared_broker, f"{ss}-2") == ["to-2", "to-2"]  # growing keeps the data
    r = ctl(shared_broker, "delete_super_stream", ss)
    assert r.returncode == 0, r.stderr
    assert api(shared_broker, "GET", f"/api/exchanges/%2F/{ss}")[0] == 404
    assert all(api(shared_broker, "GET", f"/api/queues/%2F/{ss}-{i}")[0] == 404 for i in range(5))


def test_binding_keys_api_refusals_and_definitions_round_trip(shared_broker: Broker) -> None:
    ss = f"regions-{uuid.uuid4().hex[:8]}"
    path = f"/api/super-streams/%2F/{ss}"
    assert api(shared_broker, "PUT", path, {"binding_keys": ["eu", "us"]})[0] == 201
    assert api(shared_broker, "PUT", path, {"binding_keys": ["apac"]})[0] == 204  # grows by a key
    for bad in ({}, {"partitions": 2, "binding_keys": ["x"]}, {"binding_keys": ["a", "a"]},
                {"partitions": "many"}):
        assert api(shared_broker, "PUT", f"/api/super-streams/%2F/bad-{ss}", bad)[0] == 400, bad
    assert api(shared_broker, "GET", f"/api/super-streams/%2F/bad-{ss}")[0] == 404
    status, doc = api(shared_broker, "GET", path)
    assert doc["partitions"] == [f"{ss}-eu", f"{ss}-us", f"{ss}-apac"]
    status, defs = api(shared_broker, "GET", "/api/definitions")
    mine = {
        "queues": [q for q in defs["queues"] if q["name"].startswith(ss)],
        "exchanges": [x for x in defs["exchanges"] if x["name"] == ss],
        "bindings": [x for x in defs["bindings"] if x["source"] == ss],
    }
    assert len(mine["queues"]) == 3 and len(mine["bindings"]) == 3
    assert api(shared_broker, "DELETE", path)[0] == 204
    assert api(shared_broker, "GET", path)[0] == 404
    assert api(shared_broker, "POST", "/api/definitions", mine)[0] in (200, 201, 204)
    status, again = api(shared_broker, "GET", path)
    assert status == 200 and again == doc  # the same partitions, keys and order
    assert api(shared_broker, "DELETE", path)[0] == 204


def test_hash_routing_places_keys_as_the_stream_clients_do(shared_broker: Broker) -> None:
    """``--routing hash``: an AMQP publisher that knows nothing of partitions lands each key on
    MurmurHash3 x86_32 (seed 104729) modulo the count, the Java and Go clients' strategy."""
    ss = f"hashed-{uuid.uuid4().hex[:8]}"
    r = ctl(shared_broker, "add_super_stream", ss, "--partitions", "4", "--routing", "hash")
    assert r.returncode == 0, r.stderr
    keys = [f"customer-{i}" for i in range(24)]
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for key in keys:  # mandatory: an unroutable message would be returned (and fail the publish)
            ch.basic_publish(ss, key, key.encode(), pika.BasicProperties(delivery_mode=2), mandatory=True)
    finally:
        conn.close()
    want: dict[int, list[str]] = {}
    for key in keys:
        want.setdefault(mmh3.hash(key.encode(), 104729, signed=False) % 4, []).append(key)
    for i in range(4):
        assert _messages(shared_broker, f"{ss}-{i}") == want.get(i, [])
    assert ctl(shared_broker, "delete_super_stream", ss).returncode == 0
