"""Client listeners: accept, strip a PROXY header from trusted peers, start TLS, hand over.

Theory of operation
-------------------
Every client port (AMQP, AMQPS, management HTTP and HTTPS) is a ``Listener``:
an accept loop on a non-blocking socket. For each accepted connection it
*peeks* (``MSG_PEEK``) at the first bytes without consuming them:

* protocol bytes (``AMQP``, a TLS ClientHello, an HTTP request line): nothing
  is consumed, the socket goes to the event loop as it is;
* a PROXY v1/v2 header (``broker.net.proxy``) from a trusted peer: exactly the
  header's bytes are read off the socket, and the address it carries becomes
  the connection's peer; from anyone else the connection is closed and logged.

A peer found in ``remap`` (a cluster leader's own end of a follower's client
tunnel, recorded before its first byte was sent) is reported as the client
address that map names; a PROXY header on such a leg was written by that
client, so the client's address, not the leg's, decides whether it is trusted.

Then the socket is handed to ``loop.connect_accepted_socket`` with the
listener's current TLS context, if any: the header travels in clear before
the TLS handshake (as HAProxy sends it), and the loop's own TLS transport
does the rest. Because the header is consumed before that hand-over, one code
path serves plain and TLS listeners, and AMQP and HTTP alike.

Peeking leaves the bytes in the kernel, so a peer that sends part of a header
and stops would make the socket readable forever: that case waits in short
sleeps instead, all within ``HEADER_TIMEOUT`` (the TLS handshake has its own
timeout). The protocol factory receives the effective peer address.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import ssl
import stat
from collections.abc import Callable, Mapping
from typing import Any

from broker.aio import AnswerAfterEOF
from broker.auth.users import UNIX_PEER
from broker.net import proxy

log = logging.getLogger(__name__)

Peer = tuple[str, int]
ProtocolFactory = Callable[[Peer], asyncio.BaseProtocol]
HEADER_TIMEOUT = 10.0  # seconds for the first bytes (and a PROXY header) to arrive
TLS_HANDSHAKE_TIMEOUT = 10.0
_PARTIAL_WAIT = 0.01  # poll interval while only part of a PROXY header has arrived
_PEEK = proxy.V2_MAX


class Listener:
    """One listening socket serving one protocol, optionally over TLS."""

    def __init__(self, name: str, factory: ProtocolFactory, trusted: Callable[[str], bool], *,
                 tls: Callable[[], ssl.SSLContext] | None = None, nodelay: bool = True,
                 remap: Mapping[Peer, Peer] | None = None, reuse_port: bool = False) -> None:
        self.name = name
        self.reuse_port = reuse_port  # beside the other workers of this node (broker/shards)
        self.remap = remap if remap is not None else {}
        self.factory = factory
        self.trusted = trusted
        self.tls = tls  # called per connection: a SIGHUP reload applies to the next accept
        self.nodelay = nodelay
        self.sock: socket.socket | None = None
        self.address: Peer = ("", 0)
        self._accepting: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self.unix_path: str | None = None

    async def start(self, host: str, port: int) -> Peer:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=1024, reuse_port=self.reuse_port)
        sock.setblocking(False)
        self.sock = sock
        addr = sock.getsockname()
        self.address = (str(addr[0]), int(addr[1]))
        self._accepting = asyncio.create_task(self._accept_loop(sock))
        return self.address

    async def start_unix(self, path: str, mode: int) -> Peer:
        """Listen on a Unix socket at ``path`` (a stale socket file there is replaced; any other
        file is an error), with file mode ``mode``: the file's permissions decide who may
        connect. Its clients' peer is ``UNIX_PEER``; no PROXY header is taken on it."""
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, mode)
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self.sock = sock
        self.unix_path = path
        self.address = (path, 0)
        self._accepting = asyncio.create_task(self._accept_loop(sock))
        return self.address

    async def stop(self) -> None:
        """Stop accepting; connections already handed over are their owner's to close."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
            self._accepting = None
        for task in list(self._pending):
            task.cancel()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
            self.unix_path = None

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError as exc:
                # EMFILE and friends: keep the listener, give the process a moment.
                log.warning("%s listener: accept failed: %s", self.name, exc.strerror or exc)
                await asyncio.sleep(0.1 if exc.errno in (errno.EMFILE, errno.ENFILE) else 0)
                continue
            peer = (UNIX_PEER, 0) if conn.family == socket.AF_UNIX else (str(addr[0]), int(addr[1]))
            task = asyncio.create_task(self._serve(conn, peer))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _serve(self, conn: socket.socket, peer: Peer) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        if self.nodelay:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        try:
            if peer[0] != UNIX_PEER:
                async with asyncio.timeout(HEADER_TIMEOUT):
                    peer = await self._strip_proxy_header(loop, conn, peer)
            peer = self.remap.get(peer, peer)
            ctx = self.tls() if self.tls is not None else None
            real = peer
            await loop.connect_accepted_socket(
                lambda: self.factory(real), conn, ssl=ctx,
                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT if ctx is not None else None)
        except _Refused as exc:
            who = self.remap.get(peer, peer)
            log.warning("%s: closed connection from %s:%d: %s", self.name, who[0], who[1], exc)
            conn.close()
        except TimeoutError:
            log.info("%s: connection from %s:%d sent nothing in time", self.name, peer[0], peer[1])
            conn.close()
        except (OSError, ssl.SSLError, ConnectionError) as exc:
            # a failed TLS handshake (untrusted CA, old protocol version, no client certificate)
            log.info("%s: connection from %s:%d failed: %s", self.name, peer[0], peer[1], exc)
            conn.close()
        except asyncio.CancelledError:  # the listener stopped before the connection was handed over
            conn.close()
            raise

    async def _strip_proxy_header(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                                  peer: Peer) -> Peer:
        """Consume a trusted PROXY header and return the address it names (else ``peer``)."""
        while True:
            await _readable(loop, conn)
            try:
                data = conn.recv(_PEEK, socket.MSG_PEEK)
            except BlockingIOError:
                continue
            if not data:
                return peer  # closed before a byte: the protocol sees the EOF
            kind = proxy.sniff(data)
            if kind is proxy.Sniff.NONE:
                return peer
            if kind is proxy.Sniff.MORE:
                await asyncio.sleep(_PARTIAL_WAIT)
                continue
            # on a tunnel leg the client wrote the header: its address decides, not the leg's
            if not self.trusted(self.remap.get(peer, peer)[0]):
                raise _Refused("PROXY header from an untrusted peer")
            try:
                parsed = proxy.parse(data)
            except proxy.ProxyHeaderError as exc:
                raise _Refused(f"bad PROXY header: {exc}") from None
            if parsed is None:
                await asyncio.sleep(_PARTIAL_WAIT)
                continue
            used, src = parsed
            _consume(conn, used)
            return src if src is not None else peer


class _Refused(Exception):
    pass


def _consume(conn: socket.socket, n: int) -> None:
    """Read exactly ``n`` bytes that a peek showed are already in the socket buffer."""
    while n > 0:
        got = conn.recv(n)
        if not got:
            raise ConnectionResetError("closed while reading the PROXY header")
        n -= len(got)


async def _readable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


class PeerTransport:
    """A transport that reports a PROXY header's address as its peer (for aiohttp's
    ``request.remote``), delegating everything else to the real transport."""

    def __init__(self, transport: Any, peer: Peer) -> None:
        self._transport = transport
        self._peer = peer

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peer
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class PeerProtocol(AnswerAfterEOF):
    """Wraps a protocol so it sees ``PeerTransport`` instead of the socket's transport (and gets
    its answer out to a client that half-closed, as ``AnswerAfterEOF`` does)."""

    def __init__(self, inner: Any, peer: Peer) -> None:
        super().__init__(inner)
        self.peer = peer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(PeerTransport(transport, self.peer))


def keep_peer(factory: Callable[[], Any]) -> ProtocolFactory:
    """A listener factory for a protocol that learns its peer from the transport (aiohttp's):
    the wrapped transport reports the listener's peer, i.e. a PROXY header's address."""

    def make(peer: Peer) -> asyncio.BaseProtocol:
        return PeerProtocol(factory(), peer)

    return make
