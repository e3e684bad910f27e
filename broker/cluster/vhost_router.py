"""An AMQP listener that carries each connection to its vhost's owner (``vhost_route.py``).

Theory of operation
-------------------
Per-shard data path, routing half (``[clustering] shard_leaders``; docs/architecture.md,
*Per-shard leaders*): a node accepts an AMQP client, plays the handshake up to
``connection.open`` (``OpenReader``), asks ``leg(vhost, client address)`` for a connection to
the node that serves the vhost (in a cluster, the same address-preserving tunnel a follower's
proxy opens to the leader; None: nobody serves it now), replays the handshake there
(``Replay``) and splices the two sockets with the tunnels' ``pump``. From ``open-ok`` on the
router is only a pipe: flow control is TCP's, and a connection closed at either end closes
the other. Until then every step is bounded (``HANDSHAKE_TIMEOUT``, ``MAX_INPUT``); a client
that cannot be routed is told so in AMQP (``connection.close`` 320), never just dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from broker.cluster.tunnel import CHUNK, pump
from broker.cluster.vhost_route import (
    HANDSHAKE_TIMEOUT,
    Failed,
    Limits,
    Opened,
    OpenReader,
    Replay,
    refusal,
)

log = logging.getLogger(__name__)

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Leg = Callable[[str, tuple[str, int]], Awaitable[Streams | None]]


class VhostRouter:
    def __init__(self, limits: Limits, server_properties: dict[str, Any], leg: Leg) -> None:
        self.limits = limits
        self.server_properties = server_properties
        self.leg = leg
        self.routed = 0  # connections carried to an owner (tests, status)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, bind: str, port: int) -> int:
        """Listen; returns the port bound (``port`` 0: any free one)."""
        self._server = await asyncio.start_server(self._handle, bind, port, reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.close()

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self._writers.add(cwriter)
        owner: asyncio.StreamWriter | None = None
        try:
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                    legs = await self._route(creader, cwriter)
            except TimeoutError:
                log.info("AMQP client %s: no route within %.0fs", _peer(cwriter), HANDSHAKE_TIMEOUT)
                return
            except Failed as exc:
                log.info("AMQP client %s not routed: %s", _peer(cwriter), exc)
                if exc.answer:
                    cwriter.write(exc.answer)
                    with contextlib.suppress(OSError, RuntimeError):
                        await cwriter.drain()
                return
            if legs is None:
                return
            oreader, owner = legs
            self._writers.add(owner)
            self.routed += 1
            await asyncio.gather(pump(creader, owner), pump(oreader, cwriter))
        except (OSError, RuntimeError) as exc:
            log.debug("routed AMQP connection ended: %s", exc)
        finally:
            for w in (cwriter, owner):
                if w is not None:
                    self._writers.discard(w)
                    w.close()

    async def _route(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> Streams | None:
        """The handshake both ways; the owner's streams, spliced from here on (None: the client left)."""
        opened = await read_open(creader, cwriter, self.limits, self.server_properties)
        if opened is None:
            return None
        legs = await self.leg(opened.vhost, _peer(cwriter))
        if legs is None:
            raise Failed(f"no node serves vhost {opened.vhost!r}",
                         refusal(f"no node serves vhost '{opened.vhost}' yet"))
        oreader, owriter = legs
        try:
            cwriter.write(await replay(opened, lambda: oreader.read(CHUNK), owriter.write))
        except BaseException:
            owriter.close()
            raise
        return oreader, owriter


async def read_open(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter, limits: Limits,
                    server_properties: dict[str, Any]) -> Opened | None:
    """The client's handshake up to connection.open (None: it left first; ``Failed``: bad input)."""
    reader = OpenReader(limits, server_properties)
    while reader.opened is None:
        data = await creader.read(CHUNK)
        if not data:
            return None
        out = reader.receive(data)
        if out:
            cwriter.write(out)
    return reader.opened


async def replay(opened: Opened, read: Callable[[], Awaitable[bytes]],
                 write: Callable[[bytes], None]) -> bytes:
    """Play ``opened`` to the owner (``read`` its bytes, b"" at its end; ``write`` to it); returns
    the owner's bytes for the client once spliced (``Failed``: not routed, with the 320 to send)."""
    rep = Replay(opened)
    write(rep.start())
    while not rep.spliced:
        data = await read()
        if not data:
            raise Failed("the vhost's node closed during the handshake",
                         refusal("the vhost's node closed the connection"))
        out = rep.receive(data)
        if out:
            write(out)
    return rep.to_client


def _peer(writer: asyncio.StreamWriter) -> tuple[str, int]:
    peer = writer.get_extra_info("peername")
    return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else ("", 0)
