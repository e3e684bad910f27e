"""Exchange federation between three real Skred brokers: hops counted on the upstream side,
and a volume of messages across a kill -9 of the downstream.

A link declares on its upstream an internal ``x-federation-upstream`` exchange (RabbitMQ's
plugin's helper) with ``x-max-hops`` and its own cluster name; that exchange routes to the link's
queue only a message that has crossed fewer than max-hops links and never left the downstream.
So a message that would stop downstream never travels: the link's upstream queue never gets it
(its ``message_stats.publish`` stays 0). Three brokers (each its own cluster name), one module.

The volume trial (chaos) moves ``SKRED_FEDERATION_MESSAGES`` (default 2,000 in CI; the issue's
figure is 100,000) persistent messages through an on-confirm exchange link while the downstream,
which runs the link, is killed -9 and started again: every confirmed message arrives, duplicates
only for those in flight (at most a prefetch window per kill).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika
import pytest

from broker.federation.exchange_link import queue_name

from ._shovel import drain, ids, publish
from ._support import SkredProcess, is_external, unique, wait_until
from .test_mgmt_api import Api, start_mgmt_broker

pytestmark = pytest.mark.skipif(is_external(), reason="starts Skred brokers of its own")

DEADLINE = 30.0  # a link connects, declares and binds in well under a second on a quiet machine
N = 10
VOLUME = int(os.environ.get("SKRED_FEDERATION_MESSAGES", "2000"))
PREFETCH = 200  # the volume trial's prefetch-count: the most a kill may duplicate
CHUNK = 10_000  # messages per publishing connection (the helper gives each call 120 s)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SkredProcess]]:
    root: Path = tmp_path_factory.mktemp("fedhops")
    brokers: list[SkredProcess] = []
    try:
        for _ in range(3):
            brokers.append(start_mgmt_broker(root))
        yield brokers
    finally:
        for b in brokers:
            b.close()


def _upstream(down: SkredProcess, name: str, up: SkredProcess, max_hops: int, **extra: Any) -> None:
    value = {"uri": f"amqp://guest:guest@127.0.0.1:{up.port}/%2F", "reconnect-delay": 1, "max-hops": max_hops,
             **extra}
    status, body, _ = Api(down.mgmt_port).call("PUT", f"/api/parameters/federation-upstream/%2F/{name}",
                                               {"value": value})
    assert status in (201, 204), body


def _federate(down: SkredProcess, exchange: str, upstream: str) -> None:
    status, body, _ = Api(down.mgmt_port).call("PUT", f"/api/policies/%2F/{exchange}", {
        "pattern": f"^{exchange}$", "definition": {"federation-upstream": upstream}, "apply-to": "exchanges"})
    assert status in (201, 204), body


def _link_name(up: SkredProcess, exchange: str, down: SkredProcess) -> str:
    """The name of ``down``'s link queue on ``up`` (for this broker's cluster name)."""
    return queue_name(exchange, exchange, Api(down.mgmt_port).get("/api/cluster-name")["name"], "/")


def _link_queue(up: SkredProcess, exchange: str, down: SkredProcess) -> dict[str, Any] | None:
    """The upstream queue of ``down``'s link (on ``up``), as the management API shows it."""
    name = quote(_link_name(up, exchange, down), safe="")
    status, body, _ = Api(up.mgmt_port).call("GET", f"/api/queues/%2F/{name}")
    return dict(body) if status == 200 else None


def _sink(b: SkredProcess, exchange: str) -> tuple[pika.BlockingConnection, Any]:
    conn = pika.BlockingConnection(pika.URLParameters(b.url))
    ch = conn.channel()
    ch.exchange_declare(exchange, "fanout", durable=True)
    ch.queue_declare(f"{exchange}.sink", durable=True)
    ch.queue_bind(f"{exchange}.sink", exchange, "")
    return conn, ch


def _count(ch: Any, queue: str) -> int:
    return int(ch.queue_declare(queue, passive=True).method.message_count)


def _published(up: SkredProcess, exchange: str, down: SkredProcess) -> int:
    q = _link_queue(up, exchange, down)
    assert q is not None
    return int(q.get("message_stats", {}).get("publish", 0))


def _wait_linked(up: SkredProcess, exchange: str, down: SkredProcess) -> None:
    """``down``'s link runs: its queue on ``up`` and its exchange bound to ``exchange`` there."""
    def bound() -> bool:
        path = f"/api/exchanges/%2F/{quote(exchange, safe='')}/bindings/source"
        found = Api(up.mgmt_port).call("GET", path)[1]
        return _link_queue(up, exchange, down) is not None and any(
            bd["destination"].startswith(f"federation: {exchange} - ") for bd in found or [])
    wait_until(bound, DEADLINE, f"the link from {exchange} bound upstream")


def _publish(b: SkredProcess, exchange: str) -> None:
    with pika.BlockingConnection(pika.URLParameters(b.url)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(N):
            ch.basic_publish(exchange, "", f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))


@pytest.mark.parametrize("max_hops", [1, 2])
def test_a_chain_of_three_brokers_stops_at_max_hops_on_the_upstream(trio: list[SkredProcess],
                                                                     max_hops: int) -> None:
    """X -> Y -> Z (Y federates X's exchange, Z federates Y's): Z gets X's messages only with
    max-hops 2; with max-hops 1 they never even enter Z's link queue on Y."""
    x, y, z = trio
    ex = unique("fed.chain")
    conns = [_sink(b, ex) for b in trio]
    try:
        up_y, up_z = unique("x"), unique("y")
        _upstream(y, up_y, x, max_hops)
        _upstream(z, up_z, y, max_hops)
        _federate(y, ex, up_y)
        _federate(z, ex, up_z)
        _wait_linked(x, ex, y)
        _wait_linked(y, ex, z)
        _publish(x, ex)
        expect_z = N if max_hops >= 2 else 0
        wait_until(lambda: tuple(_count(ch, f"{ex}.sink") for _, ch in conns) == (N, N, expect_z), DEADLINE,
                   "each broker's copies")
        wait_until(lambda: _published(y, ex, z) == expect_z, DEADLINE, "Z's link queue on Y")
        assert _published(y, ex, z) == expect_z, "a message past max-hops travelled to the downstream"
        assert _count(conns[2][1], f"{ex}.sink") == expect_z
    finally:
        for c, _ in conns:
            c.close()


def test_a_loop_of_two_brokers_never_sends_a_message_back(trio: list[SkredProcess]) -> None:
    """X <-> Y (each federates the other's exchange), max-hops 5: a message published on X reaches
    Y once and never goes back: X's link queue on Y never gets it (stopped upstream, not dropped
    on arrival), and each broker has each message once."""
    x, y, _ = trio
    ex = unique("fed.loop")
    conns = [_sink(b, ex) for b in (x, y)]
    try:
        from_x, from_y = unique("x"), unique("y")
        _upstream(y, from_x, x, 5)
        _upstream(x, from_y, y, 5)
        _federate(y, ex, from_x)
        _federate(x, ex, from_y)
        _wait_linked(x, ex, y)
        _wait_linked(y, ex, x)
        _publish(x, ex)
        wait_until(lambda: tuple(_count(ch, f"{ex}.sink") for _, ch in conns) == (N, N), DEADLINE,
                   "each broker's copy")
        wait_until(lambda: _published(x, ex, y) == N, DEADLINE, "Y's link queue on X took them")
        assert _published(y, ex, x) == 0, "a message went back towards where it came from"
        assert tuple(_count(ch, f"{ex}.sink") for _, ch in conns) == (N, N)
    finally:
        for c, _ in conns:
            c.close()


@pytest.mark.chaos
@pytest.mark.timeout(240 + VOLUME // 50)
def test_a_volume_crosses_a_kill9_of_the_downstream_with_nothing_lost(trio: list[SkredProcess]) -> None:
    """X -> Y, on-confirm: ``VOLUME`` messages published on X while Y (which runs the link) is
    killed -9 once a fifth arrived and started again. Every message arrives in Y's queue;
    duplicates only for what was in flight."""
    x, y, _ = trio
    ex = unique("fed.volume")
    y_conn, _ = _sink(y, ex)
    y_conn.close()
    x_conn, _ = _sink(x, ex)  # (X's own queue: the exchange exists upstream before the link)
    x_conn.close()
    up = unique("x")
    _upstream(y, up, x, 1, **{"ack-mode": "on-confirm", "prefetch-count": PREFETCH})
    _federate(y, ex, up)
    _wait_linked(x, ex, y)
    chunks = [(f"v{c}", min(CHUNK, VOLUME - start)) for c, start in enumerate(range(0, VOLUME, CHUNK))]

    def publish_all() -> None:  # in chunks: each publish call has a deadline of its own
        for prefix, n in chunks:
            publish(x.url, "", prefix, n, size=256, exchange=ex)
    publisher = threading.Thread(target=publish_all)
    publisher.start()
    try:
        sink_api = Api(y.mgmt_port)
        wait_until(lambda: _api_count(sink_api, f"{ex}.sink") >= VOLUME // 5, 120 + VOLUME // 200,
                   "a fifth across before the kill")
        y.kill9()
        y.start()
    finally:
        publisher.join(120 * len(chunks))
    assert not publisher.is_alive()
    wait_until(lambda: _api_count(Api(y.mgmt_port), f"{ex}.sink") >= VOLUME, 120 + VOLUME // 100,
               "every message across")
    link_queue = _link_name(x, ex, y)
    wait_until(lambda: _api_count(Api(x.mgmt_port), link_queue) == 0, 60, "the link's upstream queue drained")
    got = drain(y.url, f"{ex}.sink")
    missing = set().union(*(ids(prefix, n) for prefix, n in chunks)) - set(got)
    assert not missing, f"{len(missing)} of {VOLUME} confirmed messages lost, e.g. {sorted(missing)[:5]}"
    assert len(got) - VOLUME <= PREFETCH, f"{len(got) - VOLUME} duplicates: more than one prefetch window"


def _api_count(api: Api, queue: str) -> int:
    """Ready + unacked messages of a queue, -1 while the API or the queue is not there."""
    try:
        status, body, _ = api.call("GET", f"/api/queues/%2F/{quote(queue, safe='')}")
    except OSError:
        return -1
    if status != 200:
        return -1
    return int(body.get("messages_ready", 0)) + int(body.get("messages_unacknowledged", 0))
