"""Client tunnels from a follower's proxy to the leader, over the replication port.

Theory of operation
-------------------
A follower proxies the plain client ports (AMQP, management HTTP, LMQ HTTP and
RPC) to the leader. It does not splice them to the leader's client ports in
clear: each client connection becomes one connection to the leader's
replication port — TLS whenever the replication link is (``[clustering] tls``
with a certificate), verified against ``tls_ca_cert`` like the link itself —
opened with a ``TunnelHello``: the cluster secret, which client port, and the
address the client connected from. The leader checks the secret, answers one
status byte and, on ``OK``, connects to its own listener for that port and
splices the two. So client bytes, passwords included, never cross the network
between nodes in clear when cluster TLS is on. (AMQPS and HTTPS need no tunnel:
the follower passes them to the leader's TLS ports, and TLS runs end to end.)

The real client address: the leader's leg to its own listener is a local
connection; before a byte is written on it, the leader records
``leg address -> client address`` in the broker's ``proxied_peers`` map, and
every listener (AMQP, HTTP, LMQ) reports a peer found in that map as the
client's address (logs, ``/api/connections``, the loopback-only rule of
``guest``, login throttling). Only this process writes that map, keyed by its
own connected sockets, so no PROXY header has to be trusted on that hop; the
entry goes when the leg closes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, MutableMapping

from broker.cluster import codec

log = logging.getLogger(__name__)

CHUNK = 65536
CONNECT_TIMEOUT = 5.0
Address = tuple[str, int]


class TunnelRefused(ConnectionError):
    pass


async def open_tunnel(host: str, port: int, *, which: int, client: Address, secret: bytes,
                      tls: ssl.SSLContext | None, source_ip: str | None
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Follower side: a tunnel to the leader's client port ``which`` (codec.AMQP_PORT...)."""
    local = (source_ip, 0) if source_ip else None
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, local_addr=local, ssl=tls), CONNECT_TIMEOUT)
    try:
        writer.write(codec.encode_tunnel_hello(secret, which, client))
        status = await asyncio.wait_for(reader.readexactly(1), CONNECT_TIMEOUT)
    except BaseException:
        writer.close()
        raise
    if status[0] != codec.OK:
        writer.close()
        why = {codec.BAD_SECRET: "wrong clustering secret", codec.BAD_VERSION: "protocol version refused",
               codec.UNAVAILABLE: "the leader does not serve that port"}.get(status[0], "refused")
        raise TunnelRefused(f"tunnel to {codec.PORT_NAMES[which]} refused: {why}")
    return reader, writer


def local_target(address: Address) -> Address:
    """Where this node reaches its own listener bound to ``address``."""
    host, port = address
    if host in ("0.0.0.0", ""):
        return "127.0.0.1", port
    if host == "::":
        return "::1", port
    return host, port


async def serve_tunnel(hello: codec.TunnelHello, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       addresses: Callable[[], dict[str, Address]],
                       peers: MutableMapping[Address, Address]) -> None:
    """Leader side, after the secret was checked: splice the tunnel to our own listener."""
    address = addresses().get(codec.PORT_NAMES[hello.port])
    if address is None:
        writer.write(bytes([codec.UNAVAILABLE]))
        writer.close()
        return
    try:
        lreader, lwriter = await asyncio.wait_for(
            asyncio.open_connection(*local_target(address)), CONNECT_TIMEOUT)
    except (OSError, TimeoutError) as exc:
        log.info("tunnel to our %s port: %s", codec.PORT_NAMES[hello.port], exc)
        writer.write(bytes([codec.UNAVAILABLE]))
        writer.close()
        return
    leg = lwriter.get_extra_info("sockname")
    key = (str(leg[0]), int(leg[1]))
    peers[key] = hello.client  # before the first byte reaches the listener
    try:
        writer.write(bytes([codec.OK]))
        await asyncio.gather(pump(reader, lwriter), pump(lreader, writer))
    finally:
        peers.pop(key, None)
        lwriter.close()
        writer.close()


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until EOF, then half-close ``writer``."""
    # uvloop raises RuntimeError (not OSError) for a write on a transport closed under us.
    try:
        while data := await reader.read(CHUNK):
            if writer.is_closing():
                return
            writer.write(data)
            await writer.drain()
    except (OSError, RuntimeError):
        pass
    finally:
        try:
            if not writer.is_closing() and writer.can_write_eof():
                writer.write_eof()  # half-close: the other direction may still be talking
            elif not writer.is_closing():
                writer.close()  # TLS cannot half-close: the other direction ends with it
        except (OSError, RuntimeError):
            writer.close()
