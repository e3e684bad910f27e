"""A three-node cluster with TLS: the replication link is encrypted (captured by a relay in the
test and checked for the protocol magic, the cluster secret and message bodies), and a TLS client
reaches the leader through a follower's proxy with TLS end to end.

Each node advertises a relay's address as its replication URI, so every byte between followers
and the leader crosses the relay, which records it. The relay connects from the follower's own
address, so the leader still knows its members by address. With ``--no-clustering-tls`` the same
capture shows the magic and the bodies: the capture works, and the check can fail.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pika
import pytest

from ._relay import Relay
from ._support import free_port
from ._tls import make_pki, tls_args
from .test_cluster import Cluster, start_cluster, wait_for

pytestmark = pytest.mark.timeout(240)
MARKER = b"PLAINTEXT-MARKER-"


@pytest.fixture
def tls_cluster(tmp_path: Path,
                request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, list[Relay], int]]:
    pki = make_pki(tmp_path / "pki")
    c = Cluster(tmp_path)
    amqps = free_port()  # the same TLS port on every node (each binds its own loopback address)
    relays = []
    for n in c.nodes:
        relay = Relay((n.ip, n.repl_port), source=None, record=True, listen=n.ip)
        relays.append(relay)
        n.uri = f"tcp://{n.ip}:{relay.port}"
        n.argv[n.argv.index("--clustering-advertised-uri") + 1] = n.uri
        n.argv += tls_args(pki, "--amqp-tls-port", str(amqps), "--mgmt-tls-port", "-1", *request.param)
    try:
        yield c, relays, amqps
    finally:
        c.close()
        for r in relays:
            r.close()


async def _publish(url: str, queue: str, n: int) -> None:
    conn = await aio_pika.connect(url, timeout=10)
    async with conn:
        ch = await conn.channel(publisher_confirms=True)
        await ch.declare_queue(queue, durable=True)
        for i in range(n):  # each confirm waits for the followers in the ISR
            await ch.default_exchange.publish(
                aio_pika.Message(MARKER + str(i).encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=queue)


@pytest.mark.parametrize("tls_cluster", [(), ("--no-clustering-tls",)], ids=["tls", "clear"], indirect=True)
def test_replication_link_is_encrypted(tls_cluster: tuple[Cluster, list[Relay], int]) -> None:
    c, relays, amqps = tls_cluster
    clear = "--no-clustering-tls" in c.nodes[0].argv
    leader, followers = start_cluster(c)
    wait_for(lambda: all(n.node_id() in (c.etcd.get(f"{c.prefix}/isr") or b"").decode() for n in c.nodes),
             30, "every node in the ISR")
    asyncio.run(asyncio.wait_for(_publish(leader.url, "tls-repl", 50), 60))
    link = bytes(relays[c.nodes.index(leader)].captured)
    assert len(link) > 1000, "the relay saw no replication traffic"
    secret = c.etcd.get(f"{c.prefix}/clustering_secret")
    assert secret
    if clear:
        assert b"SKREPL" in link and secret[:16] in link  # the capture sees a clear link
        return
    assert b"SKREPL" not in link
    assert secret[:16] not in link
    assert MARKER not in link
    assert link[0] == 0x16  # a TLS record (handshake) opens the link

    # AMQPS through a follower's proxy: TLS end to end, the leader sees the client's address
    f = followers[0]
    argv = c.nodes[0].argv
    ctx = ssl.create_default_context(cafile=argv[argv.index("--tls-ca-cert") + 1])
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        f.ip, amqps, ssl_options=pika.SSLOptions(ctx, "localhost"), socket_timeout=5,
        connection_attempts=3, retry_delay=1))
    try:
        ch = conn.channel()
        got = ch.basic_get("tls-repl", auto_ack=True)[2]
        assert got is not None and got.startswith(MARKER)
    finally:
        conn.close()

