"""Publishes of one read on channels of their own are one batch (issue 31's 1,000 queues).

A producer with a channel per queue that writes one message to each in turn used to go through
the publish operation once per message (``VHost.publish``): the parser batched publishes only on
one channel. Channels without confirms or a transaction now share a batch
(``VHost.publish_batch``); what each channel sees is what publishing one by one gives, errors
included: a publish that closes its channel drops the later ones on that channel only. The
byte-for-byte comparison with the fast paths off is tests/test_publish_differential.py's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from _amqp_session import Client, close_node, make_node, publish_frames, pump
from pamqp import commands

from broker.model.vhost import VHost

QUEUES = 50


def _count(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"publish": 0, "publish_batch": 0}
    for name in calls:
        real = getattr(VHost, name)

        def counted(self: VHost, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(VHost, name, counted)
    return calls


def _consumers(node: Any) -> Client:
    cons = Client(node)
    for i in range(QUEUES):
        cons.open(i + 1)
        cons.method(commands.Queue.Declare(queue=f"mq{i}"), i + 1)
        cons.method(commands.Basic.Consume(queue=f"mq{i}", consumer_tag=f"c{i}", no_ack=True), i + 1)
    cons.read()
    return cons


def test_a_channel_per_queue_in_turn_is_one_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        node = make_node(tmp_path)
        try:
            cons = _consumers(node)
            pub = Client(node)
            for i in range(QUEUES):
                pub.open(i + 1)
            pub.publish("", "nowhere", b"first", ch=1)  # the exchange and the permission, seen once
            await pump(node)
            calls = _count(monkeypatch)
            # one publish per channel, every queue in turn, twice, and one to nowhere, mandatory
            pub.send(b"".join(publish_frames("", f"mq{i}", b"m%d.%d" % (r, i), ch=i + 1)
                              for r in range(2) for i in range(QUEUES))
                     + publish_frames("", "nowhere", b"lost", ch=7, mandatory=True))
            await pump(node)
            assert pub.closes() == []
            # main: 101 publishes one by one, no batch
            assert calls["publish"] == 0 and calls["publish_batch"] == 1, calls
            got = cons.read().deliveries
            by_queue: dict[str, list[bytes]] = {}
            for d in got:
                by_queue.setdefault(d.routing_key, []).append(d.body)
            assert by_queue == {f"mq{i}": [b"m0.%d" % i, b"m1.%d" % i] for i in range(QUEUES)}
            assert [(ch, m.reply_code, body) for ch, m, body in pub.seen.returns] == [(7, 312, b"lost")]
            st = pub.session.chs
            assert [st[i + 1].n_published for i in range(QUEUES)] == [3] + [2] * 5 + [3] + [2] * (QUEUES - 7)
        finally:
            close_node(node)

    asyncio.run(main())


def test_a_closing_publish_drops_only_its_own_channels_later_ones(tmp_path: Path) -> None:
    async def main() -> None:
        node = make_node(tmp_path)
        try:
            cons = _consumers(node)
            pub = Client(node)
            for ch in (1, 2, 3):
                pub.open(ch)
            pub.method(commands.Confirm.Select(), 3)  # confirms: its publishes are not mixed
            pub.publish("", "mq0", b"first", ch=1)
            await pump(node)
            pub.read()
            cons.read()
            bad = commands.Basic.Properties(user_id="someone-else")  # 406 on its channel
            pub.send(publish_frames("", "mq1", b"a1", ch=1) + publish_frames("", "mq2", b"b1", ch=2)
                     + publish_frames("", "mq3", b"c1", ch=3)
                     + publish_frames("", "mq4", b"b2", bad, ch=2) + publish_frames("", "mq5", b"a2", ch=1)
                     + publish_frames("", "mq6", b"b3", ch=2) + publish_frames("", "mq7", b"a3", ch=1))
            await pump(node)
            pub.read()
            closes = [(ch, m.reply_code) for ch, m in pub.seen.methods
                      if isinstance(m, commands.Channel.Close)]
            assert closes == [(2, 406)]
            acks = [(ch, m.delivery_tag) for ch, m in pub.seen.methods if isinstance(m, commands.Basic.Ack)]
            assert acks == [(3, 1)]
            bodies = sorted(d.body for d in cons.read().deliveries)
            assert bodies == [b"a1", b"a2", b"a3", b"b1", b"c1"]
        finally:
            close_node(node)

    asyncio.run(main())
