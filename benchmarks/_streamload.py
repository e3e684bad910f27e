"""A fast stream-protocol load generator: a raw asyncio client, so the broker is the bottleneck.

rstream spends more CPU per message than the brokers it measures; this client works per frame,
not per message. The publisher pipelines: it keeps up to ``window`` Publish frames of ``batch``
messages unconfirmed (each message a pre-built entry, only the publishing id packed per
message) and counts PublishConfirm ids. The consumer subscribes from the first offset with a
large initial credit, grants one credit back per Deliver chunk, and counts the chunks' entries
from their headers without decoding them. Protocol numbers are the RabbitMQ Stream protocol's;
no code is shared with the broker's codec, so the two check each other.

Every wait is bounded (``deadline_s``); a response code other than OK raises.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Final

_PUBLISH: Final = 2
_CONFIRM: Final = 3
_PUBLISH_ERROR: Final = 4
_SUBSCRIBE: Final = 7
_DELIVER: Final = 8
_CREDIT: Final = 9
_CREATE: Final = 13
_PEER_PROPERTIES: Final = 17
_SASL_HANDSHAKE: Final = 18
_SASL_AUTHENTICATE: Final = 19
_TUNE: Final = 20
_OPEN: Final = 21
_HEARTBEAT: Final = 23
_DECLARE_PUBLISHER: Final = 1
_RESPONSE: Final = 0x8000
_OK: Final = 1
_STREAM_EXISTS: Final = 5
_HEAD: Final = struct.Struct(">IHH")
_U32: Final = struct.Struct(">I")
_CORR_CODE: Final = struct.Struct(">IH")
_CHUNK_ENTRIES: Final = struct.Struct(">H")  # after sub id, magic, type


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


def _frame(key: int, body: bytes, version: int = 1) -> bytes:
    return _HEAD.pack(len(body) + 4, key, version) + body


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.corr = 0

    async def frame(self) -> tuple[int, bytes]:
        size = _U32.unpack(await self.reader.readexactly(4))[0]
        data = await self.reader.readexactly(size)
        return struct.unpack_from(">H", data)[0], data[4:]

    async def call(self, key: int, body: bytes, ok: tuple[int, ...] = (_OK,)) -> bytes:
        self.corr += 1
        self.writer.write(_frame(key, _U32.pack(self.corr) + body))
        while True:
            k, payload = await self.frame()
            if k == key | _RESPONSE:
                code = _CORR_CODE.unpack_from(payload)[1]
                if code not in ok:
                    raise RuntimeError(f"command {key}: response code {code}")
                return payload[6:]
            if k == _TUNE:
                self.tune(payload)

    def tune(self, payload: bytes) -> None:
        """Agree to the server's frame size, without heartbeats."""
        self.writer.write(_frame(_TUNE, payload[:4] + _U32.pack(0)))


async def connect(port: int, user: str = "guest", password: str = "guest") -> _Conn:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, limit=1 << 24), 30)
    c = _Conn(reader, writer)
    await c.call(_PEER_PROPERTIES, struct.pack(">i", 0))
    await c.call(_SASL_HANDSHAKE, b"")
    await c.call(_SASL_AUTHENTICATE, _s("PLAIN") + struct.pack(">i", len(user) + len(password) + 2)
                 + b"\0" + user.encode() + b"\0" + password.encode())
    while True:  # the server's Tune comes before Open
        key, payload = await c.frame()
        if key == _TUNE:
            c.tune(payload)
            break
    await c.call(_OPEN, _s("/"))
    return c


async def publish(port: int, stream: str, n: int, size: int, batch: int, window: int,
                  deadline_s: float) -> None:
    """Create ``stream`` and publish ``n`` messages of ``size`` bytes; return when all are confirmed."""
    c = await connect(port)
    try:
        await c.call(_CREATE, _s(stream) + struct.pack(">i", 0), ok=(_OK, _STREAM_EXISTS))
        await c.call(_DECLARE_PUBLISHER, b"\x01" + _s("") + _s(stream))
        entry = struct.Struct(">Q" + f"i{size}s")
        body = b"x" * size
        frames = n // batch
        confirmed = 0
        sent = 0
        pid = 0

        def next_frame() -> bytes:
            nonlocal pid
            parts = []
            for _ in range(batch):
                pid += 1
                parts.append(entry.pack(pid, size, body))
            return _frame(_PUBLISH, b"\x01" + struct.pack(">i", batch) + b"".join(parts))

        async def run() -> None:
            nonlocal confirmed, sent
            while sent < min(window, frames):
                c.writer.write(next_frame())
                sent += 1
            while confirmed < frames * batch:
                key, payload = await c.frame()
                if key == _PUBLISH_ERROR:
                    raise RuntimeError("publish error")
                if key != _CONFIRM:
                    continue
                got = struct.unpack_from(">i", payload, 1)[0]
                confirmed += got
                while sent < frames and (sent * batch - confirmed) < window * batch:
                    c.writer.write(next_frame())
                    sent += 1
                await c.writer.drain()

        await asyncio.wait_for(run(), deadline_s)
    finally:
        c.writer.close()


async def consume(port: int, stream: str, n: int, credit: int, deadline_s: float) -> None:
    """Read ``n`` messages of ``stream`` from its first offset."""
    c = await connect(port)
    try:
        await c.call(_SUBSCRIBE, b"\x01" + _s(stream) + struct.pack(">HHi", 1, credit, 0))  # from first

        async def run() -> None:
            got = 0
            while got < n:
                key, payload = await c.frame()
                if key == _DELIVER:
                    got += _CHUNK_ENTRIES.unpack_from(payload, 3)[0]
                    c.writer.write(_frame(_CREDIT, b"\x01\x00\x01"))
                elif key == _HEARTBEAT:
                    c.writer.write(_frame(_HEARTBEAT, b""))

        await asyncio.wait_for(run(), deadline_s)
    finally:
        c.writer.close()
