"""asyncio pieces the front ends share (the management listener in ``net``, LMQ's HTTP API, the
stream protocol's listeners)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import ssl
from collections.abc import Callable
from typing import Any, Final

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
                  ctx: ssl.SSLContext | None = None) -> None:
        try:
            server = await asyncio.get_running_loop().create_server(factory, bind, port, ssl=ctx,
                                                                    reuse_address=True)
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
