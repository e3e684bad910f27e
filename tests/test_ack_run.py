"""A read of single basic.acks on one channel is one batch for the store (issue 31).

A client that acks each message (prefetch 100) sends a read's worth of 21-byte ack frames;
``Connection._ack_run`` settles them as one ack of many. What the client sees is covered by
tests/test_publish_differential.py (fast paths on and off); here, that the batch happens and
that a bad tag in the middle fails the channel exactly there.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from _amqp_session import Client, close_node, make_node, pump
from pamqp import commands
from pamqp import frame as pframe


async def _consumer_with(node: Any, n: int, mp: pytest.MonkeyPatch) -> tuple[Client, Any, list[int]]:
    """A queue with ``n`` messages delivered (unacked) to a prefetch-100 consumer; its acks
    counted (the queue class's real method, wrapped for this test)."""
    c = Client(node)
    c.open(1)
    c.method(commands.Queue.Declare(queue="q"))
    for i in range(n):
        c.publish("", "q", b"m%d" % i)
    c.method(commands.Basic.Qos(prefetch_count=100))
    c.method(commands.Basic.Consume(queue="q", consumer_tag="c"))
    await pump(node)
    assert len(c.read().deliveries) == n
    q = node.vhosts["/"].queues["q"]
    calls: list[int] = []
    real = type(q).ack_many

    def counted(self: Any, ids: list[int]) -> None:
        calls.append(len(ids))
        real(self, ids)

    mp.setattr(type(q), "ack_many", counted)
    return c, q, calls


def test_single_acks_in_one_read_are_one_store_ack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        node = make_node(tmp_path)
        try:
            c, q, calls = await _consumer_with(node, 20, monkeypatch)
            c.send(b"".join(pframe.marshal(commands.Basic.Ack(delivery_tag=t), 1) for t in range(1, 21)))
            await pump(node)
            assert calls == [20]
            assert q.store.unacked_count == 0 and q.message_count == 0
            assert c.closes() == []
        finally:
            close_node(node)

    asyncio.run(main())


def test_a_repeated_tag_fails_the_channel_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        node = make_node(tmp_path)
        try:
            c, q, calls = await _consumer_with(node, 10, monkeypatch)
            tags = [1, 2, 3, 3, 4, 5]  # the second 3 is unknown by then: 4 and 5 are not acked
            c.send(b"".join(pframe.marshal(commands.Basic.Ack(delivery_tag=t), 1) for t in tags))
            await pump(node)
            closes = c.closes()
            assert len(closes) == 1 and closes[0].reply_code == 406 and "3" in closes[0].reply_text
            assert sum(calls) == 3  # 1, 2, 3; the rest went back to the queue with the channel
            assert q.message_count == 7
        finally:
            close_node(node)

    asyncio.run(main())
