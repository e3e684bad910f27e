"""Regression tests for the publish-path defects of issue 13, each through real frames into a
real session, vhost and store (``_amqp_session``), no sockets except where the network layer
itself is what is tested."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop
from _amqp_session import Client, close_node, make_node, publish_frames, pump
from pamqp import commands
from pamqp import frame as pframe

from broker.net.server import AMQPProtocol

Props = commands.Basic.Properties


def _run(tmp_path: Path, test: Callable[[Any], Awaitable[None]], *extra: str, loop: str = "asyncio") -> None:
    """Run ``test(node)`` on a fresh event loop: asyncio's, or ``loop="uvloop"``, the one the
    broker runs on (its timers have a resolution of 1 ms and round shorter delays to 0)."""
    async def main() -> None:
        node = make_node(tmp_path, *extra)
        try:
            await test(node)
        finally:
            close_node(node)

    if loop == "uvloop":
        uvloop.run(main())
    else:
        asyncio.run(main())


# ------------------------------------------------------------------ (a) empty bodies in runs
def _empty_backlog(node: Any, n: int) -> Client:
    """A client with channel 1 open and ``n`` equal empty-body messages ready in queue "e"."""
    c = Client(node)
    c.open(1)
    c.method(commands.Queue.Declare(queue="e"))
    for _ in range(n):
        c.publish("", "e", b"", Props(content_type="text/plain"))
    assert node.vhosts["/"].queues["e"].message_count == n
    return c


def test_a_backlog_of_empty_bodies_reaches_an_autoack_consumer_whole(tmp_path: Path) -> None:
    async def test(node: Any) -> None:
        c = _empty_backlog(node, 100)
        q = node.vhosts["/"].queues["e"]
        c.method(commands.Basic.Consume(queue="e", consumer_tag="c", no_ack=True))
        await pump(node)
        got = c.read().deliveries
        assert [(d.tag, d.body) for d in got] == [(i, b"") for i in range(1, 101)]
        assert q.message_count == 0

    _run(tmp_path, test)


def test_a_backlog_of_empty_bodies_reaches_a_manual_ack_consumer(tmp_path: Path) -> None:
    async def test(node: Any) -> None:
        c = _empty_backlog(node, 10)
        c.method(commands.Basic.Qos(prefetch_count=4))
        c.method(commands.Basic.Consume(queue="e", consumer_tag="c"))
        await pump(node)
        tags = [d.tag for d in c.read().deliveries]
        assert tags == [1, 2, 3, 4]
        c.method(commands.Basic.Ack(delivery_tag=4, multiple=True))
        await pump(node)
        tags = [d.tag for d in c.read().deliveries]
        assert tags == [5, 6, 7, 8]
        c.method(commands.Basic.Ack(delivery_tag=8, multiple=True))
        await pump(node)
        assert [d.tag for d in c.read().deliveries] == [9, 10]
        c.method(commands.Basic.Ack(delivery_tag=10, multiple=True))
        await pump(node)
        assert c.closes() == []
        q = node.vhosts["/"].queues["e"]
        assert (q.message_count, q.store.unacked_count) == (0, 0)

    _run(tmp_path, test)


# ------------------------------------------------------------------ (b) confirm statistics
def test_confirm_statistics_count_messages_not_frames(tmp_path: Path) -> None:
    async def test(node: Any) -> None:
        c = Client(node)
        c.open(1)
        c.method(commands.Queue.Declare(queue="q"))
        c.method(commands.Confirm.Select())
        c.send(b"".join(publish_frames("", "q", b"m%d" % i) for i in range(1000)))
        await pump(node)
        acks = [m for _, m in c.read().methods if isinstance(m, commands.Basic.Ack)]
        assert acks and int(acks[-1].delivery_tag) == 1000
        assert len(acks) < 1000  # coalesced: fewer frames than messages
        assert node.stats.confirmed == 1000

    _run(tmp_path, test)


# ------------------------------------------------------------------ (c) exchange behaviour per hop
def _delayed(c: Client) -> None:
    c.method(commands.Exchange.Declare(exchange="dx", exchange_type="x-delayed-message",
                                       arguments={"x-delayed-type": "direct"}))
    c.method(commands.Queue.Declare(queue="dq"))
    c.method(commands.Queue.Bind(queue="dq", exchange="dx", routing_key="k"))


def test_a_delayed_exchange_reached_through_an_exchange_binding_delays(tmp_path: Path) -> None:
    async def test(node: Any) -> None:
        c = Client(node)
        c.open(1)
        _delayed(c)
        c.method(commands.Exchange.Declare(exchange="src", exchange_type="direct"))
        c.method(commands.Exchange.Bind(destination="dx", source="src", routing_key="k"))
        c.publish("src", "k", b"later", Props(headers={"x-delay": 60_000}))
        await pump(node)
        vh = node.vhosts["/"]
        assert vh.queues["dq"].message_count == 0
        assert vh.exchanges["dx"].special.delayed.count == 1
        c.publish("src", "k", b"now", Props(headers={"x-delay": 0}))
        assert vh.queues["dq"].message_count == 1
        assert c.closes() == []

    _run(tmp_path, test)


def test_a_delayed_exchange_reached_by_dead_lettering_delays(tmp_path: Path) -> None:
    async def test(node: Any) -> None:
        c = Client(node)
        c.open(1)
        _delayed(c)
        c.method(commands.Queue.Declare(queue="src", arguments={"x-dead-letter-exchange": "dx",
                                                                "x-dead-letter-routing-key": "k"}))
        c.publish("", "src", b"later", Props(headers={"x-delay": 60_000}))
        c.method(commands.Basic.Get(queue="src"))
        got = c.read().gets
        assert len(got) == 1
        c.method(commands.Basic.Reject(delivery_tag=got[0].tag, requeue=False))
        await pump(node)
        vh = node.vhosts["/"]
        assert vh.queues["src"].message_count == 0
        assert vh.queues["dq"].message_count == 0
        assert vh.exchanges["dx"].special.delayed.count == 1

    _run(tmp_path, test)


def test_a_dedup_exchange_reached_through_an_exchange_binding_deduplicates(tmp_path: Path) -> None:
    async def test(node: Any) -> None:
        c = Client(node)
        c.open(1)
        c.method(commands.Exchange.Declare(exchange="dd", exchange_type="direct",
                                           arguments={"x-message-deduplication": True, "x-cache-size": 10}))
        c.method(commands.Queue.Declare(queue="q"))
        c.method(commands.Queue.Bind(queue="q", exchange="dd", routing_key="k"))
        c.method(commands.Exchange.Declare(exchange="src", exchange_type="fanout"))
        c.method(commands.Exchange.Bind(destination="dd", source="src", routing_key=""))
        for body in (b"1", b"2", b"3"):
            c.publish("src", "k", body, Props(headers={"x-deduplication-header": "same"}))
        c.publish("src", "k", b"4", Props(headers={"x-deduplication-header": "other"}))
        assert node.vhosts["/"].queues["q"].message_count == 2

    _run(tmp_path, test)


# ------------------------------------------------------------------ (d) class/method ids
def _close_ids(c: Client) -> list[tuple[int, int, int]]:
    return [(int(m.reply_code), int(m.class_id), int(m.method_id)) for m in c.closes()]


def test_a_refused_publish_names_basic_publish_on_every_path(tmp_path: Path) -> None:
    async def test(node: Any) -> None:
        node.users.set_permissions("guest", "/", ".*", "^$", ".*")  # no write anywhere
        c = Client(node)
        for ch, data in (
            (1, publish_frames("amq.direct", "k", b"small")),  # one-frame fast path
            (2, publish_frames("amq.direct", "k", b"")),  # empty body
            (3, publish_frames("amq.direct", "k", b"x" * 300_000)),  # several body frames
            (4, publish_frames("amq.direct", "k", b"a") * 5),  # a run
        ):
            c.open(ch)
            c.send(data)
            assert _close_ids(c)[-1] == (403, 60, 40), ch

    _run(tmp_path, test)


def test_a_transactional_publish_to_a_missing_exchange_names_basic_publish(tmp_path: Path) -> None:
    async def test(node: Any) -> None:
        c = Client(node)
        c.open(1)
        c.method(commands.Tx.Select())
        c.publish("nowhere", "k", b"m")
        assert _close_ids(c) == [(404, 60, 40)]

    _run(tmp_path, test)


class _HoldProbe(AMQPProtocol):
    """The broker's AMQP protocol, calling ``on_hold`` each time it stops reading a publisher
    (holds it)."""

    def on_hold(self) -> None:
        """A test's probe records the hold here."""

    def data_received(self, data: bytes) -> None:
        paused = self._read_paused
        super().data_received(data)
        if self._read_paused and not paused:
            self.on_hold()


def _no_timed_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held publishers' timed looks (and the hold's end) 30 s away: only a recheck lets one go."""
    from broker.net import server as net_server

    monkeypatch.setattr(net_server, "_HOLD_POLL", 30.0)
    monkeypatch.setattr(net_server, "_HOLD_SECONDS", 30.0)


# ------------------------------------------------------------------ (e) no hold without need
def test_a_publisher_waiting_for_its_confirm_is_not_held(tmp_path: Path) -> None:
    """A confirm-mode publisher with one message in flight into a queue with a backlog and a
    consumer: once its confirm is out it has nothing in flight, so the network layer must go
    on reading it instead of parking it for the consumers' sake. A fire-and-forget publisher
    (whose next publishes may already be in the socket) is still held."""
    async def test(node: Any) -> None:
        protocols: set[AMQPProtocol] = set()
        held: list[tuple[bool, bool]] = []  # (confirm mode, reading paused after a batch)

        class Probe(AMQPProtocol):
            def data_received(self, data: bytes) -> None:
                super().data_received(data)
                s = self.session
                if s is not None and s.chs.get(1) is not None and s.stats.published:
                    held.append((s.chs[1].confirm, self._read_paused))

        async with _serving(node, Probe, protocols) as port:
            _lagging_consumer(node, "bq", 2000)
            assert node.vhosts["/"].queues["bq"].message_count > 1000
            reader, writer = await _open_channel(port)
            writer.write(pframe.marshal(commands.Confirm.Select(), 1))
            await _read_until(reader, b"\x00\x55\x00\x0b")  # confirm.select-ok
            for i in range(1, 6):
                writer.write(publish_frames("", "bq", b"sync-%d" % i))
                await _read_until(reader, b"\x00\x3c\x00\x50")  # basic.ack
            assert len(held) >= 5 and not any(paused for _, paused in held), held
            writer.close()

    _run(tmp_path, test)


@contextlib.asynccontextmanager
async def _serving(node: Any, cls: type[AMQPProtocol], protocols: set[AMQPProtocol]) -> AsyncIterator[int]:
    """A listener on loopback serving ``cls`` connections; its port. Closed with them."""
    server = await asyncio.get_running_loop().create_server(
        lambda: cls(node, protocols, ("127.0.0.1", 0)), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for p in list(protocols):
            if p.transport is not None:
                p.transport.close()
        await server.wait_closed()


def _lagging_consumer(node: Any, queue: str, backlog: int) -> None:
    """``queue`` with a backlog and a consumer (prefetch 1) that never acks."""
    setup = Client(node)
    setup.open(1)
    setup.method(commands.Queue.Declare(queue=queue))
    for i in range(backlog):
        setup.publish("", queue, b"backlog-%d" % i)
    setup.method(commands.Basic.Qos(prefetch_count=1))
    setup.method(commands.Basic.Consume(queue=queue, consumer_tag="slow"))


async def _open_channel(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw AMQP connection to ``port`` with channel 1 opened (its replies unread)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"AMQP\x00\x00\x09\x01")
    writer.write(pframe.marshal(commands.Connection.StartOk(
        client_properties={}, mechanism="PLAIN", response="\x00guest\x00guest"), 0))
    writer.write(pframe.marshal(commands.Connection.TuneOk(2047, 131072, 0), 0))
    writer.write(pframe.marshal(commands.Connection.Open("/"), 0))
    writer.write(pframe.marshal(commands.Channel.Open(), 1))
    return reader, writer


async def _read_until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = await asyncio.wait_for(reader.read(65536), 20)
        assert chunk, "connection closed"
        data += chunk
    return data


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_held_publisher_does_not_keep_the_loop_spinning(tmp_path: Path, kind: str) -> None:
    """A fire-and-forget publisher into a queue whose consumer lags is held for a few
    milliseconds so that the consumer's acks come first. While held, its reading is looked at
    again now and then, not on every loop turn: a loop turned for that alone would burn the CPU
    the consumers need (each look re-arms itself). Also on uvloop, whose timers round a delay
    under half a millisecond to none (issue 31: the broker spun through every hold there)."""
    async def test(node: Any) -> None:
        loop = asyncio.get_running_loop()
        protocols: set[AMQPProtocol] = set()
        looks: list[float] = []
        holds: list[float] = []

        class Probe(_HoldProbe):
            def on_hold(self) -> None:
                holds.append(loop.time())

            def _resume_reading(self, hold_until: float) -> None:
                looks.append(loop.time())
                super()._resume_reading(hold_until)

        async with _serving(node, Probe, protocols) as port:
            _lagging_consumer(node, "lag", 200)
            reader, writer = await _open_channel(port)
            await _read_until(reader, b"\x00\x14\x00\x0b")  # channel.open-ok
            for i in range(20):
                writer.write(publish_frames("", "lag", b"more-%d" % i))
                await writer.drain()
                await asyncio.sleep(0.01)  # longer than a hold: each publish is held anew
            assert len(holds) >= 5, holds
            # every hold lasts at most _HOLD_SECONDS (5 ms): a few looks each, not one per turn
            assert len(looks) <= 20 * len(holds), (len(looks), len(holds))
            writer.close()

    _run(tmp_path, test, loop=kind)


def test_a_held_publisher_reads_on_as_soon_as_its_consumer_caught_up(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31: a held publisher was let go only by a timed look (or the end of the hold), so
    everything it sent meanwhile waited up to that long after its queue's consumer had caught
    up: latency that the broker added for nothing. A write to a consumer now rechecks the held
    publishers. The timed looks are set to 30 s here: only the recheck can let it go in time."""
    _no_timed_looks(monkeypatch)

    async def test(node: Any) -> None:
        loop = asyncio.get_running_loop()
        protocols: set[AMQPProtocol] = set()
        holds: list[float] = []

        class Probe(_HoldProbe):
            def on_hold(self) -> None:
                holds.append(loop.time())

        async with _serving(node, Probe, protocols) as port:
            setup = Client(node)
            setup.open(1)
            setup.method(commands.Queue.Declare(queue="q"))
            creader, cwriter = await _open_channel(port)
            cwriter.write(pframe.marshal(commands.Basic.Qos(prefetch_count=1), 1))
            cwriter.write(pframe.marshal(commands.Basic.Consume(queue="q", consumer_tag="c"), 1))
            await _read_until(creader, b"\x00\x3c\x00\x15")  # basic.consume-ok
            preader, pwriter = await _open_channel(port)
            await _read_until(preader, b"\x00\x14\x00\x0b")  # channel.open-ok
            pwriter.write(b"".join(publish_frames("", "q", b"m%d" % i) for i in range(3)))
            deadline = loop.time() + 20
            while not holds and loop.time() < deadline:  # the consumer holds one, two are ready
                await asyncio.sleep(0.01)
            assert holds, "the publisher was never held"
            pwriter.write(publish_frames("", "q", b"after"))  # read only once it is let go
            seen = b""
            acked = 0

            async def consume_all() -> None:
                nonlocal seen, acked
                while b"after" not in seen:
                    chunk = await creader.read(65536)
                    assert chunk, "connection closed"
                    seen += chunk
                    while acked < seen.count(b"\x00\x3c\x00\x3c"):  # ack each delivery, in turn
                        acked += 1
                        cwriter.write(pframe.marshal(commands.Basic.Ack(delivery_tag=acked), 1))

            await asyncio.wait_for(consume_all(), 10)  # a timed look would come after 30 s
            assert acked == 4
            pwriter.close()
            cwriter.close()

    _run(tmp_path, test, loop="uvloop")


def test_a_held_confirm_publisher_reads_on_once_its_confirm_is_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A confirm-mode publisher of persistent messages into a durable queue with a backlog and
    a consumer is held after each publish (its confirm waits for the group commit). Once the
    confirm is out it waits for us; it must be read on then, not at the next timed look (issue
    31: the synchronous publisher's slow calls). The timed looks are set to 30 s here."""
    _no_timed_looks(monkeypatch)

    async def test(node: Any) -> None:
        protocols: set[AMQPProtocol] = set()
        holds: list[bool] = []

        class Probe(_HoldProbe):
            def on_hold(self) -> None:
                holds.append(True)

        async with _serving(node, Probe, protocols) as port:
            setup = Client(node)
            setup.open(1)
            setup.method(commands.Queue.Declare(queue="dq", durable=True))
            for i in range(50):
                setup.publish("", "dq", b"backlog-%d" % i)
            setup.method(commands.Basic.Qos(prefetch_count=1))
            setup.method(commands.Basic.Consume(queue="dq", consumer_tag="slow"))
            reader, writer = await _open_channel(port)
            writer.write(pframe.marshal(commands.Confirm.Select(), 1))
            await _read_until(reader, b"\x00\x55\x00\x0b")  # confirm.select-ok

            async def publish_in_turn() -> None:
                for i in range(1, 4):
                    writer.write(publish_frames("", "dq", b"sync-%d" % i, Props(delivery_mode=2)))
                    await _read_until(reader, b"\x00\x3c\x00\x50")  # basic.ack

            await asyncio.wait_for(publish_in_turn(), 10)  # a timed look would come after 30 s
            assert holds, "the publisher was never held: this test no longer tests anything"
            writer.close()

    _run(tmp_path, test, loop="uvloop")
