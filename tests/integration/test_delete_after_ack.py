"""A queue deleted right after an ack must not wedge the group commit (issue 26, item 1).

Theory of operation: declare a durable queue, publish a persistent message with a confirm,
``basic.get`` it, ack it and delete the queue, all inside the ack-sync window (the window is
set to 30 s so "inside" does not depend on the machine's load). The ack is buffered in the
deleted store; a clustered leader's replication hook used to flush every store the group
commit covered, that one included, and its ``FileNotFoundError`` escaped before the dirty set
was cleared: from then on every durable ``queue.declare``, ``tx.commit`` and confirmed
persistent publish on that leader got ``541 INTERNAL_ERROR`` while being applied anyway.
Here the scenario runs against a single node, through a follower (proxied to the leader) and
on the leader itself, and after each one those three operations must succeed and have
happened exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pytest

from ._support import Broker, connect, unique
from .test_cluster import Cluster, _loopback_ok, start_cluster

pytestmark = pytest.mark.timeout(180)

WINDOW = ["--ack-sync-interval", "30000"]


def _connect(url: str) -> pika.BlockingConnection:
    p = pika.URLParameters(url)
    p.socket_timeout = 5
    p.blocked_connection_timeout = 10
    p.connection_attempts = 1
    return pika.BlockingConnection(p)


def _ack_then_delete(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    q = unique("acked-then-deleted")
    ch.queue_declare(q, durable=True)
    ch.basic_publish("", q, b"m", pika.BasicProperties(delivery_mode=2))
    method, _, body = ch.basic_get(q)
    assert method is not None and body == b"m"
    ch.basic_ack(method.delivery_tag)
    ch.queue_delete(q)
    ch.close()


def _durable_work_succeeds(conn: pika.BlockingConnection, rounds: int = 3) -> None:
    """Durable declare, tx.commit and confirmed persistent publish each succeed, and each
    happened once (the queue exists; the committed and confirmed messages are there)."""
    for _ in range(rounds):
        q = unique("after-delete")
        ch = conn.channel()
        ch.queue_declare(q, durable=True)  # declare-ok waits for the group commit
        tx = conn.channel()
        tx.tx_select()
        tx.basic_publish("", q, b"tx", pika.BasicProperties(delivery_mode=2))
        tx.tx_commit()
        ch.confirm_delivery()
        ch.basic_publish("", q, b"confirmed", pika.BasicProperties(delivery_mode=2))
        bodies = []
        while (got := ch.basic_get(q, auto_ack=True))[0] is not None:
            bodies.append(got[2])
        assert sorted(bodies) == [b"confirmed", b"tx"]
        ch.queue_delete(q)
        ch.close()
        tx.close()


def _scenario(url: str) -> None:
    conn = _connect(url)
    try:
        _ack_then_delete(conn)
        _durable_work_succeeds(conn)
    finally:
        if conn.is_open:
            conn.close()


def test_single_node_durable_work_after_ack_then_delete(broker_factory: Callable[..., Broker]) -> None:
    b = broker_factory(WINDOW)
    conn = connect(b)
    try:
        _ack_then_delete(conn)
        _durable_work_succeeds(conn)
    finally:
        if conn.is_open:
            conn.close()


@pytest.fixture
def cluster2(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ips=["127.0.0.1", "127.0.0.2" if _loopback_ok("127.0.0.2") else "127.0.0.1"])
    for n in c.nodes:
        n.argv += WINDOW
    try:
        yield c
    finally:
        c.close()


def test_cluster_durable_work_after_ack_then_delete(cluster2: Cluster) -> None:
    """Through a follower first (its proxy carries the client to the leader), then on the
    leader: the leader must keep serving durable work after each."""
    c = cluster2
    try:
        leader, followers = start_cluster(c)
        _scenario(followers[0].url)
        _scenario(leader.url)
        _scenario(followers[0].url)
        assert "Traceback" not in leader.log_text(), leader.log_tail(60)
    except BaseException:
        print(c.diag())
        raise
