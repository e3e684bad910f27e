"""Memory layout: what a declared queue, an empty store and a queued message cost in RAM.

The product targets (100k declared queues under 300 MB, 10M queued messages under 100 MB)
are measured against a real broker with ``skred-perf``; these unit tests pin the layout that
makes them reachable, with tracemalloc (Python heap only, deterministic) and bounds far
enough above today's numbers that allocator noise cannot flake them, yet well below what
the old layout cost (about 3.4 KB per declared queue, 2.3 KB per empty store).
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.model.exchange import Exchange
from broker.model.publish import PublishRequest
from broker.model.vhost import VHost
from broker.store.queue_store import QueueStore
from broker.store.sink import NullSink

PERSISTENT_PROPS = b"\x10\x00\x02"  # flags: delivery-mode present; delivery-mode 2


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


# A block this large is a process-wide table growing (the interned-strings dict doubles when
# pathlib interns the 1,000th new name part, and when it does depends on what ran before in this
# interpreter), not something a queue or a message owns; it is left out of the growth.
SHARED_TABLE_BYTES = 256 * 1024


def _heap_growth(make: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes the Python heap grew by while ``make`` ran (result kept alive), not counting single
    blocks of SHARED_TABLE_BYTES or more."""
    gc.collect()
    before = tracemalloc.take_snapshot()
    result = make()
    gc.collect()
    after = tracemalloc.take_snapshot()
    grown = sum(st.size_diff for st in after.compare_to(before, "lineno")
                if not (st.count and st.size // st.count >= SHARED_TABLE_BYTES))
    return grown, result


def _vhost(tmp: Path) -> VHost:
    return VHost("/", tmp / "data", segment_size=64 * 1024, sink=NullSink(),
                 schedule=lambda cb: None, mark_dirty=lambda _obj: None,
                 transient_root=tmp / "transient")


@pytest.mark.parametrize("durable", [True, False])
def test_declared_queue_costs_under_2200_bytes(tmp_path: Path, traced: None, durable: bool) -> None:
    vh = _vhost(tmp_path)
    for i in range(50):  # warm up: first-use caches and dict growth are not per queue
        vh.declare_queue(f"warm{i}", durable=durable, owner=None)
    n = 1000

    def declare() -> None:
        for i in range(n):
            vh.declare_queue(f"queue-{i:06d}", durable=durable, owner=None)

    grown, _ = _heap_growth(declare)
    assert len(vh.queues) == n + 50
    assert grown / n < 2200, f"{grown / n:.0f} bytes per declared queue"
    vh.close()


def test_empty_queue_store_costs_under_1300_bytes(tmp_path: Path, traced: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    n = 500
    # relative paths: a store keeps its paths, and how long the temp dir's name is (a pytest-xdist
    # worker's is 10 characters longer) is no part of what a store costs
    monkeypatch.chdir(tmp_path)
    grown, stores = _heap_growth(lambda: [QueueStore(Path(f"q{i}")) for i in range(n)])
    # 1,222 B with the crash-recovery state (clean-close flag, open-meta fsync, delivery counts)
    assert grown / n < 1300, f"{grown / n:.0f} bytes per empty QueueStore"
    for s in stores:
        s.close()


def test_ready_messages_hold_no_per_message_objects(tmp_path: Path, traced: None) -> None:
    n = 20_000
    store = QueueStore(tmp_path / "q", segment_size=64 * 1024, persistent_only=True)

    def fill() -> None:
        for _ in range(n):
            store.append(1, b"", b"q", PERSISTENT_PROPS, b"x" * 16)

    grown, _ = _heap_growth(fill)
    assert store.ready_count == n
    # ~14 segments of bookkeeping, nothing per message (a set entry alone would be > 8 B)
    assert grown / n < 8, f"{grown / n:.1f} bytes per ready message"
    store.close()

    grown, reopened = _heap_growth(
        lambda: QueueStore(tmp_path / "q", segment_size=64 * 1024, persistent_only=True))
    assert reopened.ready_count == n
    assert grown / n < 8, f"{grown / n:.1f} bytes per recovered ready message"
    reopened.close()


def test_stores_do_not_share_their_lazily_allocated_sets(tmp_path: Path) -> None:
    a = QueueStore(tmp_path / "a")
    b = QueueStore(tmp_path / "b")
    with pytest.raises(KeyError):
        a.ack(123)  # nothing unacked before the first segment exists
    assert a.peek() is None and a.shift() is None
    a.flush()
    a.sync(full=True)  # no segment yet: the stand-in sets are only read and cleared
    msgid = a.append(1, b"", b"a", PERSISTENT_PROPS, b"body")
    assert a.shift() == msgid
    assert (a.unacked_count, b.unacked_count) == (1, 0)
    a.requeue(msgid)
    assert a.is_redelivered(msgid) and not b.is_redelivered(msgid)
    assert a.shift() == msgid
    a.ack(msgid)
    a.sync(full=True)
    assert (a.ready_count, a.unacked_count) == (0, 0)
    b.append(1, b"", b"b", PERSISTENT_PROPS, b"body")
    assert (b.ready_count, a.ready_count) == (1, 0)
    a.close()
    b.close()


def test_recovered_store_allocates_its_sets(tmp_path: Path) -> None:
    store = QueueStore(tmp_path / "q", persistent_only=True)
    first = store.append(1, b"", b"q", PERSISTENT_PROPS, b"one")
    store.append(1, b"", b"q", PERSISTENT_PROPS, b"two")
    store.close()
    again = QueueStore(tmp_path / "q", persistent_only=True)
    assert again.shift() == first  # recovery found a segment: .add on the unacked set works
    again.ack(first)
    assert (again.ready_count, again.unacked_count) == (1, 0)
    assert again.directory == tmp_path / "q"
    again.close()


class _Named:
    """A destination with a ``name``, as queues have."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_default_exchange_keeps_only_the_routing_entry(traced: None) -> None:
    ex = Exchange("", "direct")
    warm = [_Named(f"w{i}") for i in range(50)]
    for d in warm:
        ex.bind(d, d.name)
    n = 5000
    dests = [_Named(f"queue-{i:06d}") for i in range(n)]

    def bind_all() -> None:
        for d in dests:
            assert ex.bind(d, d.name)

    grown, _ = _heap_growth(bind_all)
    assert grown / n < 256, f"{grown / n:.0f} bytes per default-exchange binding"


def test_default_exchange_bindings_are_synthesised_in_order() -> None:
    ex = Exchange("", "direct")
    a, b, c = _Named("a"), _Named("b"), _Named("c")
    for d in (a, b, c):
        assert ex.bind(d, d.name)
    assert not ex.bind(a, "a")  # already bound
    assert ex.bindings() == [(a, "a", {}), (b, "b", {}), (c, "c", {})]
    assert list(ex.route("b", lambda: None)) == [b]
    assert list(ex.route("nope", lambda: None)) == []
    assert ex.unbind_all(b) == 1
    assert ex.unbind_all(b) == 0
    assert ex.bindings() == [(a, "a", {}), (c, "c", {})]
    assert list(ex.route("b", lambda: None)) == []
    assert not ex.unbind(c, "a")  # a different queue's name
    assert ex.unbind(c, "c")
    assert ex.has_bindings()
    assert ex.unbind_all("unnamed destination") == 0
    ex.unbind_all(a)
    assert not ex.has_bindings() and ex.bindings() == []
    with pytest.raises(ValueError):
        ex.bind(a, "a", {"x-match": "all"})


def test_vhost_default_exchange_lists_every_queue(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    for name in ("one", "two", "three"):
        vh.declare_queue(name, durable=True, owner=None)
    listed = [(getattr(d, "name", None), rk, args) for d, rk, args in vh.exchanges[""].bindings()]
    assert listed == [("one", "one", {}), ("two", "two", {}), ("three", "three", {})]
    vh.delete_queue("two", owner=None)
    assert [rk for _, rk, _ in vh.exchanges[""].bindings()] == ["one", "three"]
    assert [q.name for q in vh.publish(PublishRequest("", "three", b"\x00\x00", b"m", 0)).queues] == ["three"]
    assert vh.publish(PublishRequest("", "two", b"\x00\x00", b"m", 0)).unroutable
    vh.declare_queue("two", durable=False, owner=None)  # same name again: bound again, last
    assert [rk for _, rk, _ in vh.exchanges[""].bindings()] == ["one", "three", "two"]
    vh.close()
