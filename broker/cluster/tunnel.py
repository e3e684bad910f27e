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

The stream is framed, both ways: ``u32 length, bytes``, a length of 0 marking
the end of that direction (version 5). A TLS transport cannot half-close (no
``write_eof``), and clients do: one that shuts down its sending side after its
request (HTTP/1.0 tools, ``nc -N``) still waits for the answer. So a pump that
reads EOF from its plain socket sends the end marker and keeps the tunnel open
for the other direction; the pump on the other end half-closes its plain
socket when the marker comes. The tunnel itself is closed when both directions
ended. A tunnel that ends without the marker was cut (a node died, a reset):
the plain socket on that side is aborted (a reset, not a clean end), so no
client takes a cut answer for a complete one. Framing costs 4 bytes per read of
up to 64 KiB and one copy; ``benchmarks/tunnel_bulk.py`` measures a bulk
transfer through a tunnel.

Keepalive (version 6): a client connection through a tunnel may be idle for
hours (a consumer waiting), and a cut network shows no reset, so without one a
tunnel over a dead link would hold the client's connection on the leader — and
its unacked messages — for as long as the cut lasts. Each end writes a ping (a
frame of length ``PING_LEN``, no data frame is that long) whenever it has
written nothing for a third of the keepalive, also after its end marker, and
reads pings after the other end's marker; an end that has read nothing at all
for the whole keepalive presumes the link dead and cuts the tunnel (the plain
socket is reset). The follower names the keepalive (``[clustering]
tunnel_keepalive``) in its ``TunnelHello`` and the leader uses that value, so
the two ends always agree. The leader also cuts every tunnel of a follower it
drops (``LeaderSink``): a link that stopped carrying replication acks carries no
client either, and the proxied clients' deliveries return to their queues
within the follower's ack timeout, not a keepalive later.

The real client address: the leader's leg to its own listener is a local
connection; before a byte is written on it, the leader records
``leg address -> client address`` in the broker's ``proxied_peers`` map, and
every listener (AMQP, HTTP, LMQ) reports a peer found in that map as the
client's address (logs, ``/api/connections``, the loopback-only rule of
``guest``, login throttling). Only this process writes that map, keyed by its
own connected sockets, so no PROXY header has to be trusted on that hop; the
entry goes when the leg closes. The same holds for the client's TLS: a member that ended a
client's TLS and carries it on (``cluster/elsewhere.py``) names the verified peer in its hello
(``broker.tls.carried``: PROXY v2's SSL TLV), and the serving node records ``leg address ->
PeerTLS`` in the broker's ``proxied_tls``, where the AMQP listener finds the certificate that
EXTERNAL logs in with. Only a tunnel (the cluster secret checked) writes that map: a client
cannot name a certificate, nor can a PROXY header.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
import time
from collections.abc import Callable, MutableMapping

from broker.cluster import codec
from broker.tls import PeerTLS, from_carried

log = logging.getLogger(__name__)

CHUNK = 65536
_LEN = struct.Struct(">I")
END = _LEN.pack(0)  # the end of one direction of a tunnel
PING_LEN = 0xFFFFFFFF  # a frame length no data frame has (CHUNK bounds them): a keepalive ping
PING = _LEN.pack(PING_LEN)
CONNECT_TIMEOUT = 5.0
MIN_KEEPALIVE = 1.0  # seconds: a peer asking for less would have us ping all the time
MAX_KEEPALIVE = 3600.0
Address = tuple[str, int]


class TunnelRefused(ConnectionError):
    pass


async def open_tunnel(host: str, port: int, *, which: int, client: Address, secret: bytes,
                      tls: ssl.SSLContext | None, source_ip: str | None, node_id: str = "",
                      keepalive: float = 0.0, peer_tls: bytes = b""
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Follower side: a tunnel to the leader's client port ``which`` (codec.AMQP_PORT...), named
    as ours (``node_id``), with ``keepalive`` seconds of silence after which either end closes it;
    ``peer_tls``: the client's TLS we ended (``broker.tls.carried``)."""
    local = (source_ip, 0) if source_ip else None
    async with asyncio.timeout(CONNECT_TIMEOUT):
        reader, writer = await asyncio.open_connection(host, port, local_addr=local, ssl=tls)
    try:
        writer.write(codec.encode_tunnel_hello(secret, which, client, node_id=node_id,
                                               keepalive_ms=round(keepalive * 1000), tls=peer_tls))
        async with asyncio.timeout(CONNECT_TIMEOUT):
            status = await reader.readexactly(1)
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
                       peers: MutableMapping[Address, Address],
                       tls_peers: MutableMapping[Address, PeerTLS] | None = None) -> None:
    """Leader side, after the secret was checked: splice the tunnel to our own listener (the
    client's address in ``peers``, the TLS the sending member ended for it in ``tls_peers``)."""
    carried: PeerTLS | None = None
    if hello.tls:
        try:
            carried = from_carried(hello.tls)
        except ValueError as exc:  # a member's bug: the client goes on as one with no certificate
            log.warning("tunnel from %s: its client's TLS is not usable (%s)", hello.node_id or "?", exc)
    address = addresses().get(codec.PORT_NAMES[hello.port])
    if address is None:
        writer.write(bytes([codec.UNAVAILABLE]))
        writer.close()
        return
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            lreader, lwriter = await asyncio.open_connection(*local_target(address))
    except (OSError, TimeoutError) as exc:
        log.info("tunnel to our %s port: %s", codec.PORT_NAMES[hello.port], exc)
        writer.write(bytes([codec.UNAVAILABLE]))
        writer.close()
        return
    leg = lwriter.get_extra_info("sockname")
    key = (str(leg[0]), int(leg[1]))
    peers[key] = hello.client  # before the first byte reaches the listener
    if carried is not None and tls_peers is not None:
        tls_peers[key] = carried
    try:
        writer.write(bytes([codec.OK]))
        await splice((lreader, lwriter), (reader, writer), keepalive_of(hello))
    finally:
        peers.pop(key, None)
        if tls_peers is not None:
            tls_peers.pop(key, None)
        lwriter.close()
        writer.close()


def keepalive_of(hello: codec.TunnelHello) -> float:
    """The keepalive the follower asked for, in seconds (0: none), kept within sane bounds."""
    if not hello.keepalive_ms:
        return 0.0
    return min(max(hello.keepalive_ms / 1000, MIN_KEEPALIVE), MAX_KEEPALIVE)


class _Ends:
    """What one end of a tunnel knows of it: both directions' end markers and the clock of the
    link (the last frame read, the last frame written) its keeper watches."""

    def __init__(self, tunnel: asyncio.StreamWriter, keepalive: float) -> None:
        self.tunnel = tunnel
        self.keepalive = keepalive
        self.sent_end = False
        self.got_end = False
        self.finished = asyncio.Event()  # both directions ended with their markers
        now = time.monotonic()
        self.last_read = self.last_write = now
        self.silent = False  # nothing came for ``keepalive`` seconds: the link is presumed dead

    def write(self, data: bytes) -> None:
        self.tunnel.write(data)
        self.last_write = time.monotonic()

    def ended(self, sent: bool) -> None:
        if sent:
            self.sent_end = True
        else:
            self.got_end = True
        if self.sent_end and self.got_end:
            self.finished.set()

    async def keep(self) -> None:
        """Send a ping whenever we have written nothing for a third of the keepalive, and
        return when nothing at all was read for the whole keepalive (the link is dead)."""
        every = self.keepalive / 3
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            if now - self.last_read > self.keepalive:
                self.silent = True
                return
            if now - self.last_write >= every and not self.tunnel.is_closing():
                self.write(PING)


async def splice(plain: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 tunnel: tuple[asyncio.StreamReader, asyncio.StreamWriter], keepalive: float) -> bool:
    """Carry a plain connection over a framed tunnel until both directions ended (True), or the
    tunnel was cut or went silent for ``keepalive`` seconds (0: never presumed dead); on a cut
    the plain socket is reset. The caller closes both writers afterwards."""
    (preader, pwriter), (treader, twriter) = plain, tunnel
    ends = _Ends(twriter, keepalive)
    sending = asyncio.ensure_future(frame(preader, ends))
    receiving = asyncio.ensure_future(unframe(treader, pwriter, ends))
    finished = asyncio.ensure_future(ends.finished.wait())
    keeper = asyncio.ensure_future(ends.keep()) if keepalive > 0 else None
    tasks = [sending, receiving, finished, *([keeper] if keeper is not None else [])]
    watched = set(tasks)
    try:
        while True:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if done == {sending} and sending.result():
                watched.discard(sending)  # our direction ended: wait for the other one
                continue
            # both directions ended; or the far end went (after its end marker, or cut); or the
            # tunnel failed under a write; or the link is silent
            break
    finally:
        for t in tasks:
            t.cancel()
    if ends.silent:
        log.warning("tunnel silent for %.0fs: presumed dead, closing its client connection", keepalive)
    clean = ends.finished.is_set()
    if not clean:
        pwriter.transport.abort()  # cut: a reset, so nobody takes it for the whole answer
    return clean


async def frame(reader: asyncio.StreamReader, ends: _Ends) -> bool:
    """Plain socket -> tunnel: each read as one frame, then the end marker on EOF. False when
    the tunnel failed under us (closed: the far side sees a cut tunnel)."""
    tunnel = ends.tunnel
    try:
        while data := await reader.read(CHUNK):
            if tunnel.is_closing():
                return False
            ends.write(_LEN.pack(len(data)) + data)  # one write: one TLS record, not two
            await tunnel.drain()
        if not tunnel.is_closing():
            ends.write(END)  # the other direction may still be talking: the tunnel stays open
            await tunnel.drain()
            ends.ended(sent=True)
            return True
    except (OSError, RuntimeError):
        pass
    tunnel.close()
    return False


async def unframe(tunnel: asyncio.StreamReader, writer: asyncio.StreamWriter, ends: _Ends) -> None:
    """Tunnel -> plain socket, until the end marker (then half-close it) and, after it, only
    pings until the far end closes; returns at the far end's close or a cut."""
    # uvloop raises RuntimeError (not OSError) for a write on a transport closed under us.
    try:
        while True:
            n = _LEN.unpack(await tunnel.readexactly(4))[0]
            ends.last_read = time.monotonic()
            if n == PING_LEN:
                continue
            if ends.got_end:
                raise codec.CodecError("tunnel data after its end marker")
            if not n:
                _half_close(writer)
                ends.ended(sent=False)
                continue
            if n > CHUNK:
                raise codec.CodecError(f"tunnel frame of {n} bytes")
            while n:  # pass on what has come (a TLS record or so), as a plain splice would
                data = await tunnel.read(n)
                if not data:
                    raise asyncio.IncompleteReadError(b"", n)
                ends.last_read = time.monotonic()
                if writer.is_closing():
                    return
                writer.write(data)
                n -= len(data)
            await writer.drain()
    except (OSError, RuntimeError, asyncio.IncompleteReadError, codec.CodecError):
        return


def write_framed(tunnel: asyncio.StreamWriter, data: bytes) -> None:
    """One data frame onto a tunnel, before ``splice`` runs (a routed handshake: vhost_router.py)."""
    if data:
        tunnel.write(_LEN.pack(len(data)) + data)


async def read_framed(tunnel: asyncio.StreamReader) -> bytes:
    """The next data frame off a tunnel, before ``splice`` runs (pings skipped); b"" at its end
    marker or a cut."""
    try:
        while True:
            n = _LEN.unpack(await tunnel.readexactly(4))[0]
            if n == PING_LEN:
                continue
            if not n or n > CHUNK:
                return b""
            return await tunnel.readexactly(n)
    except (OSError, asyncio.IncompleteReadError):
        return b""


def _half_close(writer: asyncio.StreamWriter) -> None:
    try:
        if not writer.is_closing():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until EOF, then half-close ``writer`` (plain TCP both sides)."""
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
            if not writer.is_closing():
                writer.write_eof()  # half-close: the other direction may still be talking
        except (OSError, RuntimeError):
            writer.close()
