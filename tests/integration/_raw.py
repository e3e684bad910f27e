"""A tiny raw-socket AMQP 0-9-1 client for tests that must see the wire.

Theory of operation: an AMQP frame is ``type:u8 channel:u16 size:u32 payload
frame-end(0xCE)``. ``RawConn`` reads whole frames from a blocking socket with a
timeout and hands back ``(type, channel, payload)`` so tests can compare raw
bytes (e.g. content-header property bytes) or decode method frames with pamqp.
It speaks just enough of connection negotiation (start/start-ok PLAIN,
tune/tune-ok, open/open-ok) to reach a usable channel, and lets a test inject
arbitrary bytes afterwards. Nothing here is clever: it exists so bad-input and
byte-exactness tests do not depend on a client library's own validation.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

from pamqp import commands
from pamqp import frame as pframe
from pamqp.base import Frame
from pamqp.header import ContentHeader

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
_FRAME_HEAD = struct.Struct(">BHI")


class Closed(Exception):
    """The peer closed the socket (EOF or reset) before a whole frame arrived."""


class NoAnswer(AssertionError):
    """The peer neither answered nor closed within the deadline."""


def frame_bytes(ftype: int, channel: int, payload: bytes, end: int = FRAME_END) -> bytes:
    return _FRAME_HEAD.pack(ftype, channel, len(payload)) + payload + bytes([end])


def method_bytes(channel: int, method: Frame) -> bytes:
    return pframe.marshal(method, channel)


def header_payload(body_size: int, props: commands.Basic.Properties) -> bytes:
    """Payload of a content-header frame (class 60, weight 0, size, flags+props)."""
    raw = pframe.marshal(ContentHeader(0, body_size, props), 1)
    return raw[7:-1]


class RawConn:
    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self._buf = b""
        self.frame_max = 0
        self.channel_max = 0
        self.heartbeat = 0

    # -- bytes ---------------------------------------------------------------
    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_method(self, channel: int, method: Frame) -> None:
        self.send(method_bytes(channel, method))

    def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise Closed(str(exc)) from exc
            if not chunk:
                raise Closed("EOF")
            self._buf += chunk

    def read_exact(self, n: int) -> bytes:
        self._fill(n)
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def read_frame(self) -> tuple[int, int, bytes]:
        """Next whole frame as (type, channel, payload); checks the frame-end octet."""
        self._fill(7)
        ftype, channel, size = _FRAME_HEAD.unpack_from(self._buf)
        self._fill(7 + size + 1)
        payload = self._buf[7 : 7 + size]
        end = self._buf[7 + size]
        self._buf = self._buf[8 + size :]
        assert end == FRAME_END, f"server sent bad frame-end {end:#x}"
        return ftype, channel, payload

    def read_method(self, skip_heartbeats: bool = True) -> tuple[int, Frame]:
        while True:
            ftype, channel, payload = self.read_frame()
            if ftype == FRAME_HEARTBEAT and skip_heartbeats:
                continue
            assert ftype == FRAME_METHOD, f"expected a method frame, got type {ftype}"
            _, ch, value = pframe.unmarshal(frame_bytes(ftype, channel, payload))
            assert isinstance(value, Frame)
            return ch, value

    def expect(self, cls: type[Frame], channel: int | None = None) -> Any:
        ch, m = self.read_method()
        assert isinstance(m, cls), f"expected {cls.__name__}, got {m!r}"
        if channel is not None:
            assert ch == channel
        return m

    # -- negotiation ---------------------------------------------------------
    def handshake(
        self,
        user: str = "guest",
        password: str = "guest",
        vhost: str = "/",
        frame_max: int | None = None,
        channel_max: int | None = None,
        heartbeat: int = 0,
        capabilities: dict[str, Any] | None = None,
    ) -> None:
        """Negotiate up to open-ok; None for frame_max/channel_max means 'accept the server's'."""
        self.send(PROTOCOL_HEADER)
        self.expect(commands.Connection.Start, 0)
        props: dict[str, Any] = {"product": "skred-raw-test"}
        if capabilities:
            props["capabilities"] = capabilities
        self.send_method(
            0,
            commands.Connection.StartOk(
                client_properties=props,
                mechanism="PLAIN",
                response=f"\0{user}\0{password}",
                locale="en_US",
            ),
        )
        tune = self.expect(commands.Connection.Tune, 0)
        self.frame_max = tune.frame_max if frame_max is None else frame_max
        self.channel_max = tune.channel_max if channel_max is None else channel_max
        self.heartbeat = heartbeat
        self.send_method(0, commands.Connection.TuneOk(self.channel_max, self.frame_max, heartbeat))
        self.send_method(0, commands.Connection.Open(virtual_host=vhost))
        self.expect(commands.Connection.OpenOk, 0)

    def open_channel(self, channel: int = 1) -> None:
        self.send_method(channel, commands.Channel.Open())
        self.expect(commands.Channel.OpenOk, channel)

    def publish(
        self,
        channel: int,
        exchange: str,
        routing_key: str,
        body: bytes,
        props: commands.Basic.Properties | None = None,
        raw_header_payload: bytes | None = None,
    ) -> None:
        hp = raw_header_payload or header_payload(len(body), props or commands.Basic.Properties())
        out = method_bytes(channel, commands.Basic.Publish(exchange=exchange, routing_key=routing_key))
        out += frame_bytes(FRAME_HEADER, channel, hp)
        chunk = (self.frame_max or 131072) - 8
        for i in range(0, len(body), chunk):
            out += frame_bytes(FRAME_BODY, channel, body[i : i + chunk])
        self.send(out)

    def read_content(self) -> tuple[bytes, bytes, list[int]]:
        """After a deliver/get-ok: (raw header payload, body, sizes of body frames)."""
        ftype, _, hp = self.read_frame()
        assert ftype == FRAME_HEADER, f"expected content header, got frame type {ftype}"
        ch = pframe.unmarshal(frame_bytes(ftype, 1, hp))[2]
        assert isinstance(ch, ContentHeader)
        body = b""
        sizes: list[int] = []
        while len(body) < ch.body_size:
            ftype, _, part = self.read_frame()
            assert ftype == FRAME_BODY, f"expected body frame, got type {ftype}"
            sizes.append(len(part) + 8)
            body += part
        assert len(body) == ch.body_size
        return hp, body, sizes

    def wait_connection_close(self, timeout: float = 5.0) -> tuple[int, str] | None:
        """Read until connection.close (returns code, text; replies close-ok) or EOF (None).

        Frames that arrive before the close (heartbeats, channel traffic) are skipped.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                ftype, channel, payload = self.read_frame()
            except TimeoutError:
                break
            except (Closed, OSError):
                return None
            if ftype != FRAME_METHOD:
                continue
            try:
                _, _, m = pframe.unmarshal(frame_bytes(ftype, channel, payload))
            except Exception:  # noqa: BLE001 - a method pamqp cannot decode is skipped
                continue
            if isinstance(m, commands.Connection.Close):
                try:
                    self.send_method(0, commands.Connection.CloseOk())
                except OSError:
                    pass
                return int(m.reply_code or 0), str(m.reply_text)
        raise NoAnswer(f"neither connection.close nor EOF within {timeout}s")

    def wait_eof(self, timeout: float = 5.0) -> bool:
        """True when the server closes the socket within the timeout (data is discarded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.sock.settimeout(max(0.05, deadline - time.monotonic()))
                if not self.sock.recv(65536):
                    return True
            except TimeoutError:
                return False
            except OSError:
                return True
        return False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
