"""asyncio pieces the front ends share (the management listener in ``net``, LMQ's HTTP API, the
stream protocol's listeners, the hand-over of a connection to another worker of the node).

Hand-over (a node of several workers, ``broker/shards``): a front end that has read enough of a
connection to know its vhost, and finds that vhost owned by another worker (``Router.elsewhere``),
gives the connection away with ``give_away``. A plain TCP or Unix socket is passed itself: its
descriptor, duplicated, goes to the owner with the state the front end names (``Router.hand_over``)
and this process drops its copy without a word to the client. A TLS connection or one on a
WebSocket cannot change process (the TLS state and the WebSocket framing live here), so one end of
a socket pair goes instead and this process relays the plain bytes both ways (``Relay``, with flow
control both ways: a side that does not read is not read for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import ssl
from collections.abc import Callable
from typing import Any, Final, Protocol, cast

_log = logging.getLogger(__name__)

# One path segment with any characters in it. aiohttp's default for a bare ``{var}`` is
# ``[^{}/]+``, which answers 404 for a queue or exchange named ``a{b}`` (RabbitMQ takes any
# UTF-8 name); ``/`` inside a name arrives as ``%2F`` and stays in its segment.
_BARE_VAR: Final = re.compile(r"\{([_a-zA-Z][_a-zA-Z0-9]*)\}")


def any_segment(path: str) -> str:
    """``path`` with every bare ``{var}`` matching any characters of its segment."""
    return _BARE_VAR.sub(r"{\1:[^/]+}", path)


class AnswerAfterEOF(asyncio.Protocol):
    """Wraps a protocol (aiohttp's request handler) so that a client shutting down its sending
    side after its request (HTTP/1.0 tools, ``nc -N``) still gets the answer: on a plain
    transport our side stays open (aiohttp would let the transport close it at once and drop
    the answer); aiohttp closes after an answer that is not keep-alive, and its keep-alive
    timeout closes an idle connection. TLS cannot half-close: there the inner protocol decides."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.plain = True
        self.eof = False  # the client has shut down its sending side (or gone)

    def connection_made(self, transport: Any) -> None:  # a transport, or one wrapping it
        self.plain = transport.get_extra_info("sslcontext") is None
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        self.eof = True
        result: bool | None = self.inner.eof_received()
        return True if self.plain else result

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class RequestDeadline(AnswerAfterEOF):
    """``AnswerAfterEOF`` that also closes a connection which has had no request in progress
    for ``timeout`` seconds: idle keep-alive connections and half-sent requests (headers that
    never end) alike. The app marks a request in progress with ``started``/``finished`` (a long
    poll is not idle); a body that stalls is the handler's to time out."""

    def __init__(self, inner: Any, timeout: float) -> None:
        super().__init__(inner)
        self.timeout = timeout
        self.busy = 0
        self.idle_since = 0.0
        self._transport: Any = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        loop = asyncio.get_running_loop()
        self.idle_since = loop.time()
        self._timer = loop.call_later(self.timeout, self._check)
        super().connection_made(transport)

    def started(self) -> None:
        self.busy += 1

    def finished(self) -> None:
        self.busy -= 1
        self.idle_since = asyncio.get_running_loop().time()

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        due = self.idle_since + self.timeout
        if not self.busy and loop.time() >= due:
            self._timer = None
            self._transport.close()
            return
        self._timer = loop.call_later(max(0.05, due - loop.time()) if not self.busy else self.timeout,
                                      self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)


class Listeners:
    """One front end's listeners: plain and TLS TCP ports and a Unix socket (MQTT's and the
    stream protocol's shape). A port that cannot be bound is logged and skipped, so one busy
    port never keeps the broker from starting. ``addresses`` maps each started TCP listener's
    name to the address it got (port 0: the kernel's choice)."""

    def __init__(self, what: str, log: logging.Logger) -> None:
        self.what = what
        self.log = log
        self.servers: list[asyncio.Server] = []
        self.addresses: dict[str, tuple[str, int]] = {}

    async def tcp(self, name: str, factory: Callable[[], asyncio.Protocol], bind: str, port: int,
                  ctx: ssl.SSLContext | None = None, reuse_port: bool = False) -> None:
        """``reuse_port``: one of several workers on the node's port (``broker/shards``)."""
        try:
            server = await asyncio.get_running_loop().create_server(factory, bind, port, ssl=ctx,
                                                                    reuse_address=True,
                                                                    reuse_port=reuse_port or None)
        except OSError as exc:
            self.log.error("%s listener not started: cannot bind %s:%d: %s", name, bind, port,
                           exc.strerror or exc)
            return
        self.servers.append(server)
        addr = server.sockets[0].getsockname()
        self.addresses[name] = (str(addr[0]), int(addr[1]))
        self.log.info("%s (%s) listening on %s:%d", self.what, name, *self.addresses[name])

    async def unix(self, factory: Callable[[], asyncio.Protocol], path: str, mode: int) -> None:
        try:
            server = await asyncio.get_running_loop().create_unix_server(factory, path)
            os.chmod(path, mode)
        except OSError as exc:
            self.log.error("%s Unix socket not started: cannot bind %s: %s", self.what, path,
                           exc.strerror or exc)
            return
        self.servers.append(server)
        self.log.info("%s listening on Unix socket %s", self.what, path)

    def close(self, unix_path: str = "") -> None:
        for server in self.servers:
            server.close()
        self.servers.clear()
        if unix_path:
            with contextlib.suppress(OSError):
                os.unlink(unix_path)


class Router(Protocol):
    """Where a vhost is served on a node of several workers (``broker.shards.worker.WorkerLink``),
    or by another node of a cluster (the cluster leader's ``broker.cluster.elsewhere``)."""

    # the hand-over carries the client's login to a node that checks it again (a worker is trusted)
    replays_login: bool

    def elsewhere(self, vhost: str) -> bool:
        """Another worker owns ``vhost``; raises ``errors.NotAllowed`` while that worker restarts."""

    def hand_over(self, fd: int, state: dict[str, Any]) -> None:
        """Pass the socket ``fd`` (duplicated by the receiver) and ``state`` to ``state["vhost"]``'s owner."""


def give_away(transport: asyncio.Transport, router: Router, state: dict[str, Any]) -> Relay | None:
    """Hand ``transport``'s connection to the worker of ``state["vhost"]`` (see the module doc):
    None when the socket itself went (``transport`` is aborted, our copy only), else the ``Relay``
    that now carries its bytes. Raises ``OSError``/``ValueError`` when the parent cannot take it."""
    sock = transport.get_extra_info("socket")
    if transport.get_extra_info("ssl_object") is None and sock is not None:
        fd = os.dup(sock.fileno())
        try:
            router.hand_over(fd, state)
        finally:
            os.close(fd)
        transport.abort()
        return None
    ours, theirs = socket.socketpair()
    try:
        router.hand_over(theirs.fileno(), state)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    relay = Relay(transport)
    asyncio.get_running_loop().create_task(relay.start(ours))
    return relay


def hand_off(transport: asyncio.Transport, router: Router, state: dict[str, Any], what: str) -> Relay | None:
    """``give_away`` for a front end, logged as ``what`` (``"MQTT connection from ..."``): the
    ``Relay`` that carries the connection's bytes now, or None (the socket went, or the parent
    could not take it: then the connection is aborted). Either way it is no longer the caller's."""
    vhost = state.get("vhost")
    transport.pause_reading()
    try:
        relay = give_away(transport, router, state)
    except (OSError, ValueError) as exc:
        _log.warning("%s: could not hand it to the worker of vhost %r: %s", what, vhost, exc)
        transport.abort()
        return None
    how = "handed over to" if relay is None else "relayed to"
    _log.debug("%s %s the worker of vhost %r", what, how, vhost)
    return relay


async def take_over(fd: int, factory: Callable[[], asyncio.Protocol]) -> asyncio.Protocol | None:
    """The owner's side: serve the socket ``fd`` another worker handed over with ``factory``'s
    protocol; None when the client went before it was taken."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    proto = factory()
    try:
        await asyncio.get_running_loop().connect_accepted_socket(lambda: proto, sock)
    except OSError:
        sock.close()
        return None
    return proto


class Relay(asyncio.Protocol):
    """The accepting worker's half of a handed-over TLS (or WebSocket) connection: bytes from
    the client go to the owner through a socket pair, the owner's bytes to the client. The
    client's protocol calls ``to_owner`` with what it reads, ``client_gone`` when it closes,
    and pauses or resumes ``owner`` as the client's transport pauses or resumes writing."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client
        self.owner: asyncio.Transport | None = None
        self.early: list[bytes] = []

    async def start(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        await asyncio.get_running_loop().connect_accepted_socket(lambda: self, sock)
        if not self.client.is_closing():
            self.client.resume_reading()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        owner = self.owner = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        for data in self.early:
            owner.write(data)
        self.early = []

    def to_owner(self, data: bytes) -> None:
        if self.owner is None:
            self.early.append(data)
        elif not self.owner.is_closing():
            self.owner.write(data)

    def data_received(self, data: bytes) -> None:
        if not self.client.is_closing():
            self.client.write(data)

    def pause_writing(self) -> None:  # the owner does not read: neither do we, from the client
        if not self.client.is_closing():
            self.client.pause_reading()

    def resume_writing(self) -> None:
        if not self.client.is_closing():
            self.client.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.client.is_closing():
            self.client.close()

    def client_gone(self) -> None:
        if self.owner is not None and not self.owner.is_closing():
            self.owner.close()

    def client_paused(self, paused: bool) -> None:
        """The client's transport stopped (or resumed) taking writes: so does our reading of the owner."""
        if self.owner is not None and not self.owner.is_closing():
            if paused:
                self.owner.pause_reading()
            else:
                self.owner.resume_reading()
