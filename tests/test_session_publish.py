"""Session-level publish decisions, driven with real frames into a real vhost and store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pamqp import body as pbody
from pamqp import commands, header
from pamqp import frame as pframe

from broker.config import load_config
from broker.net.session import Session
from broker.node import Node


def _publish(queue: str, body: bytes, delivery_mode: int) -> bytes:
    props = commands.Basic.Properties(delivery_mode=delivery_mode, content_type="text/plain")
    return (pframe.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1)
            + pframe.marshal(header.ContentHeader(0, len(body), props), 1)
            + pframe.marshal(pbody.ContentBody(body), 1))


def _open(s: Session) -> None:
    s.receive_data(b"AMQP\x00\x00\x09\x01")
    s.receive_data(pframe.marshal(commands.Connection.StartOk(
        client_properties={"capabilities": {}}, mechanism="PLAIN", response="\x00guest\x00guest"), 0))
    s.receive_data(pframe.marshal(commands.Connection.TuneOk(2047, 131072, 0), 0))
    s.receive_data(pframe.marshal(commands.Connection.Open("/"), 0))
    s.receive_data(pframe.marshal(commands.Channel.Open(), 1))


def test_persistence_is_decided_per_message_even_when_properties_repeat(tmp_path: Path) -> None:
    """A persistent message on a confirm channel to a durable queue needs a sync before its
    confirm; a transient one does not. The answer is cached per properties object, so
    repeats of either kind, and switches between them, must each get their own."""
    async def run() -> list[bool]:
        cfg = load_config(["--data-dir", str(tmp_path), "--no-mgmt"], environ={})
        broker = Node(cfg).load(asyncio.get_running_loop())
        s = Session(broker, ("127.0.0.1", 1), lambda: None)
        _open(s)
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="dq", durable=True), 1))
        s.receive_data(pframe.marshal(commands.Confirm.Select(), 1))
        chs = s.chs[1]
        seen = []
        for mode in (2, 2, 1, 1, 2, 1, 2, 2):
            chs.needs_sync = False
            s.receive_data(_publish("dq", b"m", mode))
            seen.append(chs.needs_sync)
        for vh in broker.vhosts.values():
            vh.close()
        return seen

    assert asyncio.run(run()) == [True, True, False, False, True, False, True, True]
