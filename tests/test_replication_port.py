"""The leader's replication port against peers that are not members: a tunnel hello with a
wrong secret, garbage, nothing at all (in clear and over TLS), and a member's tunnel that ends.

A real ``LeaderSink`` listens on 127.0.0.1 in this process; the peers are real sockets. Every
wait polls with a deadline far above the (shortened) handshake timeout and far below asyncio's
own 60 s TLS handshake default, so a connection the leader forgets to bound fails the test.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from broker import tls
from broker.cluster import codec, leader, tunnel
from broker.cluster.leader import LeaderSink
from broker.cluster.proxy import SpliceProxy, Target, Tunnelled
from tests.integration._tls import make_pki

SECRET = b"s" * 32
# a verified client certificate a member ended TLS for (broker.tls.carried)
PEER = tls.PeerTLS("TLSv1.3", "TLS_AES_256_GCM_SHA384", {"subject": ((("commonName", "app"),),)})
DEADLINE = 15.0  # seconds: generous under load, well below asyncio's 60 s TLS default


async def _no_isr(members: list[str]) -> bool:
    return True


def _run(tmp_path: Path, body: Callable[[LeaderSink, int], Awaitable[Any]],
         tls: ssl.SSLContext | None = None) -> Any:
    async def main() -> Any:
        sink = LeaderSink(tmp_path, "L", SECRET, _no_isr)
        _host, port = await sink.start("127.0.0.1", 0, tls)
        try:
            return await asyncio.wait_for(body(sink, port), 2 * DEADLINE)
        finally:
            await sink.stop()
    return asyncio.run(main())


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the leader sends until it closes the connection (within DEADLINE)."""
    got = b""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        try:
            chunk = await asyncio.wait_for(reader.read(4096), deadline - time.monotonic())
        except (ConnectionError, ssl.SSLError):
            return got
        except TimeoutError:
            break
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the leader kept the connection open for {DEADLINE} s")


@pytest.fixture
def short_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leader, "HANDSHAKE_TIMEOUT", 0.5)


def test_tunnel_hello_with_a_wrong_secret_is_refused_and_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body(sink: LeaderSink, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(codec.encode_tunnel_hello(b"x" * 32, codec.AMQP_PORT, ("10.1.2.3", 4000),
                                               tls=tls.carried(PEER)))  # a certificate injected
        assert await _until_closed(reader) == bytes([codec.BAD_SECRET])
        writer.close()
        assert sink.refused == 1
        assert not sink.proxied_peers and not sink._tunnels and not sink.proxied_tls

    with caplog.at_level(logging.WARNING, logger="broker.cluster.leader"):
        _run(tmp_path, body)
    assert "wrong clustering secret" in caplog.text


def test_garbage_is_closed_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body(sink: LeaderSink, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        t0 = time.monotonic()
        assert await _until_closed(reader) == b""
        assert time.monotonic() - t0 < DEADLINE
        writer.close()
        assert sink.refused == 0

    with caplog.at_level(logging.WARNING, logger="broker.cluster.leader"):
        _run(tmp_path, body)
    assert "not a skred replication client" in caplog.text


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(tmp_path: Path, short_handshake: None) -> None:
    async def body(sink: LeaderSink, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(codec.TUNNEL_MAGIC[:3])  # a partial hello, then nothing
        assert await _until_closed(reader) == b""
        writer.close()

    _run(tmp_path, body)


def test_a_silent_peer_on_the_tls_port_is_dropped_after_the_handshake_timeout(
        tmp_path: Path, short_handshake: None) -> None:
    """A peer that opens TCP to the TLS replication port and never starts the TLS handshake
    holds a descriptor: it must go after the handshake timeout, not asyncio's 60 s."""
    pki = make_pki(tmp_path / "pki")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(pki.server.cert, pki.server.key)

    async def body(sink: LeaderSink, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # no ClientHello
        assert await _until_closed(reader) == b""
        writer.close()

    data = tmp_path / "data"
    data.mkdir()
    _run(data, body, server)


def test_a_member_tunnel_is_spliced_and_forgotten_when_it_ends(tmp_path: Path) -> None:
    """The right secret: the leader splices to its own listener, reports the client's address
    and the TLS the member ended for it for the leg while it lives, and drops both entries (and
    the tunnel) when the client leaves; a port it does not serve is refused with UNAVAILABLE."""
    async def body(sink: LeaderSink, port: int) -> None:
        seen: list[tuple[str, int]] = []
        certs: list[tls.PeerTLS | None] = []

        async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            peer = w.get_extra_info("peername")
            first = True
            while data := await r.read(4096):
                if first:  # like the broker's listeners: looked up once the client's bytes came
                    seen.append(sink.proxied_peers.get((peer[0], peer[1]), ("?", 0)))
                    certs.append(sink.proxied_tls.get((peer[0], peer[1])))
                    first = False
                w.write(data)
                await w.drain()
            w.close()

        listener = await asyncio.start_server(echo, "127.0.0.1", 0)
        lport = listener.sockets[0].getsockname()[1]
        sink.client_addresses = lambda: {"amqp": ("127.0.0.1", lport)}
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(codec.encode_tunnel_hello(SECRET, codec.HTTP_PORT, ("10.1.2.3", 4000)))
            assert await _until_closed(reader) == bytes([codec.UNAVAILABLE])
            writer.close()

            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(codec.encode_tunnel_hello(SECRET, codec.AMQP_PORT, ("10.1.2.3", 4000),
                                                   tls=tls.carried(PEER)))
            assert await asyncio.wait_for(reader.readexactly(1), DEADLINE) == bytes([codec.OK])
            writer.write(b"\0\0\0\4ping")  # framed: u32 length, bytes
            assert await asyncio.wait_for(reader.readexactly(8), DEADLINE) == b"\0\0\0\4ping"
            assert seen == [("10.1.2.3", 4000)]
            assert [c.login_name("common_name") if c else None for c in certs] == ["app"]
            assert len(sink.proxied_peers) == 1 and len(sink._tunnels) == 1
            writer.write(tunnel.END)  # our end: the listener's EOF comes back as its end marker
            assert await _until_closed(reader) == tunnel.END
            writer.close()
            deadline = time.monotonic() + DEADLINE
            while (sink.proxied_peers or sink._tunnels) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not sink.proxied_peers and not sink._tunnels and not sink.proxied_tls
        finally:
            listener.close()

    _run(tmp_path, body)


def test_a_refused_version_logs_the_peers_strings_escaped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Whoever connects chooses the node id of a hello: a refusal must not let it write lines
    of its own into the log."""
    async def body(sink: LeaderSink, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(codec.encode_hello(b"x" * 32, "n1\nWARNING forged line", version=codec.VERSION + 1))
        assert codec.parse_welcome(await _until_closed(reader)).status == codec.BAD_VERSION
        writer.close()

    with caplog.at_level(logging.WARNING, logger="broker.cluster.leader"):
        _run(tmp_path, body)
    assert "protocol version" in caplog.text
    assert "\nWARNING forged line" not in caplog.text


async def _http10_server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Answers once the client has sent everything (its EOF), like an HTTP/1.0 exchange with a
    client that half-closes: a big body, so the answer outlives the client's EOF by many writes."""
    request = await r.read()  # until EOF
    w.write(b"HTTP/1.0 200 OK\r\n\r\n" + request + b"." * 500_000)
    await w.drain()
    w.close()


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "clear"])
def test_a_client_that_half_closes_gets_the_whole_answer_through_a_tunnel(tmp_path: Path, tls: bool) -> None:
    """A plain client of a follower's proxy shuts down its sending side after its request: the
    leader's listener sees the EOF, and its answer still comes back in full, through a TLS
    tunnel too (a TLS transport cannot half-close: the tunnel carries the end of the stream)."""
    pki = make_pki(tmp_path / "pki")
    server_ctx: ssl.SSLContext | None = None
    client_ctx: ssl.SSLContext | None = None
    if tls:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(pki.server.cert, pki.server.key)
        client_ctx = pki.client_context()
    data = tmp_path / "data"
    data.mkdir()

    async def body(sink: LeaderSink, port: int) -> None:
        listener = await asyncio.start_server(_http10_server, "127.0.0.1", 0)
        sink.client_addresses = lambda: {"http": ("127.0.0.1", listener.sockets[0].getsockname()[1])}
        tunnelled = Tunnelled(codec.HTTP_PORT, lambda: SECRET, lambda: client_ctx)
        proxy = SpliceProxy("HTTP", Target("localhost", port), False, None, tunnelled)
        pport = await proxy.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", pport)
            writer.write(b"GET / HTTP/1.0\r\n\r\n")
            writer.write_eof()
            got = await _until_closed(reader)
            writer.close()
            assert got == b"HTTP/1.0 200 OK\r\n\r\nGET / HTTP/1.0\r\n\r\n" + b"." * 500_000
        finally:
            await proxy.stop()
            listener.close()

    _run(data, body, server_ctx)


def test_bytes_sent_right_behind_a_tunnel_hello_reach_the_listener(tmp_path: Path) -> None:
    """The leader reads exactly the hello: a first frame pipelined in the same write is not
    swallowed with it."""
    async def body(sink: LeaderSink, port: int) -> None:
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def first_bytes(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            got.set_result(await r.read(100))
            w.close()

        listener = await asyncio.start_server(first_bytes, "127.0.0.1", 0)
        sink.client_addresses = lambda: {"amqp": ("127.0.0.1", listener.sockets[0].getsockname()[1])}
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(codec.encode_tunnel_hello(SECRET, codec.AMQP_PORT, ("10.1.2.3", 4000))
                         + b"\0\0\0\x08AMQP\0\0\x09\x01")
            assert await asyncio.wait_for(reader.readexactly(1), DEADLINE) == bytes([codec.OK])
            assert await asyncio.wait_for(got, DEADLINE) == b"AMQP\0\0\x09\x01"
            writer.close()
        finally:
            listener.close()

    _run(tmp_path, body)


def test_refusals_are_logged_once_per_burst_with_a_count(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A flood of wrong-secret tunnels logs one line when it starts and one sum when it has
    gone quiet, not a line per connection; every refusal is still counted."""
    async def body(sink: LeaderSink, port: int) -> None:
        sink.gate.quiet = 0.5
        for _ in range(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(codec.encode_tunnel_hello(b"x" * 32, codec.AMQP_PORT, ("10.1.2.3", 4000)))
            assert await _until_closed(reader) == bytes([codec.BAD_SECRET])
            writer.close()
        assert sink.refused == 20
        assert caplog.text.count("wrong clustering secret") == 1
        deadline = time.monotonic() + DEADLINE
        while "refused 20 connections" not in caplog.text and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "refused 20 connections to the replication port from 127.0.0.1" in caplog.text

    with caplog.at_level(logging.WARNING, logger="broker.cluster.leader"):
        _run(tmp_path, body)


def test_unfinished_connections_are_bounded_per_source_but_not_a_members_tunnels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stranger (127.0.0.2) holding its limit of silent connections has the next one closed
    at once (long before the handshake timeout); a member's address (127.0.0.3: it presented
    the secret once) opening many tunnels at once, as after a failover, has none refused."""
    monkeypatch.setattr(leader, "HANDSHAKE_TIMEOUT", 60.0)  # silence alone would not end them

    async def body(sink: LeaderSink, port: int) -> None:
        sink.gate.per_source = 4
        held = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
                for _ in range(4)]
        deadline = time.monotonic() + DEADLINE
        while sink.gate.pending.get("127.0.0.2", 0) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        assert await _until_closed(reader) == b""  # within DEADLINE, far below the 60 s
        writer.close()
        assert sink.gate.turned_away == 1

        async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(4096):
                w.write(data)
            w.close()

        listener = await asyncio.start_server(echo, "127.0.0.1", 0)
        sink.client_addresses = lambda: {"amqp": ("127.0.0.1", listener.sockets[0].getsockname()[1])}
        hello = codec.encode_tunnel_hello(SECRET, codec.AMQP_PORT, ("10.1.2.3", 4000))
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))
            w.write(hello)  # a member's link (or a first tunnel) from this address
            assert await asyncio.wait_for(r.readexactly(1), DEADLINE) == bytes([codec.OK])
            storm = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))
                     for _ in range(40)]
            while sink.gate.pending.get("127.0.0.3", 0) < 40 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert sink.gate.pending.get("127.0.0.3", 0) == 40  # all unfinished at once
            for _r, sw in storm:
                sw.write(hello)
            for sr, _w in storm:
                assert await asyncio.wait_for(sr.readexactly(1), DEADLINE) == bytes([codec.OK])
            assert sink.gate.turned_away == 1
            for _r, sw in [*storm, (r, w), *held]:
                sw.close()
        finally:
            listener.close()

    with caplog.at_level(logging.WARNING, logger="broker.cluster.leader"):
        _run(tmp_path, body)
    assert "4 unfinished connections from it already" in caplog.text


def test_a_tunnel_over_a_link_gone_silent_is_closed_at_both_ends_within_its_keepalive(tmp_path: Path) -> None:
    """A follower's proxy (keepalive 3 s) tunnels a client to the leader through a relay. Idle
    for longer than the keepalive, the tunnel stays up (pings); once the relay drops every byte
    (a cut network: no reset, no FIN) the leader's leg to its own listener and the client's
    socket both close within the keepalive and a tick, not whenever TCP gives up."""
    from tests.integration._relay import Relay

    keepalive = 3.0

    async def body(sink: LeaderSink, port: int) -> None:
        legs: list[asyncio.Future[float]] = []

        async def backend(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            ended: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            legs.append(ended)
            try:
                while data := await r.read(4096):
                    w.write(data)
            except ConnectionError:
                pass
            ended.set_result(time.monotonic())
            w.close()

        listener = await asyncio.start_server(backend, "127.0.0.1", 0)
        sink.client_addresses = lambda: {"amqp": ("127.0.0.1", listener.sockets[0].getsockname()[1])}
        relay = Relay(("127.0.0.1", port))
        proxy = SpliceProxy("AMQP", Target("127.0.0.1", relay.port), False, None,
                            Tunnelled(codec.AMQP_PORT, lambda: SECRET, lambda: None, "F", keepalive))
        proxy_port = await proxy.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
            writer.write(b"ping?")
            assert await asyncio.wait_for(reader.readexactly(5), DEADLINE) == b"ping?"
            assert set(sink._tunnels) == {"F"}  # the leader knows whose tunnel it is
            idle = time.monotonic()
            while time.monotonic() - idle < keepalive + 1.5:  # idle, longer than the keepalive
                await asyncio.sleep(0.25)
                assert not legs[0].done(), "an idle tunnel was closed: pings did not keep it"
            writer.write(b"still")
            assert await asyncio.wait_for(reader.readexactly(5), DEADLINE) == b"still"
            relay.freeze()
            cut = time.monotonic()
            closed_at = await asyncio.wait_for(legs[0], DEADLINE)
            assert closed_at - cut <= keepalive + keepalive / 3 + 1.5, closed_at - cut
            try:
                tail = await asyncio.wait_for(reader.read(100), DEADLINE)
            except ConnectionError:
                tail = b""  # reset: closed too
            assert tail == b""
            assert time.monotonic() - cut <= keepalive + keepalive / 3 + 2.5
            writer.close()
        finally:
            await proxy.stop()
            relay.close()
            listener.close()

    _run(tmp_path, body)
