"""AMQP 0-9-1 and MQTT over WebSocket on the management port, LavinMQ's way.

Theory of operation
-------------------
A request that asks to upgrade to WebSocket (on any path) is served here instead of by the API
or the UI. The protocol is chosen by ``Sec-WebSocket-Protocol`` (``mqtt``, ``mqttv3.1``: MQTT;
``amqp``, ``amqpv0-9-1``: AMQP), or by the path when the client names none (``/mqtt`` and
``/ws/mqtt`` mean MQTT, anything else AMQP). The byte stream of the chosen protocol runs
unchanged inside binary WebSocket messages: ``WSTransport`` is an ``asyncio.Transport`` over the
WebSocket, so the very protocol objects of the TCP listeners (handed in by the node as factories,
since this layer never imports ``net`` or ``mqtt``) serve it, with their own authentication,
permissions, limits and timeouts. Nothing is reachable here that the protocol's own port does
not check.

Flow control both ways: the transport's write buffer has a high-water mark; past it the protocol
is paused (``pause_writing``) until the sender task has sent enough; and a protocol that pauses
reading stops the message loop, so a client that floods waits in its own TCP window. A text
message, or a binary one larger than the protocol's packet limit, closes the WebSocket.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import WSMsgType, web

log = logging.getLogger(__name__)

Peer = tuple[str, int]
ProtocolFactory = Callable[[Peer], asyncio.Protocol]

MQTT_SUBPROTOCOLS = ("mqtt", "mqttv3.1")
AMQP_SUBPROTOCOLS = ("amqp", "amqpv0-9-1")
MQTT_PATHS = ("/mqtt", "/ws/mqtt")
_HIGH = 1 << 20  # bytes queued for the client before the protocol is asked to pause
_LOW = 1 << 18


def wants_websocket(request: web.Request) -> bool:
    return request.method == "GET" and "websocket" in request.headers.get("Upgrade", "").lower()


def choose(request: web.Request, offered: dict[str, ProtocolFactory]) -> str | None:
    """The protocol a WebSocket request asks for: by subprotocol, else by path."""
    header = request.headers.get("Sec-WebSocket-Protocol", "")
    asked = [p.strip().lower() for p in header.split(",") if p.strip()]
    for p in asked:
        if p in MQTT_SUBPROTOCOLS and "mqtt" in offered:
            return "mqtt"
        if p in AMQP_SUBPROTOCOLS and "amqp" in offered:
            return "amqp"
    if asked:
        return None  # it asked for something we do not speak
    kind = "mqtt" if request.path in MQTT_PATHS else "amqp"
    return kind if kind in offered else None


class WSTransport(asyncio.Transport):
    """The transport a stream protocol writes to; a sender task moves its bytes to the socket."""

    def __init__(self, ws: web.WebSocketResponse, peer: Peer, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self._ws = ws
        self._peer = peer
        self._protocol = protocol
        self._out: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._high, self._low = _HIGH, _LOW
        self._closing = False
        self._paused = False  # the protocol was asked to stop writing
        self._wake = asyncio.Event()
        self.reading = asyncio.Event()
        self.reading.set()

    # -------------------------------------------------------------- asyncio.Transport
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        self._out.append(bytes(data))
        self._size += len(data)
        self._wake.set()
        if self._size > self._high and not self._paused:
            self._paused = True
            self._protocol.pause_writing()

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self.reading.set()

    def abort(self) -> None:
        self._out.clear()
        self._size = 0
        self.close()

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peer
        return default

    def pause_reading(self) -> None:
        self.reading.clear()

    def resume_reading(self) -> None:
        self.reading.set()

    def is_reading(self) -> bool:
        return self.reading.is_set()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is not None:
            self._high = high
            self._low = low if low is not None else high // 4

    def get_write_buffer_size(self) -> int:
        return self._size

    # -------------------------------------------------------------- sender
    async def send_loop(self) -> None:
        ws = self._ws
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._out:
                chunk = b"".join(self._out)
                self._out.clear()
                try:
                    await ws.send_bytes(chunk)
                except (ConnectionError, RuntimeError):
                    self._closing = True
                    self._out.clear()
                self._size = max(0, self._size - len(chunk))
                if self._paused and self._size <= self._low:
                    self._paused = False
                    self._protocol.resume_writing()
            if self._closing:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await ws.close()
                return


async def serve(request: web.Request, kind: str, factory: ProtocolFactory,
                max_message: int) -> web.StreamResponse:
    """Serve one WebSocket connection with the stream protocol ``factory`` makes."""
    ws = web.WebSocketResponse(protocols=MQTT_SUBPROTOCOLS if kind == "mqtt" else AMQP_SUBPROTOCOLS,
                               max_msg_size=max_message, autoping=True)
    await ws.prepare(request)
    peer_info = request.transport.get_extra_info("peername") if request.transport else None
    peer: Peer = (str(peer_info[0]), int(peer_info[1])) if peer_info else (request.remote or "", 0)
    protocol = factory(peer)
    transport = WSTransport(ws, peer, protocol)
    sender = asyncio.get_running_loop().create_task(transport.send_loop())
    protocol.connection_made(transport)
    error: Exception | None = None
    try:
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                await transport.reading.wait()
                if transport.is_closing():
                    break
                protocol.data_received(msg.data)
            elif msg.type == WSMsgType.TEXT:
                log.warning("%s over WebSocket from %s: a text message: closing", kind.upper(), peer[0])
                break
            else:
                break
            if transport.is_closing():
                break
    except Exception as exc:  # noqa: BLE001 - the connection's end, reported to the protocol
        error = exc
    finally:
        transport.close()
        protocol.connection_lost(error)
        try:
            async with asyncio.timeout(5):
                await sender
        except (TimeoutError, asyncio.CancelledError):
            sender.cancel()
    return ws
