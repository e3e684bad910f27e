"""A three-node cluster with TLS: the replication link is encrypted (captured by a relay in the
test and checked for the protocol magic, the cluster secret and message bodies), and a TLS client
reaches the leader through a follower's proxy with TLS end to end.

Each node advertises a relay's address as its replication URI, so every byte between followers
and the leader crosses the relay, which records it. The relay connects from the follower's own
address, so the leader still knows its members by address. With ``--no-clustering-tls`` the same
capture shows the magic and the bodies: the capture works, and the check can fail.

The follower proxy's plain client ports (AMQP, HTTP, LMQ) tunnel over the same replication
port, so the same capture shows whether client bytes cross between nodes in clear; the nodes
there use different port numbers each (the leader announces its own). And SIGHUP reloads the
replication listener's certificate without dropping the open links.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pika
import pytest

from ._relay import Relay
from ._support import free_port
from ._tls import SERVER_IPS, issue, make_pki, tls_args
from .test_cluster import Cluster, start_cluster, wait_for

pytestmark = pytest.mark.timeout(240)
MARKER = b"PLAINTEXT-MARKER-"


@pytest.fixture
def tls_cluster(tmp_path: Path,
                request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, list[Relay], int]]:
    pki = make_pki(tmp_path / "pki")
    c = Cluster(tmp_path)
    amqps = free_port()  # the same TLS port on every node (each binds its own loopback address)
    for n in c.nodes:
        n.argv += tls_args(pki, "--amqp-tls-port", str(amqps), "--mgmt-tls-port", "-1", *request.param)
    with _relayed(c) as relays:
        yield c, relays, amqps


@contextlib.contextmanager
def _relayed(c: Cluster) -> Iterator[list[Relay]]:
    """Each node advertises a recording relay in front of its replication port; the cluster and
    the relays are closed on exit."""
    relays = []
    for n in c.nodes:
        relay = Relay((n.ip, n.repl_port), source=None, record=True, listen=n.ip)
        relays.append(relay)
        n.uri = f"tcp://{n.ip}:{relay.port}"
        n.argv[n.argv.index("--clustering-advertised-uri") + 1] = n.uri
    try:
        yield relays
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



@pytest.fixture
def proxy_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, list[Relay]]]:
    """Three TLS nodes whose client ports all differ from node to node (AMQPS, HTTPS and LMQ
    included), each advertising a recording relay in front of its replication port."""
    pki = make_pki(tmp_path / "pki")
    c = Cluster(tmp_path)
    for n in c.nodes:
        n.tls_port, n.https_port, n.lmq_port = free_port(), free_port(), free_port()
        n.argv += tls_args(pki, "--amqp-tls-port", str(n.tls_port), "--mgmt-tls-port", str(n.https_port),
                           "--lmq-bind", n.ip, "--lmq-http-port", str(n.lmq_port),
                           "--lmq-rpc-port", str(free_port()), *request.param)
    with _relayed(c) as relays:
        yield c, relays


def _api(url: str, ctx: ssl.SSLContext | None = None) -> Any:
    req = urllib.request.Request(url)
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("proxy_cluster", [(), ("--no-clustering-tls",)], ids=["tls", "clear"], indirect=True)
def test_follower_proxies_every_client_port_to_the_leader_encrypted(
        proxy_cluster: tuple[Cluster, list[Relay]]) -> None:
    """Plain AMQP, HTTP and LMQ clients of a follower reach the leader through the follower's
    TLS tunnel (the capture of the follower -> leader hop holds none of their bytes), the leader
    sees the real client address, and AMQPS/HTTPS reach the leader's own TLS ports, whose numbers
    differ from the follower's (announced in the replication welcome)."""
    c, relays = proxy_cluster
    clear = "--no-clustering-tls" in c.nodes[0].argv
    leader, followers = start_cluster(c)
    f = followers[0]
    assert {n.tls_port for n in c.nodes} != {leader.tls_port}
    argv = c.nodes[0].argv
    ctx = ssl.create_default_context(cafile=argv[argv.index("--tls-ca-cert") + 1])
    link = relays[c.nodes.index(leader)]

    # plain AMQP through the follower: the body must not cross the follower -> leader hop in clear
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        f.ip, f.port, credentials=pika.PlainCredentials("guest", "guest"), connection_attempts=5,
        retry_delay=1, socket_timeout=10))
    try:
        client = conn._impl._transport._sock.getsockname()
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("tunnel-q", durable=True)
        ch.basic_publish("", "tunnel-q", MARKER + b"amqp", pika.BasicProperties(delivery_mode=2))
        # plain HTTP through the follower: the leader shows the AMQP client's own address
        rows = _api(f"http://{f.ip}:{f.mgmt_port}/api/connections")
        assert (client[0], client[1]) in {(r["peer_host"], r["peer_port"]) for r in rows}, rows
        assert not any(r["ssl"] for r in rows), "a plain client must not look like a TLS one"
    finally:
        conn.close()

    # HTTP/1.0 through the follower from a client that shuts down its sending side after the
    # request (nc -N, HTTP/1.0 scripts): the whole response still comes back, TLS tunnel or not
    assert _http10_half_closed(f.ip, f.mgmt_port, "/api/overview").startswith(b"HTTP/1.")
    assert _http10_half_closed(leader.ip, leader.mgmt_port, "/api/overview").startswith(b"HTTP/1.")

    # LMQ HTTP through the follower
    guest = {"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="}  # guest:guest: LMQ authenticates
    req = urllib.request.Request(f"http://{f.ip}:{f.lmq_port}/messages/lmq-q", data=MARKER + b"lmq",
                                 method="POST", headers=guest)
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status in (200, 201, 202, 204)
    req = urllib.request.Request(f"http://{f.ip}:{f.lmq_port}/messages/lmq-q?t=5", headers=guest)
    with urllib.request.urlopen(req, timeout=15) as resp:
        assert MARKER + b"lmq" in resp.read()

    # AMQPS and HTTPS through the follower's own TLS ports reach the leader's (other) TLS ports
    tconn = pika.BlockingConnection(pika.ConnectionParameters(
        f.ip, f.tls_port, ssl_options=pika.SSLOptions(ctx, "localhost"), socket_timeout=10,
        connection_attempts=5, retry_delay=1))
    try:
        got = tconn.channel().basic_get("tunnel-q", auto_ack=True)[2]
        assert got == MARKER + b"amqp"
    finally:
        tconn.close()
    over_https = _api(f"https://{f.ip}:{f.https_port}/api/overview", ctx)
    assert over_https["node"]

    captured = bytes(link.captured)
    assert len(captured) > 1000, "the relay saw no traffic"
    if clear:  # the capture can see client bytes: the check below can fail
        assert MARKER + b"amqp" in captured and MARKER + b"lmq" in captured
        return
    assert MARKER not in captured
    assert b"guest" not in captured and b"Authorization" not in captured


def _http10_half_closed(ip: str, port: int, path: str) -> bytes:
    """An HTTP/1.0 GET whose client half-closes right after the request; the whole response
    (headers and a complete JSON body), read until the server closes."""
    auth = base64.b64encode(b"guest:guest").decode()
    with socket.create_connection((ip, port), timeout=15) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {ip}\r\nAuthorization: Basic {auth}\r\n\r\n".encode())
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], got[:200]
    json.loads(body)  # complete, not cut off
    return got


def _repl_cn(ip: str, port: int, ca: Path) -> str:
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection((ip, port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            cert = s.getpeercert()
    return str(next(v for rdn in cert["subject"] for k, v in rdn if k == "commonName"))


def test_sighup_reloads_the_replication_certificate(tmp_path: Path) -> None:
    """A renewed certificate is served on the leader's replication port after SIGHUP, while the
    replication links already open carry on (no follower reconnects; confirms still need them)."""
    pki = make_pki(tmp_path / "pki")
    live = tmp_path / "live"
    live.mkdir()
    first = issue(pki.ca, live, "localhost", dns=("localhost",), ips=SERVER_IPS)
    c = Cluster(tmp_path)
    try:
        for n in c.nodes:
            n.argv += ["--tls-cert", str(first.cert), "--tls-key", str(first.key), "--tls-ca-cert",
                       str(pki.ca.cert_path), "--amqp-tls-port", "-1", "--mgmt-tls-port", "-1"]
        leader, followers = start_cluster(c)
        wait_for(lambda: all(n.node_id() in (c.etcd.get(f"{c.prefix}/isr") or b"").decode() for n in c.nodes),
                 30, "every node in the ISR")
        assert _repl_cn(leader.ip, leader.repl_port, pki.ca.cert_path) == "localhost"
        connects = leader.log_text().count("starting bulk sync")

        renewed = issue(pki.ca, tmp_path, "localhost renewed", dns=("localhost",), ips=SERVER_IPS)
        shutil.copy(renewed.cert, first.cert)
        shutil.copy(renewed.key, first.key)
        assert leader.proc is not None
        os.kill(leader.proc.pid, signal.SIGHUP)
        wait_for(lambda: _repl_cn(leader.ip, leader.repl_port, pki.ca.cert_path) == "localhost renewed", 15,
                 "the renewed certificate on the replication port")
        # the open links carry on: confirms (which wait for both followers) keep coming
        asyncio.run(asyncio.wait_for(_publish(leader.url, "after-reload", 20), 60))
        isr = (c.etcd.get(f"{c.prefix}/isr") or b"").decode()
        assert all(f.node_id() in isr for f in followers), isr
        assert leader.log_text().count("starting bulk sync") == connects, leader.log_tail()
    finally:
        c.close()
