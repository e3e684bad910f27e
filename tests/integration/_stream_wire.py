"""A raw stream-protocol client over a blocking socket, for what a library hides: credit, bad frames.

Frames are built with the broker's own codec constants but written by hand here (``frame``),
so a test can send anything: a field cut short, a key the server does not know, a size
above the limit. ``handshake`` walks PeerProperties, SASL PLAIN, Tune and Open.
"""

from __future__ import annotations

import socket
import struct
import time

from broker.streamproto import codec as C


def s16(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


def frame(key: int, body: bytes, version: int = 1) -> bytes:
    return struct.pack(">IHH", len(body) + 4, key, version) + body


class StreamWire:
    def __init__(self, host: str, port: int, timeout: float = 5.0, unix_path: str = "") -> None:
        if unix_path:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(unix_path)
        else:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = b""
        self.corr = 0

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next_corr(self) -> int:
        self.corr += 1
        return self.corr

    def read(self, timeout: float = 5.0) -> tuple[int, int, bytes] | None:
        """(key, version, payload) of the next frame; None when the server closed the socket."""
        deadline = time.monotonic() + timeout
        while len(self.buf) < 4 or len(self.buf) < 4 + struct.unpack_from(">I", self.buf)[0]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame from the server")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            except TimeoutError:
                raise TimeoutError("no frame from the server") from None
            if not chunk:
                return None
            self.buf += chunk
        (size,) = struct.unpack_from(">I", self.buf)
        key, version = struct.unpack_from(">HH", self.buf, 4)
        payload = self.buf[8 : 4 + size]
        self.buf = self.buf[4 + size :]
        return key, version, payload

    def expect(self, key: int, timeout: float = 5.0) -> bytes:
        """The payload of the next frame with ``key`` (heartbeats skipped)."""
        while True:
            got = self.read(timeout)
            assert got is not None, f"server closed the connection waiting for key {key:#x}"
            if got[0] == C.HEARTBEAT:
                continue
            assert got[0] == key, f"expected key {key:#x}, got {got[0]:#x} {got[2]!r}"
            return got[2]

    def request(self, key: int, body: bytes) -> int:
        """Send a command with a fresh correlation id; the response code."""
        corr = self.next_corr()
        self.send(frame(key, struct.pack(">I", corr) + body))
        payload = self.expect(key | C.RESPONSE)
        assert struct.unpack_from(">I", payload)[0] == corr
        return int(struct.unpack_from(">H", payload, 4)[0])

    def handshake(self, user: str = "guest", password: str = "guest", vhost: str = "/",
                  properties: dict[str, str] | None = None) -> int:
        """Up to Open; the Open's response code (or the SaslAuthenticate's when it failed)."""
        props = properties or {}
        body = struct.pack(">i", len(props)) + b"".join(s16(k) + s16(v) for k, v in props.items())
        assert self.request(C.PEER_PROPERTIES, body) == C.OK
        assert self.request(C.SASL_HANDSHAKE, b"") == C.OK
        auth = b"\0" + user.encode() + b"\0" + password.encode()
        code = self.request(C.SASL_AUTHENTICATE, s16("PLAIN") + struct.pack(">i", len(auth)) + auth)
        if code != C.OK:
            return code
        tune = self.expect(C.TUNE)
        self.send(frame(C.TUNE, tune))
        return self.request(C.OPEN, s16(vhost))

    def close(self) -> None:
        self.sock.close()
