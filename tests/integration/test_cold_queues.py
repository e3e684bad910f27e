"""Cold queues (issue 31): a new queue's first segment is made off the event loop when the queue
is declared (``segment_log``: ``_prepare_first``), and the first message only maps it. The
behaviour a client sees must not change: the first confirmed message into each of many new
durable queues is delivered on a single node, the cluster's leader and through a follower
(``cluster_modes``), and survives kill -9 together with queues whose first segment was made but
never used. A queue deleted and declared again at once (the old directory renamed to a tombstone
on the loop and removed on the segment worker) keeps only its new messages, and a follower's
copy of it equals the leader's, with no tombstone replicated or left; the same for a delayed
exchange's held messages (``delayed/``), whose copy a promoted follower's boot replays, and a
vhost deleted and made again at once (its directory renamed to a tombstone too)."""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pika
import pytest

from broker.store.paths import TOMBSTONE_SUFFIX, find_vhost_dir, queue_dir

from ._support import Broker, connect, is_external, queue_count, unique, wait_until

QUEUES = 40
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _declare_and_publish(b: Any, names: list[str], publish_to: list[str]) -> None:
    conn = connect(b)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for q in names:
            ch.queue_declare(q, durable=True)
        for q in publish_to:  # each confirm: the message is on disk (pika raises otherwise)
            ch.basic_publish("", q, f"first {q}".encode(), PERSISTENT, mandatory=True)
    finally:
        conn.close()


def _take_all(b: Any, names: list[str], expect: set[str], delete: bool = False) -> None:
    conn = connect(b)
    try:
        ch = conn.channel()
        for q in names:
            m, _, body = ch.basic_get(q, auto_ack=True)
            if q in expect:
                assert body == f"first {q}".encode(), (q, m, body)
            else:
                assert m is None, (q, body)
            if delete:
                ch.queue_delete(q)
    finally:
        conn.close()


@pytest.mark.cluster_modes
def test_the_first_message_into_each_new_queue_is_delivered(shared_broker: Any) -> None:
    names = [unique("cold") for _ in range(QUEUES)]
    _declare_and_publish(shared_broker, names, names)
    _take_all(shared_broker, names, set(names), delete=True)


@pytest.mark.skipif(is_external(), reason="kills the Skred process")
def test_first_segments_made_and_used_survive_kill_9(broker: Broker) -> None:
    names = [unique("cold") for _ in range(QUEUES)]
    used = names[1::2]  # the others keep a first segment made ahead and never used
    _declare_and_publish(broker, names, used)
    again = used[0]  # deleted and declared again at once, its new message confirmed
    conn = connect(broker)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_delete(again)
        ch.queue_declare(again, durable=True)
        ch.basic_publish("", again, f"first {again}".encode(), PERSISTENT, mandatory=True)
    finally:
        conn.close()
    broker.kill9()
    assert broker.data_dir is not None
    vdir = find_vhost_dir(broker.data_dir, "/")
    stale = vdir / f"{queue_dir(vdir, again).name}.0-0{TOMBSTONE_SUFFIX}"  # as a crash leaves one
    stale.mkdir()
    (stale / "msgs.0000000001").write_bytes(b"stale")
    broker.start()
    conn = connect(broker)
    try:
        for q in names:
            assert queue_count(conn, q) == (1 if q in used else 0), q
    finally:
        conn.close()
    deadline = time.monotonic() + 20
    while _tombstones(broker.data_dir, [again]):  # the boot's sweep, on the segment worker
        assert time.monotonic() < deadline, f"tombstones left: {_tombstones(broker.data_dir, [again])}"
        time.sleep(0.05)
    _take_all(broker, names, set(used))
    _declare_and_publish(broker, names, names)  # every queue takes appends again
    _take_all(broker, names, set(names), delete=True)


def _tombstones(data_dir: Path, names: list[str], sub: str = "") -> list[str]:
    vdir = find_vhost_dir(data_dir, "/") / sub
    prefixes = tuple(queue_dir(vdir, q).name + "." for q in names)
    return [p.name for p in vdir.iterdir()
            if p.name.startswith(prefixes) and p.name.endswith(TOMBSTONE_SUFFIX)]


@pytest.mark.cluster_modes
def test_a_queue_deleted_and_declared_again_keeps_only_its_new_messages(shared_broker: Any) -> None:
    names = [unique("again") for _ in range(QUEUES // 4)]
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for q in names:
            ch.queue_declare(q, durable=True)
            for i in range(20):
                ch.basic_publish("", q, f"old {i}".encode(), PERSISTENT, mandatory=True)
        for q in names:  # delete, declare again, a confirmed message: before the old files are gone
            ch.queue_delete(q)
            ch.queue_declare(q, durable=True)
            ch.basic_publish("", q, f"new {q}".encode(), PERSISTENT, mandatory=True)
        for q in names:
            assert ch.queue_declare(q, durable=True, passive=True).method.message_count == 1, q
        _check_copies(shared_broker, names)
        for q in names:
            m, _, body = ch.basic_get(q, auto_ack=True)
            assert body == f"new {q}".encode(), (q, m, body)
            ch.queue_delete(q)
    finally:
        conn.close()


@pytest.mark.cluster_modes
def test_a_delayed_exchange_deleted_and_declared_again_holds_only_its_new_messages(
        shared_broker: Any) -> None:
    ex, q = unique("dx-again"), unique("dq-again")
    args = {"x-delayed-type": "direct"}
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(q, durable=True)
        ch.exchange_declare(ex, "x-delayed-message", durable=True, arguments=args)
        ch.queue_bind(q, ex, "k")
        ch.basic_publish(ex, "k", b"old", pika.BasicProperties(headers={"x-delay": 600}, delivery_mode=2))
        ch.exchange_delete(ex)  # drops "old"; its files go while the name is declared again
        ch.exchange_declare(ex, "x-delayed-message", durable=True, arguments=args)
        ch.queue_bind(q, ex, "k")
        ch.basic_publish(ex, "k", b"new", pika.BasicProperties(headers={"x-delay": 1500}, delivery_mode=2))
        _check_copies(shared_broker, [ex], "delayed")  # what a promoted follower's boot replays
        wait_until(lambda: queue_count(conn, q) >= 1, 10, "the held message of the exchange declared again")
        assert ch.basic_get(q, auto_ack=True)[2] == b"new"  # "old", due first, never came
        ch.exchange_delete(ex)
        ch.queue_delete(q)
    finally:
        conn.close()


def _http(b: Any, method: str, path: str, body: Any = None) -> None:
    auth = "Basic " + base64.b64encode(b"guest:guest").decode()
    req = urllib.request.Request(f"http://{b.host}:{b.mgmt_port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": auth})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status in (200, 201, 204), (method, path, resp.status)


def _made_vhost(b: Any, vhost: str) -> pika.BlockingConnection:
    _http(b, "PUT", f"/api/vhosts/{vhost}")
    _http(b, "PUT", f"/api/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    return connect(b, virtual_host=vhost)


@pytest.mark.cluster_modes
def test_a_vhost_deleted_and_made_again_keeps_only_its_new_messages(shared_broker: Any) -> None:
    vhost, q = unique("vh-again"), unique("q")
    for body in (b"old", b"new"):  # the vhost made again at once, before its old files are gone
        if body == b"new":
            _http(shared_broker, "DELETE", f"/api/vhosts/{vhost}")
        conn = _made_vhost(shared_broker, vhost)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(q, durable=True)
            ch.basic_publish("", q, body, PERSISTENT, mandatory=True)
        finally:
            conn.close()
    cluster = getattr(shared_broker, "cluster", None)
    leader_dir = shared_broker.data_dir if cluster is None else cluster.leader.data_dir
    if leader_dir is not None:
        vdir = find_vhost_dir(leader_dir, vhost)
        wait_until(lambda: not [p for p in vdir.parent.iterdir()
                                if p.name.startswith(vdir.name + ".") and p.name.endswith(TOMBSTONE_SUFFIX)],
                   20, "the deleted vhost's tombstone removed")
    if cluster is not None:
        from .test_cluster import logical_equal, wait_for

        for f in cluster.followers:
            fdir = find_vhost_dir(f.data_dir, vhost)
            wait_for(lambda fdir=fdir: logical_equal(vdir, fdir) is None, 20,
                     f"{f.name}'s copy of the vhost equals the leader's: {logical_equal(vdir, fdir)}")
    conn = connect(shared_broker, virtual_host=vhost)
    try:
        ch = conn.channel()
        assert ch.queue_declare(q, durable=True, passive=True).method.message_count == 1
        assert ch.basic_get(q, auto_ack=True)[2] == b"new"
    finally:
        conn.close()
    _http(shared_broker, "DELETE", f"/api/vhosts/{vhost}")


def _check_copies(target: Any, names: list[str], sub: str = "") -> None:
    """The leader removes the tombstones (off its loop); a follower's copy of each queue's
    directory (``sub``: "delayed" for delayed exchanges' held messages) equals the leader's and
    it holds no tombstone."""
    cluster = getattr(target, "cluster", None)
    leader_dir = target.data_dir if cluster is None else cluster.leader.data_dir
    if leader_dir is None:
        return  # an external broker: its files are not ours to read
    deadline = time.monotonic() + 20
    while _tombstones(leader_dir, names, sub):
        assert time.monotonic() < deadline, f"tombstones left: {_tombstones(leader_dir, names, sub)}"
        time.sleep(0.05)
    if cluster is None:
        return
    from .test_cluster import logical_equal, wait_for

    for f in cluster.followers:
        assert not _tombstones(f.data_dir, names, sub)
        for q in names:
            lq, fq = (queue_dir(find_vhost_dir(d, "/") / sub, q) for d in (leader_dir, f.data_dir))
            wait_for(lambda lq=lq, fq=fq: logical_equal(lq, fq) is None, 20,
                     f"{f.name}'s copy of {q} equals the leader's: {logical_equal(lq, fq)}")
