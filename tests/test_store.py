"""Unit tests of the message store in normal operation (recovery: test_store_recovery.py)."""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from broker.errors import DataDirLocked, StoreError
from broker.store.definitions import DefinitionsLog
from broker.store.jsonstore import read_json, write_json
from broker.store.lock import DataDirLock
from broker.store.paths import queue_dir, vhost_dir
from broker.store.queue_store import QueueStore
from broker.store.segment_log import RETIRED_OPEN, SegmentFiles
from broker.store.sink import NullSink

PERSISTENT = struct.pack(">HB", 0x1000, 2)
TRANSIENT = struct.pack(">HB", 0x1000, 1)


class MirrorSink:
    """Applies every reported mutation to an in-memory copy of the files."""

    active = True

    def __init__(self) -> None:
        self.files: dict[Path, bytearray] = {}
        self.ops: list[tuple[str, Path]] = []

    def register_file(self, path: Path) -> None:
        self.ops.append(("register", path))
        assert path not in self.files, f"registered twice: {path}"
        self.files[path] = bytearray()

    def append(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        self.ops.append(("append", path))
        self.files[path] += bytes(data)

    def replace(self, path: Path, data: bytes) -> None:
        self.ops.append(("replace", path))
        self.files[path] = bytearray(data)

    def delete(self, path: Path) -> None:
        self.ops.append(("delete", path))
        self.files.pop(path, None)

    async def wait_for_followers(self) -> None:
        pass

    def assert_mirrors(self, directory: Path, ignore: tuple[str, ...] = ()) -> None:
        on_disk = {p: p.read_bytes() for p in directory.iterdir() if p.is_file() and p.name not in ignore}
        mirrored = {p: bytes(b) for p, b in self.files.items() if p.parent == directory}
        assert sorted(on_disk) == sorted(mirrored)
        for path, data in on_disk.items():
            assert mirrored[path] == data, path


def body(i: int, size: int = 20) -> bytes:
    return (b"%08d" % i) * (size // 8) + b"x" * (size % 8)


def fill(store: QueueStore, n: int, size: int = 20, start: int = 0) -> list[int]:
    return [store.append(1000 + i, b"amq.direct", b"rk.%d" % i, PERSISTENT, body(i, size))
            for i in range(start, start + n)]


def drain(store: QueueStore) -> list[int]:
    out = []
    while (m := store.shift()) is not None:
        out.append(m)
    return out


def segments(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("msgs.*"))


# ---------------------------------------------------------------------- queue store


def test_append_shift_read_ack(tmp_path: Path) -> None:
    store = QueueStore(tmp_path / "q")
    ids = fill(store, 5)
    assert ids == sorted(ids) and len(set(ids)) == 5
    assert (store.ready_count, store.unacked_count, store.bytes_ready) == (5, 0, 100)
    assert store.peek() == ids[0]
    first = store.shift()
    assert first == ids[0]
    assert store.read(first) == (1000, b"amq.direct", b"rk.0", PERSISTENT, body(0))
    assert store.read_body_size(ids[3]) == 20
    assert (store.ready_count, store.unacked_count, store.bytes_ready) == (4, 1, 80)
    store.ack(first)
    assert store.unacked_count == 0
    with pytest.raises(KeyError):
        store.ack(first)
    assert drain(store) == ids[1:]
    assert store.shift() is None and store.peek() is None
    assert store.ready_count == 0 and store.unacked_count == 4
    store.close()


def test_read_returns_copies_and_accepts_buffers(tmp_path: Path) -> None:
    store = QueueStore(tmp_path / "q")
    msgid = store.append(5, b"", b"", memoryview(PERSISTENT), bytearray(b"abc"))
    ts, ex, rk, props, data = store.read(msgid)
    assert (ts, ex, rk, props, data) == (5, b"", b"", PERSISTENT, b"abc")
    assert all(type(x) is bytes for x in (ex, rk, props, data))
    store.close()


def test_zero_timestamp_and_long_names(tmp_path: Path) -> None:
    store = QueueStore(tmp_path / "q")
    msgid = store.append(0, b"e", b"r", b"", b"b")
    assert store.read(msgid)[0] != 0  # 0 marks the end of a segment, so it is never stored
    with pytest.raises(ValueError):
        store.append(1, b"e" * 256, b"r", b"", b"b")
    store.close()


def test_requeue_keeps_order_and_marks_redelivered(tmp_path: Path) -> None:
    store = QueueStore(tmp_path / "q")
    ids = fill(store, 5)
    taken = [store.shift() for _ in range(3)]
    assert taken == ids[:3]
    assert not any(store.is_redelivered(m) for m in ids)
    store.requeue(ids[2])
    store.requeue(ids[0])
    assert store.ready_count == 4 and store.unacked_count == 1
    assert store.bytes_ready == 80
    assert store.peek() == ids[0]
    assert drain(store) == [ids[0], ids[2], ids[3], ids[4]]
    assert store.is_redelivered(ids[0]) and store.is_redelivered(ids[2])
    assert not store.is_redelivered(ids[1]) and not store.is_redelivered(ids[3])
    for m in ids:
        store.ack(m)
    assert store.ready_count == store.unacked_count == 0
    store.close()


def test_rollover_and_deletion_of_acked_segments(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir, segment_size=4096)
    ids = fill(store, 300, size=40)  # ~80 bytes a record: several segments
    segs = sorted({m >> 32 for m in ids})
    assert len(segs) >= 5
    assert len(segments(qdir)) == len(segs)
    # Full segments are trimmed to their used size by the sync after the next one starts
    # (off the event loop: a truncate is a journal transaction).
    first = qdir / segments(qdir)[0]
    assert first.stat().st_size == 4096
    store.sync()
    assert first.stat().st_size < 4096
    got = drain(store)
    assert got == ids
    # Ack everything in the first segment except one message: it must stay.
    in_first = [m for m in ids if m >> 32 == segs[0]]
    for m in in_first[1:]:
        store.ack(m)
    assert first.exists()
    store.ack(in_first[0])
    store.removed()  # removal runs on the segment worker: wait for it
    assert not first.exists()
    assert not (qdir / first.name.replace("msgs", "acks")).exists()
    for m in ids:
        if m >> 32 != segs[0]:
            store.ack(m)
    # Only the write segment is left (never deleted while being written).
    store.removed()
    assert segments(qdir) == [f"msgs.{segs[-1]:010d}"]
    assert store.ready_count == store.unacked_count == 0
    # And the queue keeps working afterwards.
    more = fill(store, 3)
    assert drain(store) == more
    store.close()


def test_large_message_gets_its_own_segment(tmp_path: Path) -> None:
    store = QueueStore(tmp_path / "q", segment_size=4096)
    small = fill(store, 2)
    big_body = os.urandom(10_000)
    big = store.append(7, b"x", b"y", PERSISTENT, big_body)
    after = fill(store, 2)
    assert len({small[0] >> 32, big >> 32, after[0] >> 32}) == 3
    assert drain(store) == [*small, big, *after]
    assert store.read(big)[4] == big_body
    store.close()
    store = QueueStore(tmp_path / "q", segment_size=4096)
    assert drain(store) == [*small, big, *after]
    assert store.read(big)[4] == big_body
    store.close()


def test_purge(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir, segment_size=4096)
    ids = fill(store, 200, size=40)
    taken = [store.shift() for _ in range(10)]
    store.requeue(ids[3])
    assert store.ready_count == 191
    assert store.purge() == 191
    assert store.ready_count == 0 and store.bytes_ready == 0 and store.unacked_count == 9
    assert store.shift() is None
    # Segments holding only purged messages are gone already.
    store.removed()
    assert len(segments(qdir)) <= 2
    new = fill(store, 2)
    assert drain(store) == new
    store.close()
    store = QueueStore(qdir, segment_size=4096)
    # The 9 unacked (never acked) and 2 new ones come back; the purged ones never do.
    expect = [m for m in taken if m != ids[3]] + new
    assert drain(store) == expect
    store.close()


def test_sink_mirrors_every_mutation(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    sink = MirrorSink()
    store = QueueStore(qdir, segment_size=4096, sink=sink)
    ids = fill(store, 150, size=40)
    got = drain(store)
    for m in got[:120]:
        store.ack(m)
    store.requeue(got[130])
    store.flush()
    big = store.append(1, b"", b"", b"", b"z" * 9000)
    assert store.purge() > 0
    assert store.shift() is None
    store.close()
    assert big > ids[-1]
    sink.assert_mirrors(qdir)
    ops = {op for op, _ in sink.ops}
    assert ops == {"register", "append", "replace", "delete"}
    # Recovery that trims a corrupt tail is a mutation too.
    last = qdir / segments(qdir)[-1]
    with open(last, "r+b") as f:
        f.truncate(last.stat().st_size - 3)
    store = QueueStore(qdir, segment_size=4096, sink=sink)
    fill(store, 3)
    store.delete()
    assert not qdir.exists()
    assert not [p for p in sink.files if p.parent == qdir]


def test_null_sink_is_inactive() -> None:
    assert NullSink().active is False


def test_dirty_flag(tmp_path: Path) -> None:
    store = QueueStore(tmp_path / "q")
    seen = [store.dirty]
    m = fill(store, 1)[0]
    seen.append(store.dirty)
    store.sync()
    seen.append(store.dirty)
    assert store.shift() == m
    store.ack(m)
    seen.append(store.dirty)
    store.sync()
    seen.append(store.dirty)
    assert seen == [False, True, False, True, False]
    store.close()


def test_segments_rolled_between_syncs_keep_few_descriptors(tmp_path: Path) -> None:
    """Each rolled write segment waits for the next sync to be trimmed and fsynced; when
    segments roll faster than syncs come (a starved syncer under load), the waiting ones must
    not each hold a descriptor (the process ran out of them at 30,000 segments)."""
    fds = len(os.listdir("/proc/self/fd"))
    files = SegmentFiles()  # each mapping holds a descriptor (CPython's mmap keeps a dup)
    store = QueueStore(tmp_path / "q", segment_size=4096, files=files)
    ids = fill(store, 3000, size=100)  # about 100 segments, no sync in between
    assert len(os.listdir("/proc/self/fd")) - fds <= files.mapped + RETIRED_OPEN + 4
    store.sync()
    assert drain(store) == ids
    store.close()


def test_sync_from_a_thread_while_appending(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir, segment_size=4096)
    stop = threading.Event()
    errors: list[BaseException] = []
    syncs = 0

    def syncer() -> None:
        nonlocal syncs
        try:
            while not stop.is_set():
                store.sync()
                syncs += 1
        except BaseException as exc:  # reported to the main thread
            errors.append(exc)

    worker = threading.Thread(target=syncer)
    worker.start()
    deadline = time.monotonic() + 20
    ids: list[int] = []
    try:
        i = 0
        # Enough traffic for rollovers, acks and segment deletions to race with sync().
        while (len(ids) < 3000 or syncs < 20) and time.monotonic() < deadline:
            ids.extend(fill(store, 10, size=40, start=i))
            i += 10
            for _ in range(5):
                m = store.shift()
                assert m is not None
                store.ack(m)
    finally:
        stop.set()
        worker.join(10)
    assert not errors, errors
    assert syncs >= 1
    expected_left = ids[len(ids) // 2:]
    assert drain(store) == expected_left
    store.close()
    store = QueueStore(qdir, segment_size=4096)
    assert drain(store) == expected_left
    for m in expected_left:
        ts, _, rk, _, data = store.read(m)
        assert rk == b"rk.%d" % (ts - 1000) and data == body(ts - 1000, 40)
    store.close()


def test_closed_store_sync_is_noop_and_close_idempotent(tmp_path: Path) -> None:
    store = QueueStore(tmp_path / "q")
    fill(store, 1)
    store.close()
    store.sync()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        fill(store, 1)


def test_meta_written_on_sync(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    fill(store, 2)
    store.shift()
    store.sync()
    assert (qdir / "meta").is_file()
    store.close()


# ---------------------------------------------------------------------- definitions log


def test_definitions_log_roundtrip_compact_and_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "definitions.amqp"
    sink = MirrorSink()
    log = DefinitionsLog(path, sink)
    assert log.load() == []
    records = [b"declare-a", b"", b"bind-a" * 50, b"delete-a"]
    for r in records:
        log.append(r)
    assert log.appended_since_compact == 4
    log.sync()
    log.close()
    assert DefinitionsLog(path).load() == records
    sink.assert_mirrors(tmp_path)

    log = DefinitionsLog(path, sink)
    log.compact([b"bind-a"])
    assert log.appended_since_compact == 0
    log.append(b"declare-b")
    log.close()
    assert DefinitionsLog(path).load() == [b"bind-a", b"declare-b"]
    sink.assert_mirrors(tmp_path)

    # Torn last record: dropped by load, and appends continue after the last good record.
    with open(path, "ab") as f:
        f.write(struct.pack("<I", 100) + b"partial")
    log = DefinitionsLog(path, sink)
    assert log.load() == [b"bind-a", b"declare-b"]
    log.append(b"declare-c")
    log.close()
    assert DefinitionsLog(path).load() == [b"bind-a", b"declare-b", b"declare-c"]
    # Also when appending without loading first.
    with open(path, "ab") as f:
        f.write(b"\x05\x00")
    log = DefinitionsLog(path, sink)
    log.append(b"declare-d")
    log.close()
    assert DefinitionsLog(path).load() == [b"bind-a", b"declare-b", b"declare-c", b"declare-d"]
    sink.assert_mirrors(tmp_path)


def test_definitions_log_wrong_version(tmp_path: Path) -> None:
    path = tmp_path / "definitions.amqp"
    path.write_bytes(struct.pack("<I", 99))
    with pytest.raises(StoreError, match="version 99"):
        DefinitionsLog(path).load()


# ---------------------------------------------------------------------- json, lock, paths


def test_json_store(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    sink = MirrorSink()
    assert read_json(path, {"default": True}) == {"default": True}
    write_json(path, {"users": [{"name": "guest"}]}, sink)
    assert read_json(path, None) == {"users": [{"name": "guest"}]}
    assert sink.ops == [("replace", path)]
    assert bytes(sink.files[path]) == path.read_bytes()
    assert not (tmp_path / "users.json.tmp").exists()
    path.write_text("{not json")
    with pytest.raises(StoreError):
        read_json(path, {})


def test_data_dir_lock(tmp_path: Path) -> None:
    first = DataDirLock(tmp_path / "data")
    first.acquire()
    assert (tmp_path / "data" / ".lock").read_text().strip() == str(os.getpid())
    second = DataDirLock(tmp_path / "data")
    with pytest.raises(DataDirLocked, match=f"pid {os.getpid()}"):
        second.acquire()
    first.release()
    second.acquire()
    assert second.held
    second.release()


def test_paths(tmp_path: Path) -> None:
    v = vhost_dir(tmp_path, "/")
    assert v == tmp_path / hashlib.sha1(b"/").hexdigest()
    q = queue_dir(v, "tâche")
    assert q == v / hashlib.sha1("tâche".encode()).hexdigest()
    assert queue_dir(v, "a") != queue_dir(v, "b")
