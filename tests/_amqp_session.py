"""An in-process AMQP client for session tests: real frames into a real ``Session``, vhost and
store on a real event loop, no sockets.

``Client`` opens a connection and channels, encodes publishes (an empty body gets no body frame,
as clients send it), and parses whatever the session wrote into methods, deliveries and
confirms. ``pump()`` runs the loop until the queues have no delivery pass pending and the
syncer nothing to do, bounded in turns, so deliveries scheduled by a publish have happened.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pamqp import body as pbody
from pamqp import commands, header
from pamqp import frame as pframe

from broker.amqp.session import Session
from broker.config import load_config
from broker.node import Node


def publish_frames(exchange: str, rk: str, body: bytes, props: commands.Basic.Properties | None = None,
                   ch: int = 1, mandatory: bool = False, frame_max: int = 131072) -> bytes:
    props = props if props is not None else commands.Basic.Properties()
    out = [pframe.marshal(commands.Basic.Publish(exchange=exchange, routing_key=rk, mandatory=mandatory), ch),
           pframe.marshal(header.ContentHeader(0, len(body), props), ch)]
    step = frame_max - 8
    for i in range(0, len(body), step):
        out.append(pframe.marshal(pbody.ContentBody(body[i : i + step]), ch))
    return b"".join(out)


@dataclass
class Delivery:
    channel: int
    tag: int
    consumer_tag: str
    exchange: str
    routing_key: str
    redelivered: bool
    props: bytes
    body: bytes


@dataclass
class Parsed:
    methods: list[tuple[int, Any]] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    returns: list[tuple[int, Any, bytes]] = field(default_factory=list)
    gets: list[Delivery] = field(default_factory=list)


def parse(out: bytes) -> Parsed:
    """Methods, deliveries (deliver/get-ok with their content) and returns in ``out``."""
    got = Parsed()
    pos = 0
    pending: tuple[int, Any] | None = None
    props = b""
    size = 0
    chunks: list[bytes] = []

    def finish() -> None:
        nonlocal pending
        assert pending is not None
        ch, m = pending
        body = b"".join(chunks)
        if isinstance(m, commands.Basic.Return):
            got.returns.append((ch, m, body))
        else:
            d = Delivery(ch, int(m.delivery_tag), getattr(m, "consumer_tag", ""), m.exchange, m.routing_key,
                         bool(m.redelivered), props, body)
            (got.deliveries if isinstance(m, commands.Basic.Deliver) else got.gets).append(d)
        pending = None

    while pos < len(out):
        ftype = out[pos]
        ch = int.from_bytes(out[pos + 1 : pos + 3], "big")
        fsize = int.from_bytes(out[pos + 3 : pos + 7], "big")
        payload = out[pos + 7 : pos + 7 + fsize]
        assert out[pos + 7 + fsize] == 0xCE
        pos += 8 + fsize
        if ftype == 1:
            m = pframe.unmarshal(bytes(out[pos - 8 - fsize : pos]))[2]
            if isinstance(m, commands.Basic.Deliver | commands.Basic.GetOk | commands.Basic.Return):
                pending = (ch, m)
                chunks = []
            else:
                got.methods.append((ch, m))
        elif ftype == 2:
            size = int.from_bytes(payload[4:12], "big")
            props = bytes(payload[12:])
            if size == 0:
                finish()
        elif ftype == 3:
            chunks.append(bytes(payload))
            if sum(map(len, chunks)) == size:
                finish()
    return got


class Client:
    """One connection's worth of client: feed frames, read what the session answered."""

    def __init__(self, node: Any, frame_max: int = 131072) -> None:
        self.node = node
        self.frame_max = frame_max
        self.session = Session(node, ("127.0.0.1", 1), lambda: None)
        self.seen = Parsed()
        s = self.session
        s.receive_data(b"AMQP\x00\x00\x09\x01")
        s.receive_data(pframe.marshal(commands.Connection.StartOk(
            client_properties={"capabilities": {"consumer_cancel_notify": True}}, mechanism="PLAIN",
            response="\x00guest\x00guest"), 0))
        s.receive_data(pframe.marshal(commands.Connection.TuneOk(2047, frame_max, 0), 0))
        s.receive_data(pframe.marshal(commands.Connection.Open("/"), 0))
        self.read()

    def send(self, data: bytes) -> None:
        self.session.receive_data(data)
        self.session.after_batch()

    def method(self, m: Any, ch: int = 1) -> None:
        self.send(pframe.marshal(m, ch))

    def open(self, ch: int) -> None:
        self.method(commands.Channel.Open(), ch)

    def publish(self, exchange: str, rk: str, body: bytes, props: commands.Basic.Properties | None = None,
                ch: int = 1, mandatory: bool = False) -> None:
        self.send(publish_frames(exchange, rk, body, props, ch, mandatory, self.frame_max))

    def read(self) -> Parsed:
        """Everything written since the last read, parsed; also added to ``seen``."""
        s = self.session
        data = bytes(s.out)
        s.out.clear()
        got = parse(data)
        self.seen.methods += got.methods
        self.seen.deliveries += got.deliveries
        self.seen.returns += got.returns
        self.seen.gets += got.gets
        return got

    def closes(self) -> list[Any]:
        self.read()
        return [m for _, m in self.seen.methods if isinstance(m, commands.Channel.Close)]


async def pump(node: Any, deadline: float = 30.0) -> None:
    """Run the loop until no queue has a delivery pass scheduled and the syncer is idle
    (fsyncs run in a thread, hence a deadline rather than a number of turns)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    syncer = node.syncer
    while loop.time() < end:
        await asyncio.sleep(0)
        busy = any(q._scheduled for vh in node.vhosts.values() for q in vh.queues.values())
        if not busy and not (syncer._running or syncer._scheduled or syncer._callbacks):
            await asyncio.sleep(0)
            return
    raise AssertionError("the broker did not settle")


def make_node(tmp_path: Path, *extra: str) -> Any:
    cfg = load_config(["--data-dir", str(tmp_path), "--no-mgmt", *extra], environ={})
    return Node(cfg).load(asyncio.get_running_loop())


def close_node(node: Any) -> None:
    for vh in node.vhosts.values():
        vh.close()
