"""StreamQueue with in-memory consumers: offsets, stored offsets, filters, 406s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands

from broker import errors
from broker.model.queue import Consumer, Queue
from broker.model.stream import OFFSET_BITS, StreamQueue, _decode
from broker.store import sequences
from broker.store.stream_store import StreamStore


class FakeConsumer(Consumer):
    __slots__ = ("got", "capacity")

    def __init__(self, q: Queue, tag: str, args: dict[str, Any] | None = None, capacity: int = 1000) -> None:
        super().__init__(tag, q, False, False, args or {})
        self.got: list[tuple[int, int, bytes, bool, dict[str, Any]]] = []
        self.capacity = capacity

    def ready(self) -> bool:
        return len(self.got) < self.capacity

    def deliver(self, msgid: int, exchange: bytes, routing_key: bytes, props: bytes, body: bytes,
                redelivered: bool) -> None:
        headers = dict(_decode(props).headers or {})
        self.got.append((msgid, int(headers["x-stream-offset"]), body, redelivered, headers))


def _queue(tmp_path: Path) -> tuple[StreamQueue, list[Callable[[], None]]]:
    pending: list[Callable[[], None]] = []
    store = StreamStore(tmp_path / "s", segment_size=1024)
    q = StreamQueue("/", "s", arguments={"x-queue-type": "stream"}, stream=store,
                    schedule=pending.append, on_unused=lambda q: None, on_dirty=lambda s: None)
    return q, pending


def _run(pending: list[Callable[[], None]]) -> None:
    for _ in range(1000):
        if not pending:
            return
        pending.pop(0)()
    raise AssertionError("delivery never settled")


def _pub(q: StreamQueue, n: int, headers: list[dict[str, Any] | None] | None = None) -> None:
    for i in range(n):
        h = headers[i] if headers else None
        props = bytes(commands.Basic.Properties(headers=h).marshal())
        q.publish(1_700_000_000_000 + i, b"", b"s", props, b"%d" % i, True)


def test_offset_specs(tmp_path: Path) -> None:
    q, pending = _queue(tmp_path)
    _pub(q, 10)
    assert q.message_count == 10
    cases = {"first": 0, "last": 9, "next": 10, 4: 4}
    for spec, start in cases.items():
        c = FakeConsumer(q, f"t{spec}", {"x-stream-offset": spec})
        q.add_consumer(c)
        _run(pending)
        assert [g[1] for g in c.got] == list(range(start, 10)), spec
        assert [g[2] for g in c.got] == [b"%d" % i for i in range(start, 10)]
        q.remove_consumer(c)
    with pytest.raises(errors.PreconditionFailed):
        q.check_consume(False, 10, 0, {"x-stream-offset": "sometime"})
    q.close()


def test_prefetch_manual_ack_get_purge_are_enforced(tmp_path: Path) -> None:
    q, _ = _queue(tmp_path)
    with pytest.raises(errors.PreconditionFailed):
        q.check_consume(False, 0, 0, {})
    with pytest.raises(errors.PreconditionFailed):
        q.check_consume(True, 10, 0, {})
    q.check_consume(False, 10, 0, {"x-stream-offset": "first"})
    with pytest.raises(errors.PreconditionFailed):
        q.get()
    with pytest.raises(errors.PreconditionFailed):
        q.purge()
    q.close()


def test_stored_offset_never_skips_unacked(tmp_path: Path) -> None:
    q, pending = _queue(tmp_path)
    _pub(q, 10)
    c = FakeConsumer(q, "me", {"x-stream-offset": "first"}, capacity=6)
    q.add_consumer(c)
    _run(pending)
    assert [g[1] for g in c.got] == [0, 1, 2, 3, 4, 5]
    for msgid, off, *_ in c.got:
        if off != 2:
            q.ack(msgid)
    assert q.stream.stored_offset("me") == 2
    # Channel close: consumer removed, then its unacked messages requeued.
    q.remove_consumer(c)
    q.reject(c.got[2][0], True)
    assert q.stream.stored_offset("me") == 2
    again = FakeConsumer(q, "me")  # same tag, no x-stream-offset: resume
    q.add_consumer(again)
    _run(pending)
    assert [g[1] for g in again.got] == list(range(2, 10))
    for msgid, *_ in again.got:
        q.ack(msgid)
    assert q.stream.stored_offset("me") == 10
    q.close()


def test_multiple_ack_commits_once_and_ends_as_acks_one_by_one(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``multiple`` ack (``ack_many``) leaves the stored offset, the counters and the cursors
    as acking one by one does, and works out the commit point once, not once per message (a
    scan of the pending offsets each time: quadratic in the prefetch window)."""
    from broker.model import stream as stream_mod

    ends = []
    calls: list[int] = []
    real = stream_mod._Cursor.commit_point

    def counted(cur: Any) -> int:
        calls.append(1)
        return real(cur)

    for mode in ("one by one", "multiple"):
        q, pending = _queue(tmp_path / mode.replace(" ", "-"))
        _pub(q, 40)
        c = FakeConsumer(q, "me", {"x-stream-offset": "first"}, capacity=30)
        q.add_consumer(c)
        _run(pending)
        ids = [g[0] for g in c.got if g[1] != 7]  # offset 7 stays unacked
        calls.clear()
        monkeypatch.setattr(stream_mod._Cursor, "commit_point", counted)
        if mode == "multiple":
            q.ack_many(ids + [(99 << OFFSET_BITS) | 3])  # an unknown cursor is skipped
            assert len(calls) == 1
        else:
            for msgid in ids:
                q.ack(msgid)
        monkeypatch.undo()
        q.remove_consumer(c)
        ends.append((q.stream.stored_offset("me"), q.n_acked, len(q._cursors)))
        q.close()
    assert ends[0] == ends[1] == (7, 29, 1)


def test_requeue_redelivers_to_live_consumer(tmp_path: Path) -> None:
    q, pending = _queue(tmp_path)
    _pub(q, 3)
    c = FakeConsumer(q, "r", {"x-stream-offset": "first"})
    q.add_consumer(c)
    _run(pending)
    q.reject(c.got[1][0], True)
    _run(pending)
    assert [(g[1], g[3]) for g in c.got] == [(0, False), (1, False), (2, False), (1, True)]
    assert c.got[-1][0] >> OFFSET_BITS == c.got[0][0] >> OFFSET_BITS
    q.close()


def test_filtering(tmp_path: Path) -> None:
    q, pending = _queue(tmp_path)
    values = ["a", "b", None, "a", "c"]
    _pub(q, 5, [{"x-stream-filter-value": v} if v else None for v in values])
    only_a = FakeConsumer(q, "fa", {"x-stream-offset": "first", "x-stream-filter": "a"})
    q.add_consumer(only_a)
    b_c_none = FakeConsumer(q, "fb", {"x-stream-offset": "first", "x-stream-filter": ["b", "c"],
                                     "x-stream-match-unfiltered": True})
    q.add_consumer(b_c_none)
    _run(pending)
    assert [g[1] for g in only_a.got] == [0, 3]
    assert [g[1] for g in b_c_none.got] == [1, 2, 4]
    q.close()


def test_vhost_declares_streams(tmp_path: Path) -> None:
    from broker.model.vhost import VHost
    from broker.store.sink import NullSink

    def make() -> VHost:
        return VHost("/", tmp_path / "data", segment_size=4096, sink=NullSink(), schedule=lambda cb: None,
                     mark_dirty=lambda obj: None, transient_root=tmp_path / "tmp")

    vh = make()
    with pytest.raises(errors.PreconditionFailed):
        vh.declare_queue("s", durable=False, arguments={"x-queue-type": "stream"}, owner=None)
    with pytest.raises(errors.PreconditionFailed):
        vh.declare_queue("s", durable=True, arguments={"x-queue-type": "stream", "x-max-age": "soon"},
                         owner=None)
    q, created = vh.declare_queue("s", durable=True, arguments={"x-queue-type": "stream"}, owner=None)
    assert created and isinstance(q, StreamQueue)
    _pub(q, 3)
    vh.close()
    vh = make()  # the definitions log replays the declare: a stream again, with its data
    q2 = vh.queues["s"]
    assert isinstance(q2, StreamQueue) and q2.message_count == 3
    vh.close()


def test_publisher_sequence_survives_a_kill_before_any_sync(tmp_path: Path) -> None:
    """A named publisher's sequence is written in order with the log, so a process killed after
    storing messages and before the sync that rewrites the offsets file (what kill -9 leaves:
    the writes in the page cache, no sync) still deduplicates them when the client resends."""
    q, _ = _queue(tmp_path)
    _pub(q, 3)
    q.set_publisher_sequence("app", 3)
    _pub(q, 2)
    q.set_publisher_sequence("app", 5)
    q.set_publisher_sequence("other", 1)
    # reopened as after kill -9: the first store was neither synced nor closed
    again = StreamStore(tmp_path / "s", segment_size=1024)
    assert again.next_offset == 5
    assert again.stored_offset("\x00publisher:app") == 5 and again.stored_offset("\x00publisher:other") == 1
    again.close()
    q.close()


def test_publisher_sequence_whose_messages_were_lost_is_ignored(tmp_path: Path) -> None:
    """A sequence record is kept only if the log holds the messages it covers (its end offset),
    and a torn record at the end is cut off."""
    store = StreamStore(tmp_path / "s", segment_size=1024)
    store.append(1, b"", b"k", b"\x00\x00", b"m")
    store.store_sequence("p", 1)
    store.close()
    path = tmp_path / "s" / sequences.NAME
    good = path.read_bytes()
    path.write_bytes(good + sequences.encode("p", 9, 2) + sequences.encode("p", 10, 1)[:-3])
    s = StreamStore(tmp_path / "s", segment_size=1024)
    assert s.stored_offset("p") == 1  # offset 2 was never stored: the record for 9 is not believed
    assert path.read_bytes() == good + sequences.encode("p", 9, 2)  # the torn record is gone
    s.close()


def test_publisher_sequences_file_is_compacted_and_still_read(tmp_path: Path) -> None:
    """Past ``COMPACT_MIN`` records (and four per name) the sequences file is rewritten with one
    record per name; reopened without a sync, the store still has every latest sequence."""
    store = StreamStore(tmp_path / "s")
    for i in range(1, sequences.COMPACT_MIN + 10):
        store.append(1, b"", b"k", b"\x00\x00", b"m")
        store.store_sequence("a", i)
    store.store_sequence("b", 7)
    path = tmp_path / "s" / sequences.NAME
    records, end = sequences.decode(path.read_bytes())
    assert end == path.stat().st_size and len(records) < 20  # compacted, then appended to
    again = StreamStore(tmp_path / "s")  # as after kill -9: the first store never synced
    assert (again.stored_offset("a"), again.stored_offset("b")) == (sequences.COMPACT_MIN + 9, 7)
    again.close()
    store.close()
