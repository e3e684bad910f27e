"""Recovery of a QueueStore from its files: clean restarts, kill -9, torn and corrupt files."""

from __future__ import annotations

import array
import gc
import struct
from pathlib import Path

import pytest

from broker.errors import StoreError
from broker.store.queue_store import QueueStore

PERSISTENT = struct.pack(">HB", 0x1000, 2)
TRANSIENT = struct.pack(">HB", 0x1000, 1)
# content-type, content-encoding and headers present before delivery-mode.
PERSISTENT_FULL = (struct.pack(">H", 0x8000 | 0x4000 | 0x2000 | 0x1000)
                   + b"\x10application/json" + b"\x04gzip"
                   + struct.pack(">I", 7) + b"\x01xS\x00\x00\x00\x00" + b"\x02")
NO_DELIVERY_MODE = struct.pack(">H", 0x8000) + b"\x04text"


def fill(store: QueueStore, n: int, props: bytes = PERSISTENT, start: int = 0) -> list[int]:
    return [store.append(1000 + i, b"ex", b"rk", props, b"body-%d" % i) for i in range(start, start + n)]


def drain(store: QueueStore) -> list[int]:
    out = []
    while (m := store.shift()) is not None:
        out.append(m)
    return out


def bodies(store: QueueStore, ids: list[int]) -> list[bytes]:
    return [store.read(m)[4] for m in ids]


def kill(store: QueueStore) -> None:
    """Simulate kill -9: abandon the object without flushing or closing anything.

    Its mappings and fds stay open while the next instance recovers, as the page cache
    does for a killed process; the caller then drops its last reference.
    """
    gc.collect()


def seg_files(qdir: Path) -> list[Path]:
    return sorted(qdir.glob("msgs.*"))


def test_clean_restart_keeps_ready_and_requeues_unacked(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    ids = fill(store, 6)
    assert drain(store)[:3] == ids[:3]
    store.requeue(ids[5])  # requeued ones also survive as ready
    store.ack(ids[0])
    store.ack(ids[1])
    store.close()
    store = QueueStore(qdir)
    assert store.ready_count == 4 and store.unacked_count == 0
    assert store.bytes_ready == sum(len(b"body-%d" % i) for i in range(2, 6))
    again = drain(store)
    assert again == ids[2:]
    assert bodies(store, again) == [b"body-%d" % i for i in range(2, 6)]
    store.close()


def test_kill_without_close(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir, segment_size=4096)
    ids = fill(store, 100)
    for _ in range(40):
        m = store.shift()
        assert m is not None
        store.ack(m)
    store.flush()  # these 40 acks reached the page cache
    for _ in range(10):
        m = store.shift()
        assert m is not None
        store.ack(m)  # ...these 10 stay buffered in memory and die with the process
    kill(store)
    store = QueueStore(qdir, segment_size=4096)
    back = drain(store)
    assert back == ids[40:]  # at-least-once: unflushed acks mean redelivery
    assert bodies(store, back) == [b"body-%d" % i for i in range(40, 100)]
    # New appends after the recovered data are readable, also after another kill.
    more = fill(store, 5, start=100)
    kill(store)
    store = QueueStore(qdir, segment_size=4096)
    assert drain(store) == ids[40:] + more
    store.close()


def test_torn_append_is_dropped(tmp_path: Path) -> None:
    """A record whose timestamp was not yet written (killed mid-append) is not there."""
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    ids = fill(store, 3)
    kill(store)
    seg = seg_files(qdir)[0]
    with open(seg, "r+b") as f:  # un-publish the last record: timestamp back to 0
        f.seek(ids[2] & 0xFFFFFFFF)
        f.write(b"\0" * 8)
    store = QueueStore(qdir)
    assert store.ready_count == 2
    # New messages are never written after the torn bytes (a fresh segment); on a single
    # node the tail is left in place (recovery stops at the zero timestamp every time).
    new = fill(store, 2, start=10)
    store.close()
    store = QueueStore(qdir)
    assert bodies(store, drain(store)) == [b"body-0", b"body-1", b"body-10", b"body-11"]
    assert new[0] > ids[1]
    store.close()


def test_failed_append_leaves_no_garbage(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    ids = fill(store, 1)
    wide = memoryview(array.array("I", [0xFFFFFFFF] * 64))  # len() 64, but 256 bytes
    with pytest.raises((ValueError, IndexError)):
        store.append(1, b"ex", b"rk", PERSISTENT, wide)
    ids += fill(store, 1, start=1)  # a shorter record over the failed one
    kill(store)
    store = QueueStore(qdir)
    assert drain(store) == ids
    assert store.ready_count == 0 and store.unacked_count == 2
    store.close()


@pytest.mark.parametrize("chop", [1, 3, 9, 20])
def test_truncated_segment(tmp_path: Path, chop: int) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    ids = fill(store, 5)
    store.close()
    seg = seg_files(qdir)[0]
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size - chop)
    store = QueueStore(qdir)
    assert store.ready_count == 4
    assert drain(store) == ids[:4]
    fill(store, 1, start=7)
    store.close()
    store = QueueStore(qdir)
    assert bodies(store, drain(store)) == [b"body-%d" % i for i in (0, 1, 2, 3, 7)]
    store.close()


def test_garbage_length_is_not_fatal(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    ids = fill(store, 3)
    store.close()
    seg = seg_files(qdir)[0]
    pos = ids[1] & 0xFFFFFFFF
    with open(seg, "r+b") as f:  # an absurd body size in the second record
        data = bytearray(f.read())
        body_size_at = pos + 8 + 1 + 2 + 1 + 2 + 4 + len(PERSISTENT)
        data[body_size_at:body_size_at + 8] = struct.pack("<Q", 1 << 40)
        f.seek(0)
        f.write(data)
    store = QueueStore(qdir)
    assert drain(store) == ids[:1]
    store.close()


def test_ack_positions_beyond_data_end_are_dropped(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    ids = fill(store, 4)
    assert store.shift() == ids[0]
    store.ack(ids[0])
    store.close()
    ack_file = next(qdir.glob("acks.*"))
    end = seg_files(qdir)[0].stat().st_size
    bogus = [end, end + 100, (ids[1] & 0xFFFFFFFF) + 1]  # past the end, off a record start
    with open(ack_file, "ab") as f:
        f.write(b"".join(struct.pack("<I", p) for p in bogus) + b"\x07\x00")  # + a torn entry
    store = QueueStore(qdir)
    assert store.ready_count == 3
    assert drain(store) == ids[1:]
    # The ack file was rewritten without the bogus entries.
    positions = {p for (p,) in struct.iter_unpack("<I", ack_file.read_bytes()[4:])}
    assert positions == {ids[0] & 0xFFFFFFFF}
    store.close()


def test_missing_or_garbage_meta(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    ids = fill(store, 3)
    store.shift()
    store.close()
    (qdir / "meta").unlink()
    store = QueueStore(qdir)
    assert drain(store) == ids
    assert store.is_redelivered(ids[2])  # no meta: not closed cleanly, any may have been delivered
    store.close()
    (qdir / "meta").write_bytes(b"\xffgarbage" * 5)
    store = QueueStore(qdir)
    assert store.ready_count == 3
    store.close()


def test_redelivered_after_restart(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir, segment_size=4096)
    ids = fill(store, 6)
    store.shift()
    store.shift()
    store.close()  # closed cleanly: the mark is exact
    store = QueueStore(qdir, segment_size=4096)
    assert drain(store) == ids
    assert [store.is_redelivered(m) for m in ids] == [True, True, False, False, False, False]
    store.close()
    # Now all six were delivered before this restart.
    store = QueueStore(qdir, segment_size=4096)
    assert all(store.is_redelivered(m) for m in drain(store))
    for m in ids:
        store.ack(m)
    new = fill(store, 2, start=6)
    store.close()
    store = QueueStore(qdir, segment_size=4096)
    assert drain(store) == new
    assert not any(store.is_redelivered(m) for m in new)
    store.close()


@pytest.mark.parametrize("synced", [False, True])
def test_delivered_before_a_kill_come_back_redelivered(tmp_path: Path, synced: bool) -> None:
    """The mark on disk lags deliveries by up to the sync window, so after a crash every
    recovered message counts as delivered; and a store that was closed cleanly stops
    saying so on disk before it delivers anything again."""
    qdir = tmp_path / "q"
    store = QueueStore(qdir, segment_size=4096)
    ids = fill(store, 6)
    store.close()
    store = QueueStore(qdir, segment_size=4096)
    assert not store.is_redelivered(ids[0])
    assert store.shift() == ids[0]  # delivered; the mark is not written (no sync) ...
    if synced:
        store.sync()
    kill(store)  # ... and the process dies
    store = QueueStore(qdir, segment_size=4096)
    assert drain(store) == ids
    assert all(store.is_redelivered(m) for m in ids)
    new = fill(store, 2, start=6)  # new messages sort after the recovered ones
    assert not any(store.is_redelivered(m) for m in new)
    store.close()
    # A store never closed cleanly (a replica's copy, a crash before any sync) likewise.
    other = tmp_path / "r"
    store = QueueStore(other, segment_size=4096)
    more = fill(store, 3)
    store.sync()
    kill(store)
    store = QueueStore(other, segment_size=4096)
    assert all(store.is_redelivered(m) for m in drain(store)) and drain(store) == []
    assert more
    store.close()


def test_new_segments_sort_after_delivered_mark_when_all_deleted(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir, segment_size=4096)
    ids = fill(store, 3)
    drain(store)
    for m in ids:
        store.ack(m)
    store.close()
    store = QueueStore(qdir, segment_size=4096)  # the fully acked segment is deleted here
    assert seg_files(qdir) == []
    new = fill(store, 1)
    assert new[0] > ids[-1] and not store.is_redelivered(new[0])
    store.close()


def test_fully_acked_segments_deleted_at_recovery(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir, segment_size=4096)
    ids = fill(store, 200)
    got = drain(store)
    last_seg = ids[-1] >> 32
    for m in got:
        if m >> 32 == last_seg:
            store.ack(m)  # the write segment is fully acked but cannot be deleted yet
    store.close()
    assert (qdir / f"msgs.{last_seg:010d}").exists()
    store = QueueStore(qdir, segment_size=4096)
    assert not (qdir / f"msgs.{last_seg:010d}").exists()
    assert not (qdir / f"acks.{last_seg:010d}").exists()
    assert drain(store) == [m for m in ids if m >> 32 != last_seg]
    store.close()


def test_orphan_ack_file_and_empty_new_segment_are_removed(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    ids = fill(store, 2)
    store.close()
    (qdir / "acks.0000000099").write_bytes(struct.pack("<II", 1, 4))
    (qdir / "msgs.0000000100").write_bytes(b"\0" * 4096)  # killed right after ftruncate
    store = QueueStore(qdir)
    assert not (qdir / "acks.0000000099").exists()
    assert not (qdir / "msgs.0000000100").exists()
    assert drain(store) == ids
    store.close()


def test_wrong_version_raises_store_error(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir)
    fill(store, 1)
    store.close()
    seg = seg_files(qdir)[0]
    data = bytearray(seg.read_bytes())
    data[0:4] = struct.pack("<I", 7)
    seg.write_bytes(data)
    with pytest.raises(StoreError, match="version 7"):
        QueueStore(qdir)


def test_persistent_only_drops_transient_messages(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    store = QueueStore(qdir, persistent_only=True)
    kinds = [PERSISTENT, TRANSIENT, PERSISTENT_FULL, NO_DELIVERY_MODE, b"", PERSISTENT]
    ids = [store.append(1, b"", b"", props, b"m%d" % i) for i, props in enumerate(kinds)]
    assert store.ready_count == 6  # dropping happens at recovery only
    store.close()
    store = QueueStore(qdir, persistent_only=True)
    assert drain(store) == [ids[0], ids[2], ids[5]]
    assert store.read(ids[2])[3] == PERSISTENT_FULL
    store.close()
    # The same files opened without the flag still hold everything.
    store = QueueStore(qdir)
    assert store.ready_count == 6
    store.close()


def test_merge_acks_from_a_replica(tmp_path: Path) -> None:
    """Acks another copy of the store holds: ready messages (at the cursor, ahead of it,
    requeued) go; a held one stays with its consumer; the result survives a restart."""
    qdir = tmp_path / "q"
    store = QueueStore(qdir, segment_size=4096)
    ids = fill(store, 10)
    first = store.shift()
    second = store.shift()
    assert (first, second) == (ids[0], ids[1])
    store.requeue(second)  # ready again, in the requeue heap
    num = ids[0] >> 32
    pos = [m & 0xFFFFFFFF for m in ids]
    assert store.merge_acks(num, [pos[0], pos[1], pos[4], pos[5], pos[5], 3, 10**6]) == 3
    assert store.ready_count == 10 - 1 - 3
    assert store.bytes_ready == sum(len(b"body-%d" % i) for i in (2, 3, 6, 7, 8, 9))
    assert store.merge_acks(num, [pos[4]]) == 0  # once
    assert drain(store) == [ids[2], ids[3], ids[6], ids[7], ids[8], ids[9]]
    store.ack(first)
    store.close()
    store = QueueStore(qdir, segment_size=4096)
    assert drain(store) == [ids[2], ids[3], ids[6], ids[7], ids[8], ids[9]]
    store.close()
