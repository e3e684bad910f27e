"""The asyncio halves of routing AMQP by vhost (``vhost_route.py`` is the sans-IO machines).

Theory of operation
-------------------
Per-shard data path, routing half (``[clustering] shard_leaders``; docs/architecture.md,
*Per-shard leaders*): ``read_open`` plays the handshake with the client up to
``connection.open`` (``OpenReader``); the caller finds the node serving the vhost and opens a
leg there (a follower's proxy: the same address-preserving tunnel it opens to the leader,
``proxy.py`` ``Routed``); ``replay`` plays the client's own frames on that leg (``Replay``) and
returns what the owner answered after them, for the client; then the caller splices the two.
The caller bounds both steps in time (``HANDSHAKE_TIMEOUT``); ``MAX_INPUT`` bounds the bytes,
and a client that cannot be routed is told so in AMQP (``connection.close`` 320).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from broker.cluster.tunnel import CHUNK
from broker.cluster.vhost_route import (
    Failed,
    Limits,
    Opened,
    OpenReader,
    Replay,
    refusal,
)


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
