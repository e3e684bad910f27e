"""A cluster leader's listener and the legs of follower tunnels (broker/net/listener.py ``remap``).

A leg is the leader's own connection to its listener, carrying one client's bytes; the map
names that client. The client chooses every byte on the leg, so a PROXY header on it is the
client's, and only the client's address may make it trusted, never the leg's local address
(which a same-host cluster or ``trusted_proxies = 127.0.0.1`` trusts). Real sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from broker.net.listener import Listener, Peer

CLIENT = ("10.1.2.3", 4000)  # the tunnelled client, as the follower named it
DEADLINE = 15.0


class _Seen(asyncio.Protocol):
    def __init__(self, peers: list[Peer], peer: Peer) -> None:
        peers.append(peer)


def _run(send: bytes, trusted_ips: set[str]) -> tuple[list[Peer], bool]:
    """Connect a leg (in ``remap``) to a listener whose trusted sources are ``trusted_ips``, send
    ``send``; the peers the protocol factory was given, and whether the listener closed the leg."""
    async def main() -> tuple[list[Peer], bool]:
        peers: list[Peer] = []
        remap: dict[Peer, Peer] = {}
        listener = Listener("AMQP", lambda peer: _Seen(peers, peer), lambda ip: ip in trusted_ips,
                            remap=remap)
        _host, port = await listener.start("127.0.0.1", 0)
        leg = socket.socket()
        try:
            leg.bind(("127.0.0.1", 0))
            name = leg.getsockname()
            remap[(name[0], name[1])] = CLIENT  # recorded before the leg's first byte, as tunnel.py does
            leg.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(leg, ("127.0.0.1", port))
            await loop.sock_sendall(leg, send)
            closed = False
            deadline = time.monotonic() + DEADLINE
            while not peers and not closed and time.monotonic() < deadline:
                try:
                    closed = await asyncio.wait_for(loop.sock_recv(leg, 100), 0.2) == b""
                except TimeoutError:
                    pass
                except ConnectionError:
                    closed = True
            return peers, closed
        finally:
            leg.close()
            await listener.stop()
    return asyncio.run(main())


def test_a_tunnelled_client_is_reported_by_its_own_address() -> None:
    peers, closed = _run(b"AMQP\x00\x00\x09\x01", {"127.0.0.1"})
    assert peers == [CLIENT] and not closed


def test_a_proxy_header_inside_a_tunnel_is_judged_by_the_client_not_the_leg(
        caplog: pytest.LogCaptureFixture) -> None:
    """The leg comes from 127.0.0.1, which this listener trusts; the client behind it is not
    trusted, so its own PROXY header (claiming loopback, where guest may log in) is refused."""
    with caplog.at_level(logging.WARNING, logger="broker.net.listener"):
        peers, closed = _run(b"PROXY TCP4 127.0.0.9 127.0.0.1 5555 5672\r\nAMQP\x00\x00\x09\x01",
                             {"127.0.0.1"})
    assert peers == [] and closed, peers
    assert "PROXY header from an untrusted peer" in caplog.text
    assert CLIENT[0] in caplog.text  # the log names the client, not the leg


def test_a_proxy_header_from_a_trusted_client_behind_the_tunnel_is_honoured() -> None:
    """A load balancer in front of a follower's plain port (trusted by address) still works:
    its PROXY header reaches the leader inside the tunnel and names the real client."""
    peers, closed = _run(b"PROXY TCP4 192.0.2.7 127.0.0.1 5555 5672\r\nAMQP\x00\x00\x09\x01",
                         {CLIENT[0]})
    assert peers == [("192.0.2.7", 5555)] and not closed
