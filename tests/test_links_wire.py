"""The link layer's consuming connection (``broker/links/wire.py``) over a real socket pair: a run
of deliveries carrying one property list is handed on with those raw bytes, and a list no client
could decode still breaks the connection when it has the length and layout of the list that came
before it (the last list that passed is not checked again: a different one is)."""

from __future__ import annotations

import asyncio
import socket
import struct

from pamqp import commands
from pamqp import frame as pframe

from broker import properties
from broker.links.message import Message, new_lost
from broker.links.wire import Wire

GOOD = properties.encode(commands.Basic.Properties(delivery_mode=2, message_id="x"))
BAD = GOOD[:-1] + b"\xff"  # the same layout, a message-id that is not UTF-8


def _delivery(tag: int, props: bytes, body: bytes) -> bytes:
    deliver = commands.Basic.Deliver(consumer_tag="c", delivery_tag=tag, redelivered=False, exchange="",
                                     routing_key="q")
    header = struct.pack(">HHQ", 60, 0, len(body)) + props
    return (pframe.marshal(deliver, 1)
            + struct.pack(">BHI", 2, 1, len(header)) + header + b"\xce"
            + struct.pack(">BHI", 3, 1, len(body)) + body + b"\xce")


async def _feed(*props: bytes) -> tuple[list[Message], str]:
    """Deliveries with ``props`` in one write; what the wire handed on, and why it was lost."""
    ours, theirs = socket.socketpair()
    lost = new_lost()
    wire = Wire(lost)
    got: list[Message] = []
    wire.channel, wire.on_message, wire.consuming = 1, got.append, True
    await asyncio.get_running_loop().create_connection(lambda: wire, sock=ours)
    try:
        theirs.sendall(b"".join(_delivery(i + 1, p, b"m%d" % i) for i, p in enumerate(props)))
        async with asyncio.timeout(10):
            while len(got) < len(props) and not lost.done():
                await asyncio.sleep(0.01)
        return got, lost.result() if lost.done() else ""
    finally:
        if wire.transport is not None:
            wire.transport.abort()
        theirs.close()


def test_a_run_of_one_property_list_is_handed_on_raw() -> None:
    got, why = asyncio.run(_feed(GOOD, GOOD, GOOD))
    assert why == ""
    assert [(m.tag, m.body, m.raw) for m in got] == [(1, b"m0", GOOD), (2, b"m1", GOOD), (3, b"m2", GOOD)]


def test_an_undecodable_list_after_a_valid_one_of_its_layout_breaks_the_connection() -> None:
    assert properties.valid(GOOD) and not properties.valid(BAD)
    got, why = asyncio.run(_feed(GOOD, GOOD, BAD, GOOD))
    assert [m.tag for m in got] == [1, 2]
    assert "undecodable message properties" in why
