"""What a follower's proxy answers when there is no leader to splice a client to, sans-IO.

Theory of operation
-------------------
A follower's proxy splices each client to the leader. When there is none (the
leader died and its key has not expired yet, no election won yet, the leader
unreachable), closing the socket at once tells a client nothing: pika reports
``IncompatibleProtocolError`` and people go looking for a version mismatch. So
the proxy answers in the client's own protocol, then closes:

* AMQP (``AmqpRefusal``): the whole handshake as a broker does it —
  ``connection.start``, ``connection.tune`` after ``start-ok``, and after
  ``connection.open`` a ``connection.close`` with 320 ``CONNECTION_FORCED``
  (the spec's "the client may retry at some later date") and a text saying
  there is no leader; done once the client's ``close-ok`` (or its own close)
  came. Closing after ``open`` rather than before lets every client report it
  as the broker closing the connection with that code and text (pika:
  ``ProbableAccessDeniedError`` carrying ``ConnectionClosedByBroker(320, ...)``;
  a close right after ``start-ok`` reads as a failed login there). No
  credential is checked and nothing is granted: the only method answered after
  ``open`` is the close.
* HTTP (management API, LMQ HTTP): ``503 Service Unavailable`` with
  ``Retry-After`` and a RabbitMQ-style JSON body ``{"error", "reason"}``, sent
  once the request head has come.
* MQTT (``mqtt_connack``): once the CONNECT's protocol level has come, a
  CONNACK refusing it, "server unavailable" (3.1/3.1.1 return code 3, MQTT 5
  reason ``0x88``), which every client reports as the broker's answer and
  retries on.

Both are bounded: the driver (``broker.cluster.proxy``) gives each refusal
``ANSWER_TIMEOUT`` seconds in all and reads at most ``MAX_INPUT`` bytes; a
client that sends more, or anything malformed, is simply closed.
"""

from __future__ import annotations

import json
from typing import Final

from pamqp import commands, constants, exceptions, frame, header, heartbeat

REPLY_CODE: Final = 320  # CONNECTION_FORCED: the client may retry later
ANSWER_TIMEOUT: Final = 10.0  # seconds a refused client is given to read its answer
MAX_INPUT: Final = 64 * 1024  # bytes read from a refused client, at most
PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"
_FRAME_MAX: Final = 131072


def amqp_text(why: str) -> str:
    # A short string on the wire: at most 255 bytes.
    return f"CONNECTION_FORCED - {why}".encode()[:255].decode(errors="ignore")


class AmqpRefusal:
    """Feed it the client's bytes; it returns the bytes to send back, and says when it is ``done``."""

    def __init__(self, why: str) -> None:
        self.text = amqp_text(why)
        self.done = False
        self._buf = b""
        self._started = False
        self._closing = False

    def receive(self, data: bytes) -> bytes:
        if self.done:
            return b""
        self._buf += data
        if len(self._buf) > MAX_INPUT:
            self.done = True
            return b""
        if not self._started:
            if len(self._buf) < len(PROTOCOL_HEADER):
                if not PROTOCOL_HEADER.startswith(self._buf):
                    return self._wrong_protocol()
                return b""
            if not self._buf.startswith(PROTOCOL_HEADER):
                return self._wrong_protocol()
            self._buf = self._buf[len(PROTOCOL_HEADER):]
            self._started = True
            out = frame.marshal(commands.Connection.Start(
                server_properties={"product": "Skred", "information": self.text},
                mechanisms="PLAIN AMQPLAIN", locales="en_US"), 0)
            return out + self._frames()
        return self._frames()

    def _wrong_protocol(self) -> bytes:
        self.done = True  # spec 4.2.2: answer with the protocol we speak, then close
        return PROTOCOL_HEADER

    def _frames(self) -> bytes:
        out = b""
        while self._buf and not self.done:
            try:
                used, _channel, value = frame.unmarshal(self._buf)
            except exceptions.UnmarshalingException:
                if len(self._buf) >= constants.FRAME_HEADER_SIZE and \
                        int.from_bytes(self._buf[3:7], "big") > MAX_INPUT:
                    self.done = True  # a frame larger than we will read
                break  # a frame not complete yet (or garbage: the timeout ends it)
            except (ValueError, KeyError, IndexError):
                self.done = True
                break
            self._buf = self._buf[used:]
            out += self._on(value)
        return out

    def _on(self, value: object) -> bytes:
        if isinstance(value, heartbeat.Heartbeat | header.ProtocolHeader | commands.Connection.TuneOk):
            return b""
        if isinstance(value, commands.Connection.StartOk):
            tune = commands.Connection.Tune(channel_max=1, frame_max=_FRAME_MAX, heartbeat=0)
            return frame.marshal(tune, 0)
        if isinstance(value, commands.Connection.Open) and not self._closing:
            self._closing = True
            return frame.marshal(commands.Connection.Close(REPLY_CODE, self.text, 0, 0), 0)
        if isinstance(value, commands.Connection.Close):
            self.done = True
            return frame.marshal(commands.Connection.CloseOk(), 0)
        if isinstance(value, commands.Connection.CloseOk) or not self._closing:
            self.done = True  # close-ok: finished; anything else before open: not a client we answer
        return b""


def http_response(why: str) -> bytes:
    """``503 Service Unavailable`` with a JSON reason (RabbitMQ's error shape), closing."""
    body = json.dumps({"error": "service_unavailable", "reason": why}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


MQTT_CONNACK_V3: Final = bytes((0x20, 2, 0, 3))  # CONNACK, return code 3: server unavailable
MQTT_CONNACK_V5: Final = bytes((0x20, 3, 0, 0x88, 0))  # reason 0x88, no properties


def mqtt_connack(data: bytes) -> bytes | None:
    """The refusal of the CONNECT that ``data`` begins with: None while its protocol level has
    not come; ``b""`` (just close) when ``data`` is no CONNECT."""
    if not data:
        return None
    if data[0] != 0x10:
        return b""
    pos = 1
    for _ in range(4):  # the remaining length, 1 to 4 bytes
        if pos >= len(data):
            return None
        pos += 1
        if not data[pos - 1] & 0x80:
            break
    else:
        return b""
    if pos + 2 > len(data):
        return None
    level_at = pos + 2 + int.from_bytes(data[pos:pos + 2], "big")  # after the protocol name
    if level_at >= len(data):
        return None if level_at < MAX_INPUT else b""
    return MQTT_CONNACK_V5 if data[level_at] == 5 else MQTT_CONNACK_V3


def http_head_complete(data: bytes) -> bool:
    return b"\r\n\r\n" in data
