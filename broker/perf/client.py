"""A minimal blocking AMQP 0-9-1 client: one TCP connection, channel 1, raw sockets.

Theory of operation: every byte received goes through one reusable buffer (``recv_into`` after
the unconsumed tail) and one :class:`FrameScanner`, which counts the hot frames (deliveries,
confirms) itself and queues every other method frame in ``scanner.other``. Synchronous calls
(:meth:`Client.rpc`) send a method and read until its reply shows up in that queue; a
channel.close or connection.close there becomes a :class:`PerfError` carrying the broker's reply
code and text. Load loops (``workers.py``) use :meth:`Client.pump` the same way, so asynchronous
methods such as basic.cancel or channel.flow are handled in one place (:meth:`Client.handle_other`).
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from broker.perf import codec
from broker.perf.handshake import DEFAULT_FRAME_MAX, Handshake, PerfError, close_reason
from broker.perf.scanner import FrameScanner

CHANNEL = 1
BUFFER_SIZE = 4 * 1024 * 1024
# Compact the buffer when less than this is free after the unconsumed tail: must exceed any
# frame we accept (frame_max is at most DEFAULT_FRAME_MAX) so a partial frame can complete.
MIN_ROOM = 4 * DEFAULT_FRAME_MAX


@dataclass(frozen=True)
class AmqpUri:
    host: str
    port: int
    user: str
    password: str
    vhost: str
    tls: bool = False  # amqps://
    cafile: str = ""  # ?cacertfile=PATH (RabbitMQ's URI query parameter)
    verify: bool = True  # ?verify=verify_none turns certificate checks off

    @classmethod
    def parse(cls, uri: str) -> AmqpUri:
        parts = urlsplit(uri)
        if parts.scheme not in ("amqp", "amqps"):
            raise PerfError(f"only amqp:// and amqps:// URIs are supported, got {uri!r}")
        path = parts.path
        vhost = "/" if path in ("", "/") else unquote(path[1:])
        query = parse_qs(parts.query)
        tls = parts.scheme == "amqps"
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or (5671 if tls else 5672),
            user=unquote(parts.username or "guest"),
            password=unquote(parts.password or "guest"),
            vhost=vhost,
            tls=tls,
            cafile=query.get("cacertfile", [""])[0],
            verify=query.get("verify", ["verify_peer"])[0] != "verify_none",
        )

    def wrap(self, sock: socket.socket) -> socket.socket:
        """The socket as the URI wants it: TLS for amqps://."""
        if not self.tls:
            return sock
        ctx = ssl.create_default_context(cafile=self.cafile or None)
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        try:
            return ctx.wrap_socket(sock, server_hostname=self.host)
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise PerfError(f"TLS handshake with {self.host}:{self.port} failed: {exc}") from exc


SEND_TIMEOUT = 30.0  # seconds a write may block before the run fails


class ConsumerCancelled(PerfError):
    """The broker cancelled our consumer (basic.cancel), e.g. because the queue was deleted."""


class Client:
    """One connection with channel 1 open."""

    def __init__(self, uri: AmqpUri, *, timeout: float = 15.0, name: str = "skred-perf") -> None:
        self.uri = uri
        self.buf = bytearray(BUFFER_SIZE)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.scanner = FrameScanner()
        self.blocked = False
        self.closed = False
        try:
            self.sock = socket.create_connection((uri.host, uri.port), timeout=timeout)
        except OSError as exc:
            raise PerfError(f"cannot connect to {uri.host}:{uri.port}: {exc}") from exc
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = uri.wrap(self.sock)
        deadline = time.monotonic() + timeout
        hs = Handshake(uri.user, uri.password, uri.vhost, client_name=name)
        self.sock.sendall(hs.initial())
        while not hs.done:
            if not self.other_pending():
                self._read(deadline)
                if self.end - self.start >= 4 and self.buf[self.start : self.start + 4] == b"AMQP":
                    raise PerfError("broker rejected the protocol version (replied with its own header)")
                self._scan()
                continue
            out = hs.on_method(*self.scanner.other.pop(0))
            if out:
                self.sock.sendall(out)
        self.frame_max = hs.frame_max
        self.server_properties = hs.server_properties
        self.server_version = hs.server_version
        self.rpc(codec.channel_open(CHANNEL), codec.CHANNEL_OPEN_OK, timeout=timeout)

    # --- reading --------------------------------------------------------------------------

    def other_pending(self) -> bool:
        return bool(self.scanner.other)

    def _read(self, deadline: float | None) -> bool:
        """One recv into the buffer; False on timeout. Raises if the peer closed the socket."""
        if self.end == len(self.buf):
            raise PerfError("a frame larger than the receive buffer (broker ignored frame_max?)")
        if deadline is not None:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            n = self.sock.recv_into(self.view[self.end :])
        except TimeoutError:
            return False
        except OSError as exc:
            raise PerfError(f"connection lost: {exc}") from exc
        if n == 0:
            self.closed = True
            raise PerfError("broker closed the TCP connection")
        self.end += n
        return True

    def _scan(self, now_ns: int = 0) -> None:
        start = self.scanner.scan(self.buf, self.start, self.end, now_ns)
        end = self.end
        if start == end:
            self.start = self.end = 0
        elif len(self.buf) - end < MIN_ROOM:
            tail = end - start
            self.view[:tail] = self.view[start:end]
            self.start, self.end = 0, tail
        else:
            self.start = start

    def pump(self, timeout: float | None, now_ns: bool = False) -> bool:
        """Read and scan once (waiting up to ``timeout``); handle slow-path frames.

        With ``now_ns`` the receive time is passed to the scanner for latency samples.
        Returns False when nothing arrived in time.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._read(deadline):
            return False
        self._scan(time.monotonic_ns() if now_ns else 0)
        while self.scanner.other:
            self.handle_other(*self.scanner.other.pop(0))
        return True

    def handle_other(self, channel: int, class_id: int, method_id: int, payload: bytes) -> None:
        cm = (class_id, method_id)
        if cm == codec.CONNECTION_CLOSE:
            self._send_quietly(codec.connection_close_ok())
            self.closed = True
            raise PerfError(f"broker closed the connection: {close_reason(payload)}")
        if cm == codec.CHANNEL_CLOSE:
            self._send_quietly(codec.channel_close_ok(channel))
            raise PerfError(f"broker closed the channel: {close_reason(payload)}")
        if cm == codec.BASIC_CANCEL:
            raise ConsumerCancelled("broker cancelled the consumer (queue deleted?)")
        if cm == codec.CHANNEL_FLOW:
            active = bool(payload[0] & 1) if payload else True
            self.sock.sendall(codec.channel_flow_ok(channel, active))
        elif cm == codec.CONNECTION_BLOCKED:
            self.blocked = True
        elif cm == codec.CONNECTION_UNBLOCKED:
            self.blocked = False
        # Anything else (late replies, basic.return) is not ours to act on.

    # --- synchronous calls ----------------------------------------------------------------

    def rpc(self, data: bytes, expect: tuple[int, int], *, timeout: float = 30.0) -> bytes:
        """Send ``data`` and return the payload (after class/method) of the expected reply."""
        self.sock.sendall(data)
        return self.wait_for(expect, timeout=timeout)

    def wait_for(self, expect: tuple[int, int], *, timeout: float = 30.0) -> bytes:
        deadline = time.monotonic() + timeout
        other = self.scanner.other
        while True:
            while other:
                channel, cls, meth, payload = other.pop(0)
                if (cls, meth) == expect:
                    return payload
                self.handle_other(channel, cls, meth, payload)
            if time.monotonic() >= deadline:
                raise PerfError(f"no reply {expect[0]}.{expect[1]} within {timeout:g} s")
            if self._read(deadline):
                self._scan()

    def send(self, data: bytes | memoryview) -> None:
        # _read leaves whatever timeout its deadline needed (down to 1 ms): a write that has to
        # wait for a slow broker (TLS records, flow control) gets the full send timeout instead.
        self.sock.settimeout(SEND_TIMEOUT)
        self.sock.sendall(data)

    def _send_quietly(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass

    def close(self, timeout: float = 2.0) -> None:
        """Polite close (connection.close, wait briefly for close-ok), then drop the socket."""
        if not self.closed:
            try:
                self.sock.sendall(codec.connection_close())
                deadline = time.monotonic() + timeout
                other = self.scanner.other
                while time.monotonic() < deadline:
                    while other:
                        if other.pop(0)[1:3] in (codec.CONNECTION_CLOSE_OK, codec.CONNECTION_CLOSE):
                            deadline = 0.0
                            break
                    if deadline and self._read(deadline):
                        try:
                            self._scan()
                        except codec.CodecError:
                            break
            except (OSError, PerfError):
                pass
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
