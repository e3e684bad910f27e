"""asyncio pieces the front ends share (the management listener in ``net``, LMQ's HTTP API)."""

from __future__ import annotations

import asyncio
import re
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
