"""The stream protocol's TLS port (RabbitMQ's 5551) through a cluster follower, and across a
leader's kill -9.

A follower proxies its stream TLS port to the leader's through the replication tunnel, TLS end to
end (the leader's port number, which differs from the follower's, comes in the Welcome). An
rstream client in load-balancer mode publishes with confirms through a follower over TLS and
reads back; then the leader is killed with SIGKILL, a follower takes the lead, and the client
reconnects over TLS through the node that is still a follower (or the new leader when none
is) and finds every confirmed message, then publishes again. The messages were published by a
named publisher with publishing ids: the new leader answers QueryPublisherSequence with the last
id, and the whole batch resent under the same ids adds nothing (stream-level deduplication, what
the Spark sink's exactly-once mode relies on, survives the leader's loss).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rstream import AMQPMessage, Consumer, ConsumerOffsetSpecification, MessageContext, OffsetType, Producer

from ._support import free_port
from ._tls import make_pki, tls_args
from .test_cluster import Cluster, ClusterNode, start_cluster, wait_for

pytestmark = pytest.mark.timeout(240)
STREAM = "tls-through-follower"
PUBLISHER = "exactly-once-app"


TLS_PORTS: dict[str, int] = {}  # node name -> its stream TLS port (differs from node to node)


@pytest.fixture
def stream_tls_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, ssl.SSLContext]]:
    pki = make_pki(tmp_path / "pki")
    c = Cluster(tmp_path)
    for n in c.nodes:
        TLS_PORTS[n.name] = free_port()
        n.argv += tls_args(pki, "--amqp-tls-port", "-1", "--mgmt-tls-port", "-1",
                           "--stream-tls-port", str(TLS_PORTS[n.name]))
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert_path))
    try:
        yield c, ctx
    finally:
        c.close()


def _kw(n: ClusterNode, ctx: ssl.SSLContext) -> dict[str, Any]:
    return {"port": TLS_PORTS[n.name], "username": "guest", "password": "guest", "ssl_context": ctx,
            "load_balancer_mode": True}


async def _publish(n: ClusterNode, ctx: ssl.SSLContext, bodies: list[bytes], create: bool,
                   first_id: int = 0) -> int:
    """Publish ``bodies`` (with ``first_id``: as the named publisher, ids from it on); the
    publisher's sequence as the broker then answers it (0 without ``first_id``)."""
    async with Producer(n.ip, **_kw(n, ctx)) as p:
        if create:
            await p.create_stream(STREAM)
        if not first_id:
            await p.send_batch(STREAM, bodies)  # returns once every message is confirmed
            return 0
        batch = []
        for i, body in enumerate(bodies):
            m = AMQPMessage(body=body)
            m.publishing_id = first_id + i
            batch.append(m)
        await p.send_batch(STREAM, batch, publisher_name=PUBLISHER)
        c = await p.default_client
        return int(await c.query_publisher_sequence(STREAM, PUBLISHER))


async def _read_all(n: ClusterNode, ctx: ssl.SSLContext, want: int, timeout: float = 20.0) -> list[bytes]:
    got: list[bytes] = []

    def on_message(msg: Any, _ctx: MessageContext) -> None:
        raw = bytes(msg)
        got.append(raw[5:] if raw.startswith(b"\x00Su\xa0") else raw)  # a named publisher's AMQP 1.0

    c = Consumer(n.ip, **_kw(n, ctx))
    await c.start()
    try:
        await c.subscribe(STREAM, on_message,
                          offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST, None))
        deadline = time.monotonic() + timeout
        while len(got) < want:
            assert time.monotonic() < deadline, f"{len(got)} of {want} messages within {timeout}s"
            await asyncio.sleep(0.05)  # poll interval, bounded by the deadline
    finally:
        await c.close()
    return got


def _retry(n: ClusterNode, ctx: ssl.SSLContext, want: int) -> list[bytes]:
    """Read through ``n`` once its proxy reaches the new leader (refused or reset until then)."""
    deadline = time.monotonic() + 40
    while True:
        try:
            return asyncio.run(asyncio.wait_for(_read_all(n, ctx, want, 10.0), 15.0))
        except Exception:  # noqa: BLE001 - refused, reset or short until the new leader serves
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)  # the next attempt, bounded by the deadline


def test_stream_tls_through_a_follower_and_after_leader_kill9(
        stream_tls_cluster: tuple[Cluster, ssl.SSLContext]) -> None:
    c, ctx = stream_tls_cluster
    leader, followers = start_cluster(c)
    f = followers[0]
    assert TLS_PORTS[f.name] != TLS_PORTS[leader.name]
    first = [b"before-%d" % i for i in range(20)]
    named = [b"named-%d" % i for i in range(10)]
    asyncio.run(_publish(f, ctx, first, create=True))
    assert asyncio.run(_publish(f, ctx, named, create=False, first_id=1)) == 10
    assert asyncio.run(_read_all(f, ctx, 30)) == first + named

    leader.kill9()
    new = wait_for(lambda: (n := c.leader()) is not None and n is not leader and n, 30, "a new leader")
    through = next((n for n in c.nodes if n is not leader and n is not new), new)
    assert _retry(through, ctx, 30)[:30] == first + named  # every confirmed message survived
    # the same ids again: confirmed, not stored; the sequence is still the last id
    assert asyncio.run(_publish(through, ctx, named, create=False, first_id=1)) == 10
    asyncio.run(_publish(through, ctx, [b"after"], create=False))
    assert asyncio.run(_read_all(through, ctx, 31))[30] == b"after"
