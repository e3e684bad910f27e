"""What a client sees, as a transcript that two brokers' runs can be diffed on.

Theory of operation: a scenario drives one or more ``Conn`` (raw-frame AMQP connections built on
``_raw.RawConn``) through a ``Run``. Every frame a scenario reads is appended to the run's
transcript, normalised: a method frame becomes ``(conn, channel, "Class.Method", fields)``, a
content header ``(conn, channel, "header", size, properties)`` and a body ``(conn, channel,
"body", bytes)``. What legitimately differs between brokers is normalised away here and nowhere
else: server-properties other than ``capabilities``, server-generated names (``amq.gen-*``,
``amq.ctag-*``), the run's own unique names (replaced by the scenario's logical names), and close
texts, of which only the RabbitMQ constant before `` - `` (``NOT_FOUND``) is kept; the full texts
go to ``Run.texts`` for the report. Everything else (codes, class/method ids, counts, delivery
tags, redelivered flags, frame order on a connection) is compared exactly.

Reads are explicit (``recv``, ``until``): a scenario states how many frames it expects, so no
read waits for "nothing more" except ``quiet``, which a scenario uses only where the absence of
a frame is the behaviour under test. A ``channel.close`` from the broker is answered with
``close-ok`` and a ``connection.close`` with ``close-ok`` as a client library would.
"""

from __future__ import annotations

import datetime
import re
import time
import uuid
from typing import Any

from pamqp import commands
from pamqp import frame as pframe
from pamqp.base import Frame
from pamqp.header import ContentHeader

from .._raw import (
    FRAME_BODY,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    PROTOCOL_HEADER,
    Closed,
    RawConn,
    frame_bytes,
    header_payload,
    method_bytes,
)
from .allowlist import HEADERS

READ_TIMEOUT = 15.0  # a shared 2-core machine can be slow; a scenario that hangs fails here
Record = tuple[Any, ...]

_GEN = re.compile(r"amq\.gen-[A-Za-z0-9_\-]+")
_CTAG = re.compile(r"amq\.ctag-[A-Za-z0-9_\-]+")
_REPLY_TO = re.compile(r"amq\.rabbitmq\.reply-to\.[A-Za-z0-9_\-+/=.]+")


class Run:
    """One scenario's run against one broker: its names, connections and transcript."""

    def __init__(self, broker: str, host: str, port: int, mgmt_port: int) -> None:
        self.broker = broker
        self.host, self.port, self.mgmt_port = host, port, mgmt_port
        self.tag = uuid.uuid4().hex[:10]
        self.names: dict[str, str] = {}
        self.transcript: list[Record] = []
        self.texts: list[str] = []
        self.conns: list[Conn] = []
        self.node_names: list[str] = []  # the broker's node names, hidden in HTTP paths

    def name(self, logical: str) -> str:
        """A name unique to this run for the scenario's logical name ``logical``."""
        if logical not in self.names:
            self.names[logical] = f"conf.{logical}.{self.tag}"
        return self.names[logical]

    def note(self, *record: Any) -> None:
        """Record an observation that is not a frame (e.g. an HTTP status)."""
        self.transcript.append(tuple(self.norm(x) for x in record))

    def norm(self, value: Any) -> Any:
        if isinstance(value, str):
            for logical, real in self.names.items():
                value = value.replace(real, f"<{logical}>")
            value = value.replace(self.tag, "<tag>")
            value = _REPLY_TO.sub("amq.rabbitmq.reply-to.*", value)
            return _CTAG.sub("amq.ctag-*", _GEN.sub("amq.gen-*", value))
        if isinstance(value, datetime.datetime):
            return "<timestamp>"
        if isinstance(value, bytes):
            return value
        if isinstance(value, dict):
            return {self.norm(k): self.norm(v) for k, v in sorted(value.items())
                    if k not in HEADERS}
        if isinstance(value, (list, tuple)):
            return type(value)(self.norm(v) for v in value)
        return value

    def conn(self, handshake: bool = True, **kw: Any) -> Conn:
        c = Conn(self, f"c{len(self.conns) + 1}")
        self.conns.append(c)
        if handshake:
            c.handshake(**kw)
        return c

    def close(self) -> None:
        for c in self.conns:
            c.raw.close()


def _method_record(run: Run, cid: str, channel: int, m: Frame) -> Record:
    fields = dict(m)
    if isinstance(m, commands.Connection.Start):
        props = fields.pop("server_properties") or {}
        fields["capabilities"] = props.get("capabilities")
        fields["mechanisms"] = sorted(str(fields["mechanisms"]).split())
    if isinstance(m, (commands.Connection.Close, commands.Channel.Close)):
        text = str(fields["reply_text"])
        run.texts.append(f"{cid} ch{channel} {fields['reply_code']} {run.norm(text)}")
        fields["reply_text"] = text.split(" - ", 1)[0]
    return (cid, channel, m.name, run.norm(fields))


def _confirm_record(conn: Conn, channel: int, rec: Record, m: Frame) -> Record:
    """A broker's ack/nack of publishes: ``multiple`` is normalised to what it means (a multiple
    ack of the next unconfirmed tag alone is a single ack; brokers coalesce differently) and a
    nack's ``requeue`` bit is dropped (the spec gives it a meaning only in a client's nack)."""
    tag = int(m.delivery_tag)
    last = conn.confirmed.get(channel, 0)
    fields = dict(rec[3])
    if fields.get("multiple") and tag == last + 1:
        fields["multiple"] = False
    fields.pop("requeue", None)
    conn.confirmed[channel] = max(last, tag)
    return (*rec[:3], fields)


class Conn:
    """One raw AMQP connection whose every received frame lands in the run's transcript."""

    def __init__(self, run: Run, cid: str) -> None:
        self.run, self.cid = run, cid
        self.raw = RawConn(run.host, run.port, timeout=READ_TIMEOUT)
        self.closed = False
        self.confirmed: dict[int, int] = {}  # channel -> highest publish tag the broker confirmed
        self.last_props: dict[str, Any] = {}  # the last content header's properties, as sent
        self.last_fields: dict[str, Any] = {}  # the last method's fields, as sent (not normalised)

    # -- sending -------------------------------------------------------------------------
    def send(self, channel: int, method: Frame) -> None:
        self.raw.send(method_bytes(channel, method))

    def send_bytes(self, data: bytes) -> None:
        self.raw.send(data)

    def publish(self, channel: int, exchange: str, routing_key: str, body: bytes = b"",
                props: commands.Basic.Properties | None = None, mandatory: bool = False) -> None:
        out = method_bytes(channel, commands.Basic.Publish(
            exchange=exchange, routing_key=routing_key, mandatory=mandatory))
        out += frame_bytes(FRAME_HEADER, channel,
                           header_payload(len(body), props or commands.Basic.Properties()))
        step = (self.raw.frame_max or 131072) - 8
        for i in range(0, len(body), step):
            out += frame_bytes(FRAME_BODY, channel, body[i : i + step])
        self.raw.send(out)

    # -- receiving -----------------------------------------------------------------------
    def _read(self, timeout: float) -> Record:
        self.raw.sock.settimeout(timeout)
        try:
            ftype, channel, payload = self.raw.read_frame()
        except Closed:
            self.closed = True
            return (self.cid, 0, "eof")
        except OSError as exc:
            if isinstance(exc, TimeoutError):
                raise
            self.closed = True
            return (self.cid, 0, "eof")
        if ftype == FRAME_METHOD:
            try:
                _, ch, m = pframe.unmarshal(frame_bytes(ftype, channel, payload))
            except Exception:  # noqa: BLE001 - a method pamqp does not know (access.request-ok)
                cls, mth = int.from_bytes(payload[0:2], "big"), int.from_bytes(payload[2:4], "big")
                return (self.cid, channel, f"method-{cls}-{mth}", payload[4:])
            assert isinstance(m, Frame)
            self.last_fields = dict(m)
            rec = _method_record(self.run, self.cid, ch, m)
            if isinstance(m, (commands.Basic.Ack, commands.Basic.Nack)):
                rec = _confirm_record(self, ch, rec, m)
            elif isinstance(m, commands.Channel.OpenOk):
                self.confirmed.pop(ch, None)  # a reopened channel numbers its publishes from 1
            if isinstance(m, commands.Channel.Close):
                self.send(ch, commands.Channel.CloseOk())
            elif isinstance(m, commands.Connection.Close):
                self.send(0, commands.Connection.CloseOk())
                self.closed = True
            return rec
        if ftype == FRAME_HEADER:
            hdr = pframe.unmarshal(frame_bytes(ftype, channel, payload))[2]
            assert isinstance(hdr, ContentHeader)
            props = {k: v for k, v in dict(hdr.properties).items() if v not in (None, "")}
            self.last_props = props
            return (self.cid, channel, "header", hdr.body_size, self.run.norm(props))
        if ftype == FRAME_BODY:
            return (self.cid, channel, "body", bytes(payload))
        if ftype == FRAME_HEARTBEAT:
            return (self.cid, channel, "heartbeat")
        return (self.cid, channel, f"frame-type-{ftype}")

    def recv(self, n: int = 1, heartbeats: bool = False) -> list[Record]:
        """Read and record the next ``n`` frames (heartbeats skipped unless asked for)."""
        got: list[Record] = []
        deadline = time.monotonic() + READ_TIMEOUT
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.cid}: {len(got)} of {n} frames within {READ_TIMEOUT}s")
            rec = self._read(left)
            if rec[2] == "heartbeat" and not heartbeats:
                continue
            self.run.transcript.append(rec)
            got.append(rec)
            if rec[2] == "eof":
                break
        return got

    def until(self, name: str, heartbeats: bool = False) -> Record:
        """Read and record frames until one named ``name`` (e.g. ``Channel.Close``) or EOF."""
        for _ in range(10_000):
            rec = self.recv(1, heartbeats)[0]
            if rec[2] in (name, "eof"):
                return rec
        raise AssertionError(f"{self.cid}: no {name} in 10000 frames")

    def quiet(self, seconds: float = 0.3) -> None:
        """Record whatever arrives within ``seconds`` (the scenario claims nothing should)."""
        deadline = time.monotonic() + seconds
        while not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                rec = self._read(left)
            except TimeoutError:
                return
            if rec[2] != "heartbeat":
                self.run.transcript.append(rec)

    def call(self, channel: int, method: Frame, frames: int = 1) -> list[Record]:
        """Send a method and record the next ``frames`` frames (its answer)."""
        self.send(channel, method)
        return self.recv(frames)

    # -- negotiation ---------------------------------------------------------------------
    def handshake(self, user: str = "guest", password: str = "guest", vhost: str = "/",
                  frame_max: int | None = None, channel_max: int | None = None,
                  heartbeat: int = 0, capabilities: dict[str, Any] | None = None,
                  open_channel: int | None = 1) -> None:
        """start/start-ok/tune/tune-ok/open, recorded; optionally open a first channel."""
        self.raw.send(PROTOCOL_HEADER)
        self.recv(1)
        caps = {"consumer_cancel_notify": True, "publisher_confirms": True,
                "basic.nack": True, "connection.blocked": True,
                "authentication_failure_close": True, **(capabilities or {})}
        self.send(0, commands.Connection.StartOk(
            client_properties={"product": "skred-conformance", "capabilities": caps},
            mechanism="PLAIN", response=f"\0{user}\0{password}", locale="en_US"))
        tune = self.recv(1)[0]
        if tune[2] != "Connection.Tune":
            return
        fields = tune[3]
        self.raw.frame_max = fields["frame_max"] if frame_max is None else frame_max
        self.raw.channel_max = fields["channel_max"] if channel_max is None else channel_max
        self.send(0, commands.Connection.TuneOk(self.raw.channel_max, self.raw.frame_max, heartbeat))
        self.send(0, commands.Connection.Open(virtual_host=vhost))
        opened = self.recv(1)[0]
        if open_channel is not None and opened[2] == "Connection.OpenOk":
            self.call(open_channel, commands.Channel.Open())

    def close(self) -> None:
        """A client's orderly close, recorded (close-ok or whatever the broker says instead)."""
        if not self.closed:
            self.send(0, commands.Connection.Close(200, "bye", 0, 0))
            self.until("Connection.CloseOk")
            self.closed = True
        self.raw.close()
