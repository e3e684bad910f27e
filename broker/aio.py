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

    def connection_made(self, transport: Any) -> None:  # a transport, or one wrapping it
        self.plain = transport.get_extra_info("sslcontext") is None
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self.inner.eof_received()
        return True if self.plain else result

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()
