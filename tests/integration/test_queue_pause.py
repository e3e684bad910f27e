"""Pause, resume and restart of a queue (LavinMQ's ``PUT /api/queues/{vhost}/{name}/pause``,
``/resume`` and ``/restart``) against real brokers over pika and the management API.

A paused queue takes publishes and delivers nothing (to consumers or basic.get) until resumed;
its state survives a kill -9 and a cluster leader's failover (the follower that takes over has it
from the replicated definitions log). Absence of deliveries is checked over a short window of
processed I/O after confirmed publishes, then the resume must deliver every one of them.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import aio_pika
import pika
import pytest

from ._support import SkredProcess, connect, unique, wait_until
from .test_cluster import TTL, Cluster, cluster, start_cluster, wait_for  # noqa: F401 (fixture)
from .test_ctl import ctl
from .test_metrics_rabbitmq import _scrape
from .test_mgmt_api import Api, http_ready, start_mgmt_broker

pytestmark = pytest.mark.timeout(120)

QUIET = 0.5  # seconds of processed I/O in which a paused queue must deliver nothing


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("pause"))
    yield b
    b.close()


def _path(queue: str, action: str = "") -> str:
    return f"/api/queues/%2F/{urllib.parse.quote(queue, safe='')}" + (f"/{action}" if action else "")


def _publish(conn: pika.BlockingConnection, queue: str, n: int) -> None:
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(n):
        ch.basic_publish("", queue, b"%d" % i, pika.BasicProperties(delivery_mode=2))
    ch.close()


def _consume_for(conn: pika.BlockingConnection, queue: str, seconds: float, want: int) -> list[bytes]:
    """Consume (auto-ack) until ``want`` arrived or ``seconds`` of I/O passed."""
    ch = conn.channel()
    got: list[bytes] = []
    ch.basic_consume(queue, lambda c, m, p, b: got.append(b), auto_ack=True)
    deadline = time.monotonic() + seconds
    while len(got) < want and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    ch.close()
    return got


def test_paused_queue_takes_publishes_and_delivers_nothing_until_resumed(mb: SkredProcess) -> None:
    api = Api(mb.mgmt_port)
    q = unique("paused")
    conn = connect(mb)
    try:
        conn.channel().queue_declare(q, durable=True)
        assert api.get(_path(q))["state"] == "running"
        api.ok("PUT", _path(q, "pause"))
        assert api.get(_path(q))["state"] == "paused"
        api.ok("PUT", _path(q, "pause"))  # idempotent
        # in the metrics: the node's count and the queue's own gauge (issue 32: API, UI, ctl, metrics)
        assert re.search(r"^skred_queues_paused [1-9]", _scrape(mb, "/metrics"), re.M)
        per_object = _scrape(mb, "/metrics/per-object")
        gauge = r'queue_paused\{[^}]*queue="' + re.escape(q) + r'"[^}]*\} 1'
        assert re.search(gauge, per_object), per_object[-2000:]

        # a consumer attached before the publishes: no direct hand-over either
        ch = conn.channel()
        early: list[bytes] = []
        ch.basic_consume(q, lambda c, m, p, b: early.append(b), auto_ack=True)
        _publish(conn, q, 5)
        deadline = time.monotonic() + QUIET
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        assert early == []
        assert conn.channel().basic_get(q)[0] is None  # nothing leaves by basic.get either
        wait_until(lambda: api.get(_path(q))["messages"] == 5, 10, "5 messages in the paused queue")

        api.ok("PUT", _path(q, "resume"))
        assert api.get(_path(q))["state"] == "running"
        deadline = time.monotonic() + 10
        while len(early) < 5 and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        assert early == [b"%d" % i for i in range(5)]
        ch.close()
    finally:
        conn.close()


def test_pause_needs_configure_permission_and_an_existing_queue(mb: SkredProcess) -> None:
    api = Api(mb.mgmt_port)
    assert api.call("PUT", _path(unique("missing"), "pause"))[0] == 404
    user = unique("u")
    api.ok("PUT", f"/api/users/{user}", {"password": "pw", "tags": "management"})
    api.ok("PUT", f"/api/permissions/%2F/{user}", {"configure": "^$", "write": ".*", "read": ".*"})
    q = unique("perm")
    conn = connect(mb)
    try:
        conn.channel().queue_declare(q, durable=True)
        got = api.as_user(user, "pw").call("PUT", _path(q, "pause"))
        assert got[0] == 401 and "refused" in got[1]["reason"], got  # RabbitMQ's status for it
        assert api.get(_path(q))["state"] == "running"
    finally:
        conn.close()


def test_restart_reopens_the_store_keeping_messages_bindings_and_pause(mb: SkredProcess) -> None:
    api = Api(mb.mgmt_port)
    q = unique("restart")
    conn = connect(mb)
    try:
        ch = conn.channel()
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, "amq.direct", routing_key=q)
        _publish(conn, q, 3)
        api.ok("PUT", _path(q, "pause"))
        api.ok("PUT", _path(q, "restart"))
        info = api.get(_path(q))
        assert (info["messages"], info["state"]) == (3, "paused")
        api.ok("PUT", _path(q, "resume"))
        pub = conn.channel()
        pub.confirm_delivery()
        pub.basic_publish("amq.direct", q, b"bound", pika.BasicProperties(delivery_mode=2))
        got = _consume_for(conn, q, 10, 4)
        assert got == [b"0", b"1", b"2", b"bound"]
        # refused while consumed (its unacked deliveries belong to the open store)
        ch2 = conn.channel()
        ch2.basic_consume(q, lambda c, m, p, b: None)
        assert api.call("PUT", _path(q, "restart"))[0] == 400
        ch2.close()
    finally:
        conn.close()


def test_skredctl_pause_resume_restart_queue(mb: SkredProcess) -> None:
    api = Api(mb.mgmt_port)
    q = unique("ctl")
    api.ok("PUT", _path(q), {"durable": True})
    for cmd, state in (("pause_queue", "paused"), ("restart_queue", "paused"), ("resume_queue", "running")):
        r = ctl(mb, cmd, q, "--vhost", "/")
        assert r.returncode == 0 and q in r.stdout, (cmd, r.stdout, r.stderr)
        assert api.get(_path(q))["state"] == state, cmd
    r = ctl(mb, "pause_queue", unique("missing"))
    assert r.returncode != 0 and r.stderr, (r.returncode, r.stderr)


def test_pause_survives_kill9(mb: SkredProcess) -> None:
    """Last in the module: it kills the module's broker and starts it again."""
    api = Api(mb.mgmt_port)
    q, other = unique("kill"), unique("kill-running")
    conn = connect(mb)
    conn.channel().queue_declare(q, durable=True)
    conn.channel().queue_declare(other, durable=True)
    _publish(conn, q, 4)
    api.ok("PUT", _path(q, "pause"))
    api.ok("PUT", _path(other, "pause"))
    api.ok("PUT", _path(other, "resume"))
    conn.close()
    mb.kill9()
    mb.restart()
    wait_until(lambda: http_ready(mb.mgmt_port), 20, "management HTTP after the restart")
    assert api.get(_path(q))["state"] == "paused"
    assert api.get(_path(other))["state"] == "running"
    conn = connect(mb)
    try:
        assert _consume_for(conn, q, QUIET, 1) == []
        api.ok("PUT", _path(q, "resume"))
        assert _consume_for(conn, q, 10, 4) == [b"0", b"1", b"2", b"3"]
    finally:
        conn.close()


# ------------------------------------------------------------------ cluster failover

async def _aio_count(url: str, queue: str, seconds: float, want: int) -> int:
    conn = await aio_pika.connect(url, timeout=5)
    got = 0
    try:
        ch = await conn.channel()
        qq = await ch.declare_queue(queue, durable=True, passive=True)

        async def on_message(msg: Any) -> None:
            nonlocal got
            got += 1
            await msg.ack()

        await qq.consume(on_message)
        deadline = time.monotonic() + seconds
        while got < want and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # progress poll, bounded by the deadline
    finally:
        await conn.close()
    return got


def test_pause_survives_leader_failover(cluster: Cluster) -> None:  # noqa: F811 (the fixture imported above)
    c = cluster
    leader, followers = start_cluster(c)
    q = unique("failover")
    conn = pika.BlockingConnection(pika.URLParameters(followers[0].url))
    try:
        conn.channel().queue_declare(q, durable=True)
        _publish(conn, q, 3)
    finally:
        conn.close()
    via_follower = Api(followers[0].mgmt_port)
    via_follower.base = f"http://{followers[0].ip}:{followers[0].mgmt_port}"
    via_follower.ok("PUT", _path(q, "pause"))  # proxied to the leader, answered once replicated
    via_follower.ok("PUT", "/api/vhosts/%2F", {"tracing": True})  # the firehose switch: the same
    leader.kill9()

    def successor() -> Any:
        n = c.leader()
        return n if n is not None and n is not leader and n.answers() else None

    new = wait_for(successor, TTL + 20, "a new leader serving clients")
    api = Api(new.mgmt_port)
    api.base = f"http://{new.ip}:{new.mgmt_port}"
    wait_for(lambda: http_ready_at(api), 20, "the new leader's management API")
    info = api.get(_path(q))
    assert (info["state"], info["messages"]) == ("paused", 3)
    assert api.get("/api/vhosts/%2F")["tracing"] is True
    assert asyncio.run(_aio_count(new.url, q, QUIET, 1)) == 0
    api.ok("PUT", _path(q, "resume"))
    assert asyncio.run(_aio_count(new.url, q, 10, 3)) == 3


def http_ready_at(api: Api) -> bool:
    try:
        return api.call("GET", "/api/overview")[0] == 200
    except OSError:
        return False
