"""The store's batched hot-path methods must agree with the plain ones."""

from __future__ import annotations

from pathlib import Path

from broker.store.queue_store import QueueStore


def _fill(store: QueueStore, n: int) -> None:
    for i in range(n):
        store.append(1000 + i, b"ex", b"rk.%d" % i, b"\x00\x00", b"body-%d" % i)


def test_next_delivery_matches_shift_and_read(tmp_path: Path) -> None:
    a = QueueStore(tmp_path / "a", segment_size=4096)
    b = QueueStore(tmp_path / "b", segment_size=4096)
    _fill(a, 300)
    _fill(b, 300)
    # requeue a few in both, so the heap path is exercised as well as the cursor path
    for s in (a, b):
        first = [s.shift() for _ in range(3)]
        for m in reversed(first):
            assert m is not None
            s.requeue(m)
    got = []
    while (d := a.next_delivery(False)) is not None:
        got.append(d)
    want = []
    while (m := b.shift()) is not None:
        _ts, ex, rk, props, body = b.read(m)
        want.append((m, bytes((len(ex),)) + ex + bytes((len(rk),)) + rk, props, body, b.is_redelivered(m)))
    assert [(g[0], bytes(g[1]), bytes(g[2]), bytes(g[3]), g[4]) for g in got] == want
    assert len(got) == 300 and [g[4] for g in got[:3]] == [True] * 3 and not got[3][4]
    assert a.unacked_count == b.unacked_count == 300


def test_ack_many_deletes_segments_and_survives_restart(tmp_path: Path) -> None:
    d = tmp_path / "q"
    s = QueueStore(d, segment_size=4096)
    _fill(s, 500)
    ids = [m for m in iter(s.shift, None)]
    before = len(list(d.glob("msgs.*")))
    s.ack_many(ids[:400])
    after = len(list(d.glob("msgs.*")))
    assert after < before  # fully acked segments are gone
    s.requeue(ids[450])
    s.close()
    s2 = QueueStore(d, segment_size=4096)
    # 100 unacked/requeued come back ready, in order; the 400 acked never do
    back = []
    while (d2 := s2.next_delivery(True)) is not None:
        back.append(d2[3])
    assert back == [b"body-%d" % i for i in range(400, 500)]
    s2.close()


def test_autoack_delivery_acks_durably(tmp_path: Path) -> None:
    d = tmp_path / "q"
    s = QueueStore(d, segment_size=4096)
    _fill(s, 50)
    for _ in range(20):
        assert s.next_delivery(True) is not None
    assert s.unacked_count == 0 and s.ready_count == 30
    s.end_pass()  # the delivery pass is over: its acks go to the ack file's buffer
    s.sync()
    del s  # no close: as after kill -9, only what sync() made durable counts
    s2 = QueueStore(d, segment_size=4096)
    assert s2.ready_count == 30
    first = s2.next_delivery(False)
    assert first is not None and first[3] == b"body-20"
    s2.close()


def test_large_bodies_written_by_pwrite_recover_after_kill(tmp_path: Path) -> None:
    d = tmp_path / "q"
    s = QueueStore(d, segment_size=256 * 1024)
    bodies = [bytes([i]) * (20_000 + i * 1000) for i in range(30)]  # many cross 16 KiB
    for i, body in enumerate(bodies):
        s.append(5, b"", b"k", b"\x00\x00", memoryview(body) if i % 2 else body)
    got = [s.read(m)[4] for m in iter(s.shift, None)]
    assert got == bodies
    del s  # no close, like kill -9: pwritten bytes are in the page cache
    s2 = QueueStore(d, segment_size=256 * 1024)
    again = []
    while (item := s2.next_delivery(True)) is not None:
        again.append(bytes(item[3]))
    assert again == bodies
    s2.close()


def test_autoack_runs_across_segments_ack_each_segment(tmp_path: Path) -> None:
    """A run of autoack deliveries spanning several segments records every ack,
    deletes the segments it emptied, and close() ends an unfinished run."""
    d = tmp_path / "q"
    s = QueueStore(d, segment_size=4096)
    _fill(s, 400)
    segs_before = len(list(d.glob("msgs.*")))
    for _ in range(250):
        assert s.next_delivery(True) is not None
    assert len(list(d.glob("msgs.*"))) < segs_before
    s.end_pass()
    for _ in range(50):  # a run close() must finish
        assert s.next_delivery(True) is not None
    s.close()
    s2 = QueueStore(d, segment_size=4096)
    assert s2.ready_count == 100
    first = s2.next_delivery(False)
    assert first is not None and first[3] == b"body-300"
    s2.close()
