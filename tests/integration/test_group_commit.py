"""The group commit on a real broker: a deleted queue, a failing store, a refused commit (issue 26, item 1).

Theory of operation. Instance: declare a durable queue, publish a persistent message with a
confirm, ``basic.get`` it, ack it and delete the queue, all inside the ack-sync window (set to
60 s, so "inside" does not depend on the machine's load). The ack is buffered in the deleted
store; a clustered leader's replication hook used to flush every store the group commit
covered, that one included, and its ``FileNotFoundError`` escaped before the dirty set was
cleared: from then on every durable ``queue.declare``, ``tx.commit`` and confirmed persistent
publish on that leader got ``541 INTERNAL_ERROR`` while being applied anyway. After it, those
three operations must succeed and have happened exactly once.

Class: a store that cannot write what a commit covers fails only its own waiters. The fault is
real: with an ack of queue D buffered, the test makes a directory where D's ack file must go,
so writing it fails (``IsADirectoryError``) in every commit until the directory is removed.
Meanwhile confirms for D are nacked, a tx.commit on D is refused (541), and confirms and a
tx.commit on queue F, in the very same commits, succeed; after the fault the next confirm
for D succeeds. And a tx.commit refused (an exchange of its second publish deleted since)
applied nothing. Everything runs on a single node, through a follower (proxied to the
leader) and on the leader itself; the single node is then killed -9 and restarted: every
confirmed message is there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pytest

from broker.store.paths import queue_dir, vhost_dir
from broker.store.segment import ack_name

from ._support import Broker, unique
from .test_cluster import Cluster, ClusterNode, _loopback_ok, start_cluster

pytestmark = pytest.mark.timeout(180)

WINDOW = ["--ack-sync-interval", "60000"]
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _connect(url: str) -> pika.BlockingConnection:
    p = pika.URLParameters(url)
    p.socket_timeout = 5
    p.blocked_connection_timeout = 10
    p.connection_attempts = 1
    return pika.BlockingConnection(p)


def _drain(ch: pika.adapters.blocking_connection.BlockingChannel, q: str) -> list[bytes]:
    bodies = []
    while (got := ch.basic_get(q, auto_ack=True))[0] is not None:
        bodies.append(got[2])
    return bodies


def _ack_then_delete(conn: pika.BlockingConnection) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    q = unique("acked-then-deleted")
    ch.queue_declare(q, durable=True)
    ch.basic_publish("", q, b"m", PERSISTENT)
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
        tx.basic_publish("", q, b"tx", PERSISTENT)
        tx.tx_commit()
        ch.confirm_delivery()
        ch.basic_publish("", q, b"confirmed", PERSISTENT)
        assert sorted(_drain(ch, q)) == [b"confirmed", b"tx"]
        ch.queue_delete(q)
        ch.close()
        tx.close()


def _delete_scenario(url: str) -> None:
    conn = _connect(url)
    try:
        _ack_then_delete(conn)
        _durable_work_succeeds(conn)
    finally:
        if conn.is_open:
            conn.close()


def _fault_scenario(url: str, data_dir: Path) -> tuple[str, str]:
    """Queue D fails to write its acks for a while; returns (D, F) for the caller's checks."""
    doomed, fine = unique("doomed"), unique("fine")
    conn, other = _connect(url), _connect(url)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(doomed, durable=True)
        ch.queue_declare(fine, durable=True)
        ch.basic_publish("", doomed, b"first", PERSISTENT)
        method, _, _ = ch.basic_get(doomed)
        assert method is not None
        ch.basic_ack(method.delivery_tag)  # buffered until the next commit writes it
        blocked = queue_dir(vhost_dir(data_dir, "/"), doomed) / ack_name(1)  # its first segment's
        blocked.mkdir()
        try:
            fch = other.channel()
            fch.confirm_delivery()
            for i in range(3):
                with pytest.raises(pika.exceptions.NackError):
                    ch.basic_publish("", doomed, b"nacked-%d" % i, PERSISTENT)
                # D is retried in every commit while it fails: F's confirm shares it
                fch.basic_publish("", fine, b"fine-%d" % i, PERSISTENT)
            tx = other.channel()
            tx.tx_select()
            tx.basic_publish("", fine, b"fine-tx", PERSISTENT)
            tx.tx_commit()
            dtx = conn.channel()
            dtx.tx_select()
            dtx.basic_publish("", doomed, b"doomed-tx", PERSISTENT)
            with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as ei:
                dtx.tx_commit()
            assert ei.value.reply_code == 541, ei.value
        finally:
            blocked.rmdir()
        again = _connect(url)
        try:
            ch = again.channel()
            ch.confirm_delivery()
            ch.basic_publish("", doomed, b"after", PERSISTENT)  # the next commit succeeds
        finally:
            again.close()
        assert sorted(_drain(fch, fine)) == [b"fine-0", b"fine-1", b"fine-2", b"fine-tx"]
    finally:
        for c in (conn, other):
            if c.is_open:
                c.close()
    return doomed, fine


def _refused_commit_leaves_nothing(url: str) -> None:
    """A commit whose second publish names an exchange deleted since is refused (404) before
    its first publish is applied: an error answered means the commit did not happen."""
    conn = _connect(url)
    try:
        q, gone = unique("tx-target"), unique("tx-gone")
        admin = conn.channel()
        admin.queue_declare(q, durable=True)
        admin.exchange_declare(gone, "fanout")
        tx = conn.channel()
        tx.tx_select()
        tx.basic_publish("", q, b"first", PERSISTENT)
        tx.basic_publish(gone, "", b"second", PERSISTENT)
        admin.exchange_delete(gone)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
            tx.tx_commit()
        assert ei.value.reply_code == 404, ei.value
        assert _drain(admin, q) == [], "the refused commit's first publish was applied"
    finally:
        if conn.is_open:
            conn.close()


def test_single_node(broker_factory: Callable[..., Broker]) -> None:
    b = broker_factory(WINDOW)
    if b.data_dir is None:
        pytest.skip("needs the broker's data directory")
    _delete_scenario(b.url)
    _refused_commit_leaves_nothing(b.url)
    doomed, _ = _fault_scenario(b.url, b.data_dir)
    b.kill9()
    b.start()
    conn = _connect(b.url)
    try:
        got = _drain(conn.channel(), doomed)
        assert b"after" in got, got  # confirmed: it survived kill -9
        assert b"first" not in got, "the acked message came back"
    finally:
        conn.close()


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("gc")
    c = Cluster(tmp, ips=["127.0.0.1", "127.0.0.2" if _loopback_ok("127.0.0.2") else "127.0.0.1"])
    for n in c.nodes:
        n.argv += WINDOW
    try:
        start_cluster(c)
        yield c
    except BaseException:
        print(c.diag())
        raise
    finally:
        c.close()


def _roles(c: Cluster) -> tuple[ClusterNode, ClusterNode]:
    leader = c.leader()
    assert leader is not None
    return leader, next(n for n in c.nodes if n is not leader)


def test_cluster_durable_work_after_ack_then_delete(cluster2: Cluster) -> None:
    """Through a follower first (its proxy carries the client to the leader), then on the
    leader: the leader must keep serving durable work after each."""
    leader, follower = _roles(cluster2)
    try:
        _delete_scenario(follower.url)
        _delete_scenario(leader.url)
        _delete_scenario(follower.url)
        _refused_commit_leaves_nothing(follower.url)
        assert "FileNotFoundError" not in leader.log_text(), leader.log_tail(60)
    except BaseException:
        print(cluster2.diag())
        raise


def test_cluster_failing_store_fails_only_its_own(cluster2: Cluster) -> None:
    leader, follower = _roles(cluster2)
    try:
        _fault_scenario(follower.url, leader.data_dir)
        _fault_scenario(leader.url, leader.data_dir)
    except BaseException:
        print(cluster2.diag())
        raise

