"""Boot with many durable queues: no queue's directory is read until the queue is used.

Issue 26 item 6: a node with 50,000 queues took 107 s to start, nearly all of it reading
every queue's directory (a scandir and a meta read each). Not timed here (the machine is
shared): an audit hook counts the files and directories the boot opens inside queue
directories, which must be none however many queues there are, and differential tests check
that a store recovered late (on first use, or by the node's reader) holds exactly what one
recovered at once holds: messages, order, acks, the redelivered flags, after a clean stop
and after a crash.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands
from pamqp import frame as pframe

from broker.errors import StoreError
from broker.model import definition_records
from broker.model.publish import PublishRequest
from broker.model.vhost import VHost
from broker.store.paths import queue_dir
from broker.store.queue_store import DeferredQueueStore, QueueStore, read_ahead
from broker.store.segment_log import SegmentFiles
from broker.store.sink import NullSink

PERSISTENT = b"\x10\x00\x02"  # flags: delivery-mode present; delivery-mode 2
_TOUCHING = {"open", "os.scandir", "os.listdir", "os.mkdir", "os.remove", "os.rename", "os.truncate"}


class _Touches:
    """Paths that file-system audit events named while ``armed`` (one hook per process: an
    audit hook cannot be removed, so it stays installed and idle between tests)."""

    def __init__(self) -> None:
        self.armed = False
        self.paths: list[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if self.armed and event in _TOUCHING and args and isinstance(args[0], str | bytes | os.PathLike):
            self.paths.append(os.fsdecode(args[0]))

    def inside(self, directories: list[Path]) -> list[str]:
        roots = [str(d) + os.sep for d in directories]
        return [p for p in self.paths if any(p.startswith(r) or p + os.sep == r for r in roots)]


_TOUCHES = _Touches()


@pytest.fixture
def touches() -> Iterator[_Touches]:
    _TOUCHES.paths = []
    _TOUCHES.armed = True
    try:
        yield _TOUCHES
    finally:
        _TOUCHES.armed = False


def _vhost(data: Path, files: SegmentFiles | None = None) -> VHost:
    return VHost("/", data, segment_size=64 * 1024, sink=NullSink(), schedule=lambda cb: None,
                 mark_dirty=lambda _obj: None, transient_root=data.parent / "transient", files=files)


def _name(i: int) -> str:
    return f"q{i:04d}"


def _fill(data: Path, queues: int, stop: str = "crash") -> dict[str, list[bytes]]:
    """``queues`` durable queues, every 10th bound to amq.direct, every 7th with five
    persistent messages of which the first two were got and the first acked, then a
    ``clean`` stop or a ``crash`` (nothing closed: what was written stays, as after kill -9);
    returns the bodies each queue holds unacked."""
    vh = _vhost(data)
    left: dict[str, list[bytes]] = {}
    for i in range(queues):
        q, _ = vh.declare_queue(_name(i), durable=True, owner=None)
        if i % 10 == 0:
            vh.bind_queue(_name(i), "amq.direct", _name(i), {}, owner=None)
        if i % 7 == 0:
            for k in range(5):
                vh.publish(PublishRequest("", _name(i), PERSISTENT, b"%s-%d" % (_name(i).encode(), k), 0))
            first = q.get()
            assert first is not None and q.get() is not None
            q.ack(first[0])
            left[_name(i)] = [b"%s-%d" % (_name(i).encode(), k) for k in range(1, 5)]
    for q in vh.queues.values():
        q.store.sync(True)
    vh.definitions.sync()
    if stop == "clean":
        vh.close()
    return left


def _contents(vh: VHost) -> dict[str, list[tuple[bytes, bool]]]:
    """Every queue's messages as (body, redelivered), got and acked in order."""
    out: dict[str, list[tuple[bytes, bool]]] = {}
    for name in sorted(vh.queues):
        q = vh.queues[name]
        got = []
        while (m := q.get()) is not None:
            got.append((bytes(m[4]), m[5]))
            q.ack(m[0])
        out[name] = got
    return out


@pytest.mark.parametrize("queues", [60, 240])
def test_boot_reads_no_queue_directory(tmp_path: Path, touches: _Touches, queues: int) -> None:
    data = tmp_path / "data"
    _fill(data, queues)  # left as after kill -9
    touches.paths.clear()
    files = SegmentFiles()
    vh = _vhost(data, files)
    dirs = [queue_dir(vh.dir, _name(i)) for i in range(queues)]
    assert len(vh.queues) == queues
    assert touches.inside(dirs) == [], "boot read queue directories"
    assert len(touches.paths) <= 10  # the vhost's own files, whatever the queue count
    assert len(files.deferred) == queues
    assert all(type(q.store) is DeferredQueueStore for q in vh.queues.values())
    # the bindings came back without reading anything either
    assert sorted(d.name for d, _rk, _a in vh.exchanges["amq.direct"].bindings()) == \
        [_name(i) for i in range(0, queues, 10)]
    vh.close()  # a store never read has nothing to write: the stop reads and writes nothing
    assert touches.inside(dirs) == [], "a clean stop touched queues nobody used"


@pytest.mark.parametrize("stop", ["clean", "crash"])
def test_late_recovery_finds_what_boot_recovery_found(tmp_path: Path, stop: str) -> None:
    data = tmp_path / "data"
    left = _fill(data, 50, stop)
    copies = {how: tmp_path / how for how in ("first-use", "reader")}
    for copy in copies.values():
        shutil.copytree(data, copy / "data")
    # first use: get() reads each store when the queue is asked for its first message
    first_use = _contents(_vhost(copies["first-use"] / "data"))
    # the node's reader: every store read before anything else asks
    files = SegmentFiles()
    vh = _vhost(copies["reader"] / "data", files)
    while files.open_deferred(7):
        pass
    assert not any(isinstance(q.store, DeferredQueueStore) for q in vh.queues.values())
    assert {n: q.message_count for n, q in vh.queues.items() if q.message_count} == \
        {n: len(b) for n, b in left.items()}
    by_reader = _contents(vh)
    assert first_use == by_reader
    assert {n: [b for b, _r in m] for n, m in by_reader.items() if m} == left
    # the second message of each was delivered (and not acked) before the stop: it comes
    # back redelivered; after a crash, as RabbitMQ does, everything recovered does
    for got in by_reader.values():
        if got:
            assert got[0][1] is True
            assert all(r for _b, r in got) is (stop == "crash")


def test_first_use_of_any_kind_reads_the_store(tmp_path: Path) -> None:
    data = tmp_path / "data"
    left = _fill(data, 15)
    vh = _vhost(data)
    q0 = vh.queues[_name(0)]
    assert q0.message_count == len(left[_name(0)])  # a counter reads it: never a wrong 0
    assert type(q0.store) is QueueStore
    q7 = vh.queues[_name(7)]
    assert vh.publish(PublishRequest("", _name(7), PERSISTENT, b"new", 0)).queues == [q7]
    assert q7.message_count == len(left[_name(7)]) + 1
    q14 = vh.queues[_name(14)]
    assert vh.delete_queue(_name(14), owner=None) == len(left[_name(14)])
    assert not queue_dir(vh.dir, _name(14)).exists()
    assert q14.deleted
    untouched = queue_dir(vh.dir, _name(3))
    vh.delete_queue(_name(3), owner=None)  # deleting an unread queue needs nothing read
    assert not untouched.exists()


def test_a_corrupt_store_closes_its_queue_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    left = _fill(data, 15, "clean")
    bad = queue_dir(_vhost(data).dir, _name(7))
    segment = next(bad.glob("msgs.*"))
    segment.write_bytes(b"\x63\x00\x00\x00" + segment.read_bytes()[4:])  # an unknown format version
    files = SegmentFiles()
    vh = _vhost(data, files)
    with caplog.at_level(logging.ERROR):
        while files.open_deferred(4):
            pass
    assert "cannot be recovered" in caplog.text
    assert vh.queues[_name(7)].message_count == 0
    with pytest.raises(StoreError):
        vh.publish(PublishRequest("", _name(7), PERSISTENT, b"x", 0))
    assert vh.queues[_name(0)].message_count == len(left[_name(0)])
    vh.close()


def _declare_record(name: str, bits: int) -> bytes:
    """A queue.declare record with a name pamqp's encoder refuses (beyond its ASCII set)."""
    raw = name.encode()
    payload = struct.pack(">HHH", 50, 10, 0) + bytes([len(raw)]) + raw + bytes([bits]) + b"\0\0\0\0"
    return struct.pack(">BHI", 1, 0, len(payload)) + payload + b"\xce"


@pytest.mark.parametrize("record", [
    pframe.marshal(commands.Queue.Declare(queue="plain", durable=True), 0),
    _declare_record("ü ✓ \"<q>\" 🐇", 2 | 8),
    _declare_record("é" * 127, 31),
    pframe.marshal(commands.Queue.Declare(queue="args", durable=True, arguments={"x-max-length": 5}), 0),
    pframe.marshal(commands.Queue.Declare(queue="", durable=True), 0),
    pframe.marshal(commands.Queue.Bind(queue="q", exchange="amq.topic", routing_key="a.#"), 0),
    pframe.marshal(commands.Queue.Bind(queue="q", exchange="ex", routing_key="", nowait=True), 0),
    pframe.marshal(commands.Queue.Bind(queue="q", exchange="h", routing_key="k",
                                       arguments={"x-match": "all"}), 0),
    pframe.marshal(commands.Queue.Delete(queue="q"), 0),
    pframe.marshal(commands.Exchange.Declare(exchange="e", exchange_type="topic", durable=True), 0),
])
def test_definition_records_read_as_pamqp_reads_them(record: bytes) -> None:
    ours = definition_records.decode(record)
    _, _, theirs = pframe.unmarshal(record)
    assert type(ours) is type(theirs)
    fields = theirs.__slots__
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}


def test_damaged_definition_records_fail_as_in_pamqp() -> None:
    record = pframe.marshal(commands.Queue.Declare(queue="plain", durable=True), 0)
    for damaged in (record[:-1] + b"\x00", record[:-3] + b"\xce", record[:9], b"\xff" + record[1:]):
        try:
            pframe.unmarshal(damaged)
        except Exception as exc:  # noqa: BLE001 - whatever pamqp raises, ours must too
            with pytest.raises(type(exc)):
                definition_records.decode(damaged)
        else:
            definition_records.decode(damaged)


def test_read_ahead_reads_only(tmp_path: Path) -> None:
    """The node's read-ahead thread (``queue_store.read_ahead``) warms caches and nothing else:
    no file changes, no store is recovered by it, a vanished directory is skipped, and it stops
    when told."""
    data = tmp_path / "data"
    _fill(data, 20, "clean")
    files = SegmentFiles()
    vh = _vhost(data, files)
    dirs = files.deferred_dirs()
    assert len(dirs) == 20
    shutil.rmtree(dirs[3])
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in data.rglob("*")}
    stop = threading.Event()
    assert read_ahead(dirs, stop) == 20
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in data.rglob("*")} == before
    assert len(files.deferred) == 20 and all(type(q.store) is DeferredQueueStore for q in vh.queues.values())
    stop.set()
    assert read_ahead(dirs, stop) == 0


def test_the_rates_sampler_leaves_unread_stores_unread(tmp_path: Path, touches: _Touches) -> None:
    """The management API's statistics pass runs within seconds of boot: reading each queue's
    counts must not recover every store then (10,000 MQTT sessions took 16 s to come back)."""
    from broker.amqp.broker import Stats
    from broker.http.rates import RateSampler

    class _Broker:
        def __init__(self, vh: VHost) -> None:
            self.vhosts = {"/": vh}
            self.stats = Stats()
            self.connections: set[Any] = set()

    data = tmp_path / "data"
    _fill(data, 30)
    files = SegmentFiles()
    vh = _vhost(data, files)
    touches.paths.clear()
    sampler = RateSampler(_Broker(vh))  # type: ignore[arg-type]
    sampler.sample()
    sampler.sample()
    dirs = [queue_dir(vh.dir, _name(i)) for i in range(30)]
    assert touches.inside(dirs) == [], "the sampler read queue directories"
    assert all(type(q.store) is DeferredQueueStore for q in vh.queues.values())
    # once a store is read the sampler counts it as it counts any queue
    q = vh.queues[_name(7)]
    assert q.message_count == 4
    sampler.sample()
    assert sampler.queue_rates(q)["ready"] == 0.0  # no made-up rate from the late first sight
    vh.close()
