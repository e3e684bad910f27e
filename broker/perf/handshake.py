"""Client side of the AMQP 0-9-1 connection handshake, sans-IO.

Theory of operation: the client sends the protocol header, then answers each server method in
turn — connection.start with start-ok (PLAIN, ``\\0user\\0password``), connection.tune with
tune-ok (frame_max = the smaller of ours and the server's, heartbeats off: a load generator that
stalls should not be kept alive by a timer) followed at once by connection.open, and finishes on
open-ok. :meth:`Handshake.on_method` takes one decoded method frame and returns the bytes to
send; the IO loop that feeds it lives in ``client.py`` (blocking) or ``counts.py`` (asyncio).
"""

from __future__ import annotations

from broker.perf import codec
from broker.perf.codec import FieldValue, Reader

DEFAULT_FRAME_MAX = 131072


class PerfError(Exception):
    """A failure worth one line on stderr (broker refused, closed, unreachable ...)."""


def close_reason(payload: bytes) -> str:
    """Render a connection.close / channel.close payload as ``CODE TEXT (class.method)``."""
    try:
        r = Reader(payload)
        code = r.short()
        text = r.shortstr()
        cls, meth = r.short(), r.short()
    except codec.CodecError:
        return "(unparseable close)"
    return f"{code} {text} (caused by method {cls}.{meth})"


class Handshake:
    """Drives start -> start-ok -> tune -> tune-ok/open -> open-ok."""

    def __init__(
        self,
        user: str,
        password: str,
        vhost: str,
        *,
        frame_max: int = DEFAULT_FRAME_MAX,
        client_name: str = "skred-perf",
    ) -> None:
        self.user = user
        self.password = password
        self.vhost = vhost
        self.frame_max = frame_max
        self.client_name = client_name
        self.server_properties: dict[str, FieldValue] = {}
        self.done = False
        self._expect = codec.CONNECTION_START

    def initial(self) -> bytes:
        return codec.PROTOCOL_HEADER

    def on_method(self, channel: int, class_id: int, method_id: int, payload: bytes) -> bytes:
        cm = (class_id, method_id)
        if cm == codec.CONNECTION_CLOSE:
            raise PerfError(f"broker closed the connection during the handshake: {close_reason(payload)}")
        if channel != 0 or cm != self._expect:
            raise PerfError(f"unexpected method {class_id}.{method_id} during the handshake")
        r = Reader(payload)
        if cm == codec.CONNECTION_START:
            r.octet(), r.octet()  # protocol version 0.9
            self.server_properties = r.table()
            mechanisms = r.longstr().split()
            if b"PLAIN" not in mechanisms:
                raise PerfError(f"broker does not offer PLAIN authentication: {mechanisms!r}")
            self._expect = codec.CONNECTION_TUNE
            props: dict[str, FieldValue] = {
                "product": self.client_name,
                "capabilities": {"publisher_confirms": True, "consumer_cancel_notify": True},
            }
            return codec.start_ok(self.user, self.password, props)
        if cm == codec.CONNECTION_TUNE:
            channel_max = r.short()
            server_frame_max = r.long()
            r.short()  # server's heartbeat proposal: we answer 0 (off)
            if server_frame_max:
                self.frame_max = min(self.frame_max, server_frame_max)
            self._expect = codec.CONNECTION_OPEN_OK
            return codec.tune_ok(channel_max or 2047, self.frame_max, 0) + codec.connection_open(self.vhost)
        # open-ok
        self.done = True
        return b""

    @property
    def server_version(self) -> str:
        product = self.server_properties.get("product", "?")
        version = self.server_properties.get("version", "?")
        return f"{product!s} {version!s}"
