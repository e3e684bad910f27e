"""Unit tests of the durable delivery counts (broker/store/delivery_counts.py) and the quorum
queues' two-level priority store, through ``QueueStore``/``QuorumPriorityStore``: no sockets."""

from __future__ import annotations

from pathlib import Path

from test_store import PERSISTENT, MirrorSink, drain, fill  # tests/ is on sys.path

from broker.store import delivery_counts
from broker.store.priority_store import QuorumPriorityStore
from broker.store.queue_store import QueueStore


def test_counts_survive_reopen_and_forget_acked_messages(tmp_path: Path) -> None:
    s = QueueStore(tmp_path, persistent_only=True)
    a, b, c = fill(s, 3)
    assert not s.counting and not (tmp_path / "counts").exists()  # nothing counted: no file
    drain(s)
    s.set_count(a, 1)
    s.set_count(a, 2)
    s.set_count(b, 5)
    s.set_count(c, 1)
    s.ack(c)  # acked: its count is dead, dropped at recovery
    s.forget_count(c)
    s.sync(True)
    s.close()  # a crash after the sync leaves the same files (kill -9 keeps written bytes)
    s = QueueStore(tmp_path, persistent_only=True)
    assert (s.count_of(a), s.count_of(b), s.count_of(c)) == (2, 5, 0)
    assert s.counting
    for m in drain(s):
        s.ack(m)
        s.forget_count(m)
    s.close()
    s = QueueStore(tmp_path, persistent_only=True)
    assert not s.counting and not (tmp_path / "counts").exists()  # nothing live: file removed
    s.close()


def test_torn_tail_is_dropped(tmp_path: Path) -> None:
    s = QueueStore(tmp_path, persistent_only=True)
    (a,) = fill(s, 1)
    drain(s)
    s.set_count(a, 3)
    s.close()
    with open(tmp_path / "counts", "ab") as f:
        f.write(b"\x01\x02\x03")  # a record cut short by a crash
    s = QueueStore(tmp_path, persistent_only=True)
    assert s.count_of(a) == 3
    assert (tmp_path / "counts").stat().st_size == 4 + 12
    s.close()


def test_compaction_bounds_the_file_and_replicates(tmp_path: Path) -> None:
    sink = MirrorSink()
    s = QueueStore(tmp_path, sink=sink, persistent_only=True)
    ids = fill(s, 3)
    drain(s)
    keep = ids[0]
    s.set_count(keep, 1)
    for i in range(3 * delivery_counts.COMPACT_MIN):  # many counts of messages gone since
        s.set_count(ids[1 + i % 2], i + 1)
        s.forget_count(ids[1 + i % 2])
    s.flush()
    size = (tmp_path / "counts").stat().st_size
    assert size < 12 * (delivery_counts.COMPACT_MIN + 10), size
    assert bytes(sink.files[tmp_path / "counts"]) == (tmp_path / "counts").read_bytes()  # the replica's copy
    s.close()
    s = QueueStore(tmp_path, persistent_only=True)
    assert s.count_of(keep) == 1
    s.close()


def test_quorum_priority_store_two_high_per_normal(tmp_path: Path) -> None:
    base = QueueStore(tmp_path, persistent_only=True)
    s = QuorumPriorityStore(base)
    assert (s.level_of(0), s.level_of(4), s.level_of(5), s.level_of(255)) == (0, 0, 1, 1)
    for i in range(4):
        s.append_priority(0, 1000 + i, b"", b"q", PERSISTENT, b"n%d" % i)
    for i in range(4):
        s.append_priority(9, 2000 + i, b"", b"q", PERSISTENT, b"h%d" % i)
    order = [s.read(m)[4] for m in drain(s)]
    assert order == [b"h0", b"h1", b"n0", b"h2", b"h3", b"n1", b"n2", b"n3"]
    s.close()
    # high first, normal younger: no overtaking
    base = QueueStore(tmp_path / "b", persistent_only=True)
    s = QuorumPriorityStore(base)
    for i in range(3):
        s.append_priority(7, 1000 + i, b"", b"q", PERSISTENT, b"h%d" % i)
    s.append_priority(1, 5000, b"", b"q", PERSISTENT, b"n0")
    assert [s.read(m)[4] for m in drain(s)] == [b"h0", b"h1", b"h2", b"n0"]
    s.close()
