"""The asyncio halves of routing AMQP by vhost (``vhost_route.py`` is the sans-IO machines).

Theory of operation
-------------------
Per-shard data path, routing half (``[clustering] shard_leaders``; docs/architecture.md,
*Per-shard leaders*): ``read_login`` plays the handshake with the client up to its
``start-ok`` (``OpenReader``); the caller opens a leg to the node expected to serve (a
follower's proxy: the same address-preserving tunnel it opens to the leader, ``proxy.py``
``Routed``) and ``login`` plays the client's ``start-ok`` there (``Replay``): a refusal goes to
the client as that node said it, before any tune, as from a node reached directly. Admitted,
``read_open`` reads on to ``connection.open``; on the same leg if that node serves the vhost
(``Replay.finish``), else ``replay`` plays the whole handshake on a leg to the one that does;
what the node answered goes to the client, then the caller splices the two.
The caller bounds the steps in time (``HANDSHAKE_TIMEOUT``); ``MAX_INPUT`` bounds the bytes,
and a client that cannot be routed is told so in AMQP (``connection.close`` 320).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from broker.cluster.tunnel import CHUNK
from broker.cluster.vhost_route import (
    Failed,
    Opened,
    OpenReader,
    Replay,
    refusal,
)


async def _read_client(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter, reader: OpenReader,
                       done: Callable[[], bool]) -> bool:
    """Feed the client's bytes to ``reader`` until ``done()`` (False: the client left first)."""
    while not done():
        data = await creader.read(CHUNK)
        if not data:
            return False
        out = reader.receive(data)
        if out:
            cwriter.write(out)
    return True


async def read_login(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter,
                     reader: OpenReader) -> bytes | None:
    """The client's handshake up to start-ok, which is returned (None: it left first; ``Failed``:
    bad input)."""
    if not await _read_client(creader, cwriter, reader, lambda: reader.login is not None):
        return None
    return reader.login


async def read_open(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter,
                    reader: OpenReader) -> Opened | None:
    """After ``reader.admit()``: the client's handshake up to connection.open (None: it left)."""
    if not await _read_client(creader, cwriter, reader, lambda: reader.opened is not None):
        return None
    return reader.opened


async def login(start_ok: bytes, read: Callable[[], Awaitable[bytes]],
                write: Callable[[bytes], None]) -> Replay:
    """Play the client's login to a serving node (``read`` its bytes, b"" at its end; ``write``
    to it) until it admits it (``Replay.admitted``) or refuses it (``Replay.spliced``, its
    answer in ``to_client``); ``Failed``: not routed, with the 320 to send."""
    rep = Replay(start_ok)
    write(rep.start())
    while not (rep.admitted or rep.spliced):
        data = await read()
        if not data:
            raise Failed("the vhost's node closed during the handshake",
                         refusal("the vhost's node closed the connection"))
        out = rep.receive(data)
        if out:
            write(out)
    return rep


async def replay(opened: Opened, read: Callable[[], Awaitable[bytes]],
                 write: Callable[[bytes], None]) -> bytes:
    """Play ``opened`` whole to a serving node; returns the node's bytes for the client once
    spliced (``Failed``: not routed, with the 320 to send)."""
    rep = await login(opened.start_ok, read, write)
    if not rep.spliced:
        write(rep.finish(opened))
    return rep.to_client
