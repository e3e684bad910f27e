"""Restarts of a node with many durable queues: boot reads no queue's directory, yet every
queue, binding, message and counter comes back (issue 26, item 6).

Theory of operation: the queues are filled through real clients (some bound, some holding
persistent confirmed messages of which one was got and acked). Single node: a clean stop and
restart, where the management API's queue list (read at once, while the node may still be
recovering stores in the background) must show every queue with its exact message count;
then kill -9 and restart, where every message is consumed again, flagged redelivered.
Cluster: the same queues are filled through a follower's proxy, the leader is killed -9,
and the new leader (which boots from its replicated copy the same way) must list and serve
them all, through its own port and through the remaining follower. How long a restart takes
is ``benchmarks/restart.py``'s business; the count of directories a boot reads is
``tests/test_boot_deferred.py``'s.
"""

from __future__ import annotations

import base64
import json
import urllib.request

import pika
import pytest

from ._support import Broker, SkredProcess, is_external, wait_until
from .cluster_faults import api_leader
from .test_cluster import TTL, Cluster, cluster, start_cluster, wait_for  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(is_external(), reason="restarts a Skred process of its own")

QUEUES = 150
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _name(i: int) -> str:
    return f"restart-many.{i:04d}"


def _fill(url: str) -> dict[str, list[bytes]]:
    """Declare QUEUES durable queues (every 10th bound to amq.direct); every 9th gets four
    persistent confirmed messages, the first of which is got and acked. Returns the bodies
    left in each queue that has any."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        left: dict[str, list[bytes]] = {}
        for i in range(QUEUES):
            ch.queue_declare(_name(i), durable=True)
            if i % 10 == 0:
                ch.queue_bind(_name(i), "amq.direct", routing_key=_name(i))
        for i in range(0, QUEUES, 9):
            exchange = "amq.direct" if i % 10 == 0 else ""
            bodies = [f"{_name(i)}/{k}".encode() for k in range(4)]
            for body in bodies:
                ch.basic_publish(exchange, _name(i), body, PERSISTENT)
            method, _props, body = ch.basic_get(_name(i))
            assert method is not None and body == bodies[0]
            ch.basic_ack(method.delivery_tag)
            left[_name(i)] = bodies[1:]
        return left
    finally:
        conn.close()


def _listed(host: str, port: int) -> dict[str, int]:
    """``{queue: messages}`` of our queues as the management API lists them."""
    req = urllib.request.Request(f"http://{host}:{port}/api/queues/%2F?columns=name,messages")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(req, timeout=30) as resp:
        rows = json.loads(resp.read())
    return {r["name"]: int(r.get("messages") or 0) for r in rows if r["name"].startswith("restart-many.")}


def _expected_listing(left: dict[str, list[bytes]]) -> dict[str, int]:
    return {_name(i): len(left.get(_name(i), ())) for i in range(QUEUES)}


def _check_passive(url: str, left: dict[str, list[bytes]]) -> None:
    """Every queue answers a passive declare with its exact message count."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for i in range(QUEUES):
            count = ch.queue_declare(_name(i), passive=True).method.message_count
            assert count == len(left.get(_name(i), ())), _name(i)
    finally:
        conn.close()


def _consume(url: str, left: dict[str, list[bytes]]) -> None:
    """Get and ack everything left; after a crash every recovered message is redelivered."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for name, bodies in left.items():
            got = []
            while True:
                method, _props, body = ch.basic_get(name)
                if method is None:
                    break
                assert method.redelivered, (name, body)
                got.append(body)
                ch.basic_ack(method.delivery_tag)
            assert got == bodies, name
        ch.basic_publish("amq.direct", _name(0), b"after", PERSISTENT)  # bindings came back
        method, _props, body = ch.basic_get(_name(0), auto_ack=True)
        assert body == b"after"
    finally:
        conn.close()


def test_restart_keeps_every_queue_message_and_count(broker: Broker) -> None:
    assert isinstance(broker, SkredProcess)
    left = _fill(broker.url)
    broker.restart()  # clean stop: stores are read after the node serves, or on first use
    assert _listed(broker.host, broker.mgmt_port) == _expected_listing(left)
    _check_passive(broker.url, left)
    wait_until(lambda: "queue stores recovered" in broker.log_text(), 20, "the store reader's report")
    broker.kill9()
    broker.start()
    _check_passive(broker.url, left)
    _consume(broker.url, left)


def test_new_leader_serves_many_queues(cluster: Cluster) -> None:  # noqa: F811 (the fixture)
    c = cluster
    leader, followers = start_cluster(c)
    left = _fill(followers[0].url)  # through a follower's proxy to the leader
    leader.kill9()
    try:
        successor = wait_for(lambda: api_leader(c, exclude=leader), TTL + 20,
                             "a new leader serving clients")
    except AssertionError:
        raise AssertionError(c.diag()) from None
    other = next(f for f in followers if f is not successor)
    assert _listed(successor.ip, successor.mgmt_port) == _expected_listing(left)
    wait_for(other.answers, 30, "the other follower's proxy to the new leader")
    _check_passive(other.url, left)
    _consume(successor.url, left)
    wait_for(lambda: "queue stores recovered" in successor.log_text(), 20, "the new leader's store reader")
