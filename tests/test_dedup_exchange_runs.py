"""A deduplicating exchange (``x-message-deduplication``) takes a run of publishes at once
(issue 30): one route, one pass over the cache, the queue's run append, and no full decode of
any message's headers; what a client sees is what publishing them one by one gives
(tests/test_publish_differential.py compares both byte for byte). Real frames into a real
session, vhost and store (``_amqp_session``), no sockets."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from _amqp_session import Client, close_node, make_node, publish_frames, pump
from _file_calls import worker_idle
from pamqp import commands

from broker import properties
from broker.store.queue_store import QueueStore

Props = commands.Basic.Properties
DEDUP = {"x-message-deduplication": True, "x-cache-size": 1000}


def _run(tmp_path: Path, test: Callable[[Any], Awaitable[None]]) -> None:
    async def main() -> None:
        node = make_node(tmp_path)
        try:
            await test(node)
        finally:
            close_node(node)

    asyncio.run(main())


def _row(i: int, ttl: int | None = None) -> Props:
    headers: dict[str, Any] = {"x-deduplication-header": f"q.0.{i}"}
    if ttl is not None:
        headers["x-cache-ttl"] = ttl
    return Props(delivery_mode=2, message_id=f"q.0.{i}", headers=headers)


def _setup(c: Client, arguments: dict[str, Any]) -> None:
    c.open(1)
    c.method(commands.Confirm.Select())
    c.method(commands.Exchange.Declare(exchange="dd", exchange_type="direct", durable=True,
                                       arguments=arguments))
    c.method(commands.Queue.Declare(queue="q", durable=True))
    c.method(commands.Queue.Bind(queue="q", exchange="dd", routing_key="k"))


class _Counts:
    """Calls of pamqp's full property decode and of the one-message publish operation."""

    def __init__(self, node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decodes = 0
        self.publishes = 0
        decode = properties.decode
        vh = node.vhosts["/"]
        publish = vh.publish

        def counted_decode(props: bytes) -> Any:
            self.decodes += 1
            return decode(props)

        def counted_publish(req: Any, *args: Any) -> Any:
            self.publishes += 1
            return publish(req, *args)

        monkeypatch.setattr(properties, "decode", counted_decode)
        monkeypatch.setattr(vh, "publish", counted_publish)


def _acked(c: Client) -> int:
    """The highest delivery tag confirmed (every confirm an ack)."""
    got = [m for _, m in c.read().methods if isinstance(m, commands.Basic.Ack | commands.Basic.Nack)]
    assert all(isinstance(m, commands.Basic.Ack) for m in got)
    return max((int(m.delivery_tag) for m in got), default=0)


def test_a_run_to_a_dedup_exchange_is_taken_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def test(node: Any) -> None:
        c = Client(node)
        _setup(c, DEDUP)
        c.publish("dd", "k", b"row-0", _row(0))  # a first publish finds the write permission alone
        c.read()
        counts = _Counts(node, monkeypatch)
        # 39 new rows, then a retried task's first 10 again (duplicates: dropped, confirmed)
        rows = [publish_frames("dd", "k", b"row-%d" % i, _row(i)) for i in range(1, 40)]
        rows += [publish_frames("dd", "k", b"row-%d" % i, _row(i)) for i in range(10)]
        c.send(b"".join(rows))
        await pump(node)
        q = node.vhosts["/"].queues["q"]
        assert q.message_count == 40
        assert _acked(c) == 50
        assert counts.publishes == 0, "a publish operation per message"
        assert counts.decodes == 0, "the headers decoded in full"
        bodies = []
        while (m := q.get()) is not None:
            bodies.append(m[4])
        assert bodies == [b"row-%d" % i for i in range(40)]

    _run(tmp_path, test)


def test_a_batch_to_a_dedup_exchange_is_taken_at_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows with routing keys of their own (the sink's ``key`` column): a batch, the same."""
    async def test(node: Any) -> None:
        c = Client(node)
        _setup(c, DEDUP)
        c.method(commands.Queue.Bind(queue="q", exchange="dd", routing_key="j"))
        c.publish("dd", "k", b"row-0", _row(0))
        c.read()
        counts = _Counts(node, monkeypatch)
        order = [*range(1, 30), *range(5), 40]  # then 5 duplicates and one new row
        c.send(b"".join(publish_frames("dd", "kj"[i % 2] if i < 40 else "nowhere", b"row-%d" % i, _row(i))
                        for i in order))
        await pump(node)
        q = node.vhosts["/"].queues["q"]
        assert q.message_count == 30
        assert _acked(c) == 1 + len(order)
        assert counts.publishes == 0, "a publish operation per message"
        assert counts.decodes == 0, "the headers decoded in full"

    _run(tmp_path, test)


def test_a_run_keeps_the_cache_bounds(tmp_path: Path) -> None:
    """Size (LRU) and time-to-live, the exchange's and a message's own, as one by one."""
    async def test(node: Any) -> None:
        c = Client(node)
        _setup(c, {**DEDUP, "x-cache-size": 3})
        # 0 1 2 3: 0 evicted by 3; then 0 (new again, evicts 1), 3 (a duplicate), 1 (new again)
        order = [0, 1, 2, 3, 0, 3, 1]
        c.send(b"".join(publish_frames("dd", "k", b"%d" % i, _row(i)) for i in order))
        await pump(node)
        q = node.vhosts["/"].queues["q"]
        assert q.message_count == 6
        # a message's own x-cache-ttl: 1 ms, so a repeat after 20 ms is new
        c.send(b"".join(publish_frames("dd", "k", b"t", _row(100 + i, ttl=1)) for i in range(3)))
        await asyncio.sleep(0.02)
        c.send(b"".join(publish_frames("dd", "k", b"t", _row(100 + i, ttl=1)) for i in range(3)))
        await pump(node)
        assert q.message_count == 12
        assert _acked(c) == 13

    _run(tmp_path, test)


@pytest.mark.parametrize("value", ["text", b"\xff\xfe", 7, -3, 2**40, True, 1.5, None, [1, "a"], {"a": 1}])
def test_header_values_read_as_a_full_decode_reads_them(value: Any) -> None:
    headers = {"a": 1, "x-deduplication-header": value, "x-cache-ttl": 5, "z": "end"}
    props = properties.encode(Props(headers=headers, message_id="m"))
    want = properties.headers(props)
    got = properties.header_values(props, (b"x-deduplication-header", b"x-cache-ttl", b"missing"))
    assert got == [want.get("x-deduplication-header"), 5, None]
    assert properties.header_values(properties.encode(Props(message_id="m")), (b"a",)) == [None]


@pytest.mark.parametrize("queues", [1, 2])
def test_a_publish_refused_for_a_full_disk_is_new_when_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, queues: int) -> None:
    """Nacked for a full disk means not published: the exchange must not remember its key, or
    the publisher's retry would be dropped as a duplicate (and confirmed): lost. A run and then
    the same messages one by one (the fallback), to one queue and to two (room made first)."""
    async def test(node: Any) -> None:
        c = Client(node)
        _setup(c, DEDUP)
        if queues == 2:
            c.method(commands.Queue.Declare(queue="q2", durable=True))
            c.method(commands.Queue.Bind(queue="q2", exchange="dd", routing_key="k"))
        c.publish("dd", "k", b"row-0", _row(0))
        await pump(node)
        vh = node.vhosts["/"]
        full = [True]
        for method in ("reserve", "append"):  # what the queue store allocates through
            real = getattr(QueueStore, method)

            def failing(*args: Any, _real: Any = real) -> Any:
                if full[0]:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return _real(*args)

            monkeypatch.setattr(QueueStore, method, failing)
        rows = b"".join(publish_frames("dd", "k", b"row-%d" % i, _row(i)) for i in range(1, 6))
        c.send(rows)
        await pump(node)
        nacks = [m for _, m in c.read().methods if isinstance(m, commands.Basic.Nack)]
        assert nacks, "the full disk was not answered"
        full[0] = False
        c.send(rows)  # the publisher's retry
        await pump(node)
        assert vh.queues["q"].message_count == 6

    _run(tmp_path, test)


def test_a_key_forgotten_for_a_full_disk_stays_forgotten_after_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The durable cache (x-cache-persistence: disk, a durable exchange's default) writes a
    run's keys before its messages; when the queue's store then finds the disk full, the keys
    are forgotten on disk too (their records acked at once), so the publisher's retry is new
    after a restart as well; the keys of what was stored are still there."""
    async def test(node: Any) -> None:
        c = Client(node)
        _setup(c, DEDUP)
        c.publish("dd", "k", b"row-0", _row(0))
        await pump(node)
        full = [True]
        for method in ("reserve", "append", "append_run"):  # what the queue's store writes through
            real = getattr(QueueStore, method)

            def failing(store: QueueStore, *args: Any, _real: Any = real) -> Any:
                if full[0] and store.directory.parent.name != "dedup":  # the queue's store only
                    raise OSError(errno.ENOSPC, "No space left on device")
                return _real(store, *args)

            monkeypatch.setattr(QueueStore, method, failing)
        c.send(b"".join(publish_frames("dd", "k", b"row-%d" % i, _row(i)) for i in range(1, 6)))
        await pump(node)
        assert [m for _, m in c.read().methods if isinstance(m, commands.Basic.Nack)]
        full[0] = False

    _run(tmp_path, test)

    async def after(node: Any) -> None:  # a restart of the same data dir
        c = Client(node)
        _setup(c, DEDUP)
        c.send(b"".join(publish_frames("dd", "k", b"row-%d" % i, _row(i)) for i in range(6)))
        await pump(node)
        assert node.vhosts["/"].queues["q"].message_count == 6  # row-0 then, rows 1-5 now

    _run(tmp_path, after)


def test_a_redeclared_exchange_keeps_its_own_cache_across_a_restart(tmp_path: Path) -> None:
    """The boot's replay of declare, delete, declare: the cache on disk is the second
    exchange's (its files are decided at the end of the replay, as a delayed exchange's held
    messages are); an exchange deleted for good leaves no cache behind."""
    async def first(node: Any) -> None:
        c = Client(node)
        _setup(c, DEDUP)
        c.publish("dd", "k", b"a", _row(1))
        c.method(commands.Exchange.Delete(exchange="dd"))
        c.method(commands.Exchange.Declare(exchange="dd", exchange_type="direct", durable=True,
                                           arguments=DEDUP))
        c.method(commands.Queue.Bind(queue="q", exchange="dd", routing_key="k"))
        c.publish("dd", "k", b"b", _row(2))
        c.method(commands.Exchange.Declare(exchange="gone", exchange_type="direct", durable=True,
                                           arguments=DEDUP))
        c.method(commands.Exchange.Delete(exchange="gone"))
        await pump(node)

    async def after(node: Any) -> None:
        c = Client(node)
        c.open(1)
        c.publish("dd", "k", b"a again", _row(1))  # the first exchange's key: new here
        c.publish("dd", "k", b"b again", _row(2))  # the second's: a duplicate
        await pump(node)
        assert node.vhosts["/"].queues["q"].message_count == 3
        worker_idle()
        assert len(os.listdir(node.vhosts["/"].dir / "dedup")) == 1  # the second dd's only

    _run(tmp_path, first)
    _run(tmp_path, after)


def _full_decode_key(props: bytes) -> tuple[str | None, int | None]:
    """The key and TTL as the exchange read them before: from pamqp's full decode."""
    headers = properties.headers(props)
    key = headers.get("x-deduplication-header")
    ttl = headers.get("x-cache-ttl")
    text = None if key is None else key.decode(errors="replace") if isinstance(key, bytes) else str(key)
    return text, (ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0 else None)


@pytest.mark.parametrize("props", [
    Props(delivery_mode=2, message_id="q.1", headers={"x-deduplication-header": "q.1"}),  # the sink's
    Props(headers={"x-deduplication-header": b"\xff\xfe"}),
    Props(headers={"x-deduplication-header": "k", "x-cache-ttl": 500}),
    Props(content_type="text/plain", headers={"x-deduplication-header": "k"}),
    Props(headers={"a": "x-deduplication-header", "x-deduplication-header": 12}),
    Props(headers={"x-deduplication-header": "k", "z": "\x0bx-cache-ttl"}),
    Props(headers={}, message_id="x-deduplication-header"),  # the field's bytes outside the table
    Props(message_id="x-deduplication-header"),
])
def test_the_key_read_in_place_is_the_full_decodes(props: Props) -> None:
    from broker.model.exchange_features import dedup_key

    raw = properties.encode(props)
    assert dedup_key(raw) == _full_decode_key(raw)
