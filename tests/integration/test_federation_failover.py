"""Federation across failures: nothing confirmed upstream is lost when the downstream or the
upstream is killed with SIGKILL mid-move, or when a cluster's leader (which runs the links) is,
and the links come back by themselves (on the restarted node; on the new leader).

Chaos trials (``@pytest.mark.chaos``): each boots brokers of its own. ``SKRED_FEDERATION_CHAOS_N``
scales the message count (default 300).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import SkredProcess, free_port, is_external, wait_until
from .cluster_faults import api_leader
from .test_cluster import TTL, Cluster, start_cluster, wait_for
from .test_mgmt_api import Api, http_ready

pytestmark = [pytest.mark.chaos, pytest.mark.skipif(is_external(), reason="starts its own brokers")]

N = int(os.environ.get("SKRED_FEDERATION_CHAOS_N", "300"))
DEADLINE = 60.0


def _api(host: str, port: int) -> Api:
    api = Api(port)
    api.base = f"http://{host}:{port}"
    return api


def _fill_upstream(up: SkredProcess, queue: str, n: int) -> None:
    c = pika.BlockingConnection(pika.URLParameters(up.url))
    ch = c.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()
    for i in range(n):
        ch.basic_publish("", queue, str(i).encode(), pika.BasicProperties(delivery_mode=2))
    c.close()


def _federate(api: Api, up: SkredProcess, queue: str) -> None:
    value = {"uri": f"amqp://guest:guest@{up.host}:{up.port}/%2F", "reconnect-delay": 0.5,
             "prefetch-count": 20}
    assert api.call("PUT", "/api/parameters/federation-upstream/%2F/up", {"value": value})[0] in (201, 204)
    body = {"pattern": f"^{queue}$", "apply-to": "queues", "definition": {"federation-upstream": "up"}}
    assert api.call("PUT", "/api/policies/%2F/federate", body)[0] in (201, 204)


def _consume(url: str, queue: str, got: list[int], until: int, stop_at: int | None = None) -> None:
    """Consume with manual acks (prefetch 10) until ``until`` distinct messages arrived, or stop
    once ``stop_at`` were taken (a consumer whose broker is about to die)."""
    c = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = c.channel()
        ch.queue_declare(queue, durable=True)
        ch.basic_qos(prefetch_count=10)

        def on(chan: Any, method: Any, _props: Any, body: bytes) -> None:
            got.append(int(body))
            chan.basic_ack(method.delivery_tag)

        ch.basic_consume(queue, on)
        deadline = time.monotonic() + DEADLINE
        while len(set(got)) < until and time.monotonic() < deadline:
            if stop_at is not None and len(got) >= stop_at:
                return
            c.process_data_events(0.05)
    finally:
        if c.is_open:
            c.close()


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[SkredProcess]:
    up = SkredProcess(tmp_path / "upstream", ["--mgmt-metrics-port", str(free_port())])
    up.start()
    yield up
    up.close()


def _upstream_count(up: SkredProcess, queue: str) -> int:
    c = pika.BlockingConnection(pika.URLParameters(up.url))
    try:
        return int(c.channel().queue_declare(queue, durable=True).method.message_count)
    finally:
        c.close()


def test_downstream_kill9_mid_move_loses_nothing(tmp_path: Path, upstream: SkredProcess) -> None:
    down = SkredProcess(tmp_path / "downstream", ["--mgmt-metrics-port", str(free_port())])
    down.start()
    try:
        wait_until(lambda: http_ready(down.mgmt_port), 30, "downstream API")
        _fill_upstream(upstream, "fed.q", N)
        _federate(_api(down.host, down.mgmt_port), upstream, "fed.q")
        got: list[int] = []
        _consume(down.url, "fed.q", got, N, stop_at=N // 3)
        down.kill9()  # mid-move: the link had messages in flight, unacked upstream
        down.start()
        wait_until(lambda: http_ready(down.mgmt_port), 30, "downstream API after restart")
        _consume(down.url, "fed.q", got, N)
        assert set(got) == set(range(N)), f"lost: {sorted(set(range(N)) - set(got))[:10]}"
        wait_until(lambda: _upstream_count(upstream, "fed.q") == 0, DEADLINE, "upstream drained")
    finally:
        down.close()


def test_upstream_kill9_mid_move_links_reconnect_and_lose_nothing(tmp_path: Path,
                                                                    upstream: SkredProcess) -> None:
    """The upstream broker dies with SIGKILL while the link has messages unacked there and comes
    back on the same port: the link reconnects by itself and every message arrives (what the
    upstream had delivered but not yet acked, or acked within its ack-sync window, may come twice)."""
    down = SkredProcess(tmp_path / "downstream", ["--mgmt-metrics-port", str(free_port())])
    down.start()
    try:
        wait_until(lambda: http_ready(down.mgmt_port), 30, "downstream API")
        _fill_upstream(upstream, "fed.q", N)
        api = _api(down.host, down.mgmt_port)
        _federate(api, upstream, "fed.q")
        got: list[int] = []
        _consume(down.url, "fed.q", got, N, stop_at=N // 3)
        upstream.kill9()  # mid-move: the link's window is unacked upstream
        upstream.start()
        _consume(down.url, "fed.q", got, N)
        assert set(got) == set(range(N)), f"lost: {sorted(set(range(N)) - set(got))[:10]}"
        wait_until(lambda: _upstream_count(upstream, "fed.q") == 0, DEADLINE, "upstream drained")
        wait_until(lambda: any(lk["status"] == "running" for lk in api.get("/api/federation-links")),
                   DEADLINE, "the link running again")
    finally:
        down.close()


def test_links_move_to_the_new_leader_and_lose_nothing(tmp_path: Path, upstream: SkredProcess) -> None:
    (tmp_path / "cluster").mkdir()
    c = Cluster(tmp_path / "cluster")
    try:
        leader, _followers = start_cluster(c)
        _fill_upstream(upstream, "fed.q", N)
        _federate(_api(leader.ip, leader.mgmt_port), upstream, "fed.q")
        got: list[int] = []
        _consume(leader.url, "fed.q", got, N, stop_at=N // 3)
        leader.kill9()
        successor = wait_for(lambda: api_leader(c, exclude=leader), TTL + 40, "a new leader serving its API")
        api = _api(successor.ip, successor.mgmt_port)
        wait_until(lambda: any(lk["status"] == "running"
                               for lk in api.call("GET", "/api/federation-links")[1]),
                   DEADLINE, "the link running on the new leader")
        _consume(successor.url, "fed.q", got, N)
        assert set(got) == set(range(N)), f"lost: {sorted(set(range(N)) - set(got))[:10]}"
        wait_until(lambda: _upstream_count(upstream, "fed.q") == 0, DEADLINE, "upstream drained")
    finally:
        c.close()
