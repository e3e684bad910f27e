"""The store's batched hot-path methods must agree with the plain ones."""

from __future__ import annotations

from pathlib import Path

from broker.store.queue_store import QueueStore


def _fill(store: QueueStore, n: int) -> None:
    for i in range(n):
        store.append(1000 + i, b"ex", b"rk.%d" % i, b"\x00\x00", b"body-%d" % i)


def _drop(msgid: int, exrk: bytes, props: bytes, body: bytes, redelivered: bool) -> None:
    """A deliver callback for runs whose messages the test does not look at."""


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
    s.removed()  # acked segments are removed on the segment worker (store/segment_log.py)
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
    assert s.deliver_run(20, True, _drop, 1 << 30)[0] == 20
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
    assert s.deliver_run(250, True, _drop, 1 << 30)[0] == 250
    s.removed()  # acked segments are removed on the segment worker (store/segment_log.py)
    assert len(list(d.glob("msgs.*"))) < segs_before
    s.end_pass()
    assert s.deliver_run(50, True, _drop, 1 << 30)[0] == 50  # a run close() must finish
    s.close()
    s2 = QueueStore(d, segment_size=4096)
    assert s2.ready_count == 100
    first = s2.next_delivery(False)
    assert first is not None and first[3] == b"body-300"
    s2.close()


def test_deliver_run_matches_next_delivery_across_recovery_and_requeues(tmp_path: Path) -> None:
    """deliver_run hands out exactly what repeated next_delivery calls would: same
    records, order, redelivered flags and acks, over segment ends, acked records
    ahead of the cursor (after recovery) and requeued messages."""
    def prepare(d: Path) -> QueueStore:
        s = QueueStore(d, segment_size=4096)
        _fill(s, 400)
        ids = [m for m in iter(s.shift, None)]
        s.ack_many(ids[5:400:3])  # acked records ahead of the cursor once reopened
        s.close()
        s = QueueStore(d, segment_size=4096)
        first = [s.shift() for _ in range(4)]
        for m in first[:2]:
            assert m is not None
            s.requeue(m)
        return s

    got: list[tuple[int, bytes, bytes, bytes, bool]] = []

    def take(msgid: int, exrk: bytes, props: bytes, body: bytes, red: bool) -> None:
        got.append((msgid, bytes(exrk), bytes(props), bytes(body), red))

    for autoack in (True, False):
        a = prepare(tmp_path / f"a{autoack}")
        b = prepare(tmp_path / f"b{autoack}")
        got.clear()
        total = 0
        while True:
            n, red, nbytes = a.deliver_run(37, autoack, take, 1 << 20)
            total += n
            if n < 37:
                break
        a.end_pass()
        want = []
        while (d := b.next_delivery(autoack)) is not None:
            want.append((d[0], bytes(d[1]), bytes(d[2]), bytes(d[3]), d[4]))
        b.end_pass()
        assert got == want and total == len(want) > 200
        assert a.ready_count == b.ready_count == 0
        assert a.unacked_count == b.unacked_count
        a.close()
        b.close()
        # what is left after reopening (unacked come back) is the same too
        a2 = QueueStore(tmp_path / f"a{autoack}", segment_size=4096)
        b2 = QueueStore(tmp_path / f"b{autoack}", segment_size=4096)
        assert a2.ready_count == b2.ready_count
        a2.close()
        b2.close()


def test_deliver_run_stops_at_the_byte_budget(tmp_path: Path) -> None:
    s = QueueStore(tmp_path / "q")
    for _ in range(100):
        s.append(1, b"", b"q", b"\x00\x00", bytes(1000))
    seen: list[int] = []
    n, red, nbytes = s.deliver_run(100, True, lambda *m: seen.append(m[0]), 4500)
    assert (n, red, nbytes) == (5, 0, 5000) and len(seen) == 5
    assert s.ready_count == 95
    s.close()


def test_append_taken_leaves_nothing_ready_and_survives_reopen(tmp_path: Path) -> None:
    """append_taken = append + shift of that very record: over segment rolls, after
    recovery with acked records ahead of the cursor, and durable until acked."""
    d = tmp_path / "q"
    s = QueueStore(d, segment_size=4096)
    _fill(s, 30)
    ids = [m for m in iter(s.shift, None)]
    s.ack_many(ids[10:])  # acked records ahead of the cursor once reopened
    s.close()
    s = QueueStore(d, segment_size=4096)
    for m in iter(s.shift, None):
        s.ack(m)
    taken = []
    for i in range(200):  # several segment rolls
        taken.append(s.append_taken(1, b"", b"q", b"\x00\x00", b"t-%d" % i))
        assert s.ready_count == 0
    assert s.unacked_count == 200 and s.next_delivery(False) is None
    assert [s.read(m)[4] for m in taken[:3]] == [b"t-0", b"t-1", b"t-2"]
    s.ack_many(taken[:50])
    s.close()
    s2 = QueueStore(d, segment_size=4096)
    back = [d2[3] for d2 in iter(lambda: s2.next_delivery(True), None)]
    assert back == [b"t-%d" % i for i in range(50, 200)]
    s2.close()
