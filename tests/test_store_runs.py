"""Runs in the store: ``append_run`` and ``deliver_run``'s ``deliver_same`` must agree
with the one-record-at-a-time methods, byte for byte and delivery for delivery."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.store import queue_store
from broker.store.queue_store import QueueStore
from broker.store.segment import short_pair

Delivery = tuple[int, bytes, bytes, bytes, bool]


def _groups() -> list[tuple[bytes, list[bytes], list[bytes], bool]]:
    """(routing key, props, bodies, same) groups: runs of 1 to 40 records. A "same" run
    has one properties object and one body size, with neighbours that differ in routing
    key, properties or body size only; every fifth run is mixed: properties of varying
    sizes (a message-id) and bodies of varying sizes."""
    out = []
    for g in range(60):
        rk = b"rk.%d" % (g % 3)
        n = 1 + (g * 7) % 40
        if g % 5 == 4:
            props = [b"\x00\x80" + bytes([len(b"id-%d" % i)]) + b"id-%d" % i for i in range(n)]
            bodies = [b"mixed-%d-%d" % (g, i) for i in range(n)]
            out.append((rk, props, bodies, False))
            continue
        p = b"\x00\x00" if g % 4 else b"\x80\x00\x04text"
        size = 6 + g % 5
        bodies = [(b"%d-%d-" % (g, i)).ljust(size, b"x")[:size] for i in range(n)]
        out.append((rk, [p] * n, bodies, True))
    return out


def _fill_runs(store: QueueStore) -> int:
    n = 0
    for rk, props, bodies, same in _groups():
        store.append_run(77, short_pair(b"ex", rk), props, bodies, same)
        n += len(bodies)
    return n


def _fill_single(store: QueueStore) -> int:
    n = 0
    for rk, props, bodies, _same in _groups():
        for p, body in zip(props, bodies, strict=True):
            store.append(77, b"ex", rk, p, body)
            n += 1
    return n


def _segment_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("msgs.*"))}


def test_append_run_writes_what_appends_write(tmp_path: Path) -> None:
    """The same records over many segment rolls, and the same messages after reopening.
    (Not the same files: a run never straddles two segments, so a full disk stores all
    of it or none.)"""
    a = QueueStore(tmp_path / "a", segment_size=1024)
    b = QueueStore(tmp_path / "b", segment_size=1024)
    n = _fill_runs(a)
    assert _fill_single(b) == n > 600
    assert (a.ready_count, a.bytes_ready) == (b.ready_count, b.bytes_ready)
    a.flush()
    b.flush()
    assert len(_segment_bytes(tmp_path / "a")) > 20
    a.close()
    b.close()
    a2 = QueueStore(tmp_path / "a", segment_size=1024)
    b2 = QueueStore(tmp_path / "b", segment_size=1024)
    def deliveries(st: QueueStore) -> list[tuple[bytes, bytes, bytes]]:
        return [(bytes(d[1]), bytes(d[2]), bytes(d[3])) for d in iter(lambda: st.next_delivery(True), None)]

    got = deliveries(a2)
    assert got == deliveries(b2)
    expected = [body for _rk, _p, group, _s in _groups() for body in group]
    assert [body for _exrk, _props, body in got] == expected
    a2.close()
    b2.close()


@pytest.mark.parametrize("same", [True, False])
def test_append_run_is_invisible_until_its_first_timestamp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           same: bool) -> None:
    """The run's first timestamp is written last: interrupted just before it (as kill -9
    could), recovery sees none of the run, and the records before it are intact."""
    d = tmp_path / "q"
    s = QueueStore(d)
    s.append(5, b"", b"q", b"\x00\x00", b"before")
    s.flush()

    def interrupted(*_a: object) -> None:
        raise KeyboardInterrupt  # stands in for the process dying at this instruction

    monkeypatch.setattr(queue_store, "_I64_PACK_INTO", interrupted)
    with pytest.raises(KeyboardInterrupt):
        props = [b"\x00\x00"] * 50 if same else [b"\x00\x80\x01" + bytes([65 + i % 26]) for i in range(50)]
        s.append_run(6, short_pair(b"", b"q"), props, [b"run-%03d" % i for i in range(50)], same)
    monkeypatch.undo()
    s2 = QueueStore(d)  # a second opener sees what the map holds, as recovery after kill -9 would
    got = [m[3] for m in iter(lambda: s2.next_delivery(True), None)]
    assert got == [b"before"]
    s2.close()


def _collect(store: QueueStore, autoack: bool, k: int, max_bytes: int, runs: bool,
             run_lengths: list[int]) -> list[Delivery]:
    got: list[Delivery] = []

    def one(msgid: int, exrk: bytes, props: bytes, body: bytes, red: bool) -> None:
        got.append((msgid, bytes(exrk), bytes(props), bytes(body), red))

    def same(msgids: range, exrk: bytes, props: bytes, bodies: list[bytes]) -> None:
        assert len(msgids) == len(bodies) > 1
        run_lengths.append(len(bodies))
        for msgid, body in zip(msgids, bodies, strict=True):
            got.append((msgid, bytes(exrk), bytes(props), bytes(body), False))

    while True:
        n, _red, _nb = store.deliver_run(k, autoack, one, max_bytes, same if runs else None)
        if n == 0:
            break
    store.end_pass()
    return got


@pytest.mark.parametrize("autoack", [True, False])
@pytest.mark.parametrize(("k", "max_bytes"), [(1000, 1 << 20), (13, 1 << 20), (1000, 100)])
def test_deliver_same_matches_one_by_one(tmp_path: Path, autoack: bool, k: int, max_bytes: int) -> None:
    """Runs handed to deliver_same are the same deliveries, in the same order, with the
    same acks, as one deliver call each: across segment ends, requeued and recovered
    (redelivered) records, acked records ahead of the cursor, the count and byte caps."""
    def prepare(d: Path) -> QueueStore:
        s = QueueStore(d, segment_size=2048)
        _fill_runs(s)
        ids = [m for m in iter(s.shift, None)]
        s.ack_many(ids[100:160:7])  # acked ahead of the cursor once reopened
        s.close()
        s = QueueStore(d, segment_size=2048)  # ids[:...] up to the hwm count as redelivered
        first = [s.shift() for _ in range(30)]
        for m in first[:10]:
            assert m is not None
            s.requeue(m)
        _fill_runs(s)  # fresh records after the recovered ones
        return s

    a = prepare(tmp_path / "a")
    b = prepare(tmp_path / "b")
    lengths: list[int] = []
    got = _collect(a, autoack, k, max_bytes, True, lengths)
    want = _collect(b, autoack, k, max_bytes, False, [])
    assert got == want and len(want) > 1000
    assert lengths and max(lengths) > 10  # runs were formed
    if max_bytes == 100:
        assert max(lengths) <= 100 // 6 + 1
    elif k == 13:
        assert max(lengths) <= 13
    assert (a.unacked_count, a.ready_count, a.bytes_ready) == (b.unacked_count, b.ready_count, b.bytes_ready)
    a.close()
    b.close()
    a2 = QueueStore(tmp_path / "a", segment_size=2048)
    b2 = QueueStore(tmp_path / "b", segment_size=2048)
    assert a2.ready_count == b2.ready_count == (20 if autoack else len(want) + 20)
    a2.close()
    b2.close()


@pytest.mark.parametrize("same", [True, False])
def test_a_run_taken_at_once_is_what_a_delivery_run_would_have_taken(tmp_path: Path, same: bool) -> None:
    """append_run_taken (a run handed to a consumer with the bytes in hand) leaves the store
    as append_run + deliver_run does: the same msgids unacked, nothing ready; acks settle
    them and a restart finds none of them."""
    exrk = short_pair(b"", b"q")
    props = [b"\x00\x80" + bytes([4 + i % 3]) + b"id-" + b"x" * (i % 3) for i in range(40)]
    bodies = [bytes([i]) * (10 + (0 if same else i)) for i in range(40)]
    if same:
        props = [props[0]] * 40
    a = QueueStore(tmp_path / "a")
    b = QueueStore(tmp_path / "b")
    for s in (a, b):
        s.append(1, b"", b"q", props[0], b"first")
        s.next_delivery(False)  # the cursor stands at the end: nothing ready
    taken = a.append_run_taken(7, exrk, props, bodies, same)
    b.append_run(7, exrk, props, bodies, same)
    got: list[int] = []
    b.deliver_run(100, False, lambda m, *_: got.append(m), 1 << 40)
    assert taken == got
    assert (a.ready_count, a.unacked_count) == (b.ready_count, b.unacked_count) == (0, 41)
    a.ack_many(taken)
    a.close()
    a = QueueStore(tmp_path / "a")
    assert a.ready_count == 1  # only the first message, never acked, comes back
    a.close()
    b.close()


def test_a_run_taken_behind_ready_messages_stays_ready(tmp_path: Path) -> None:
    s = QueueStore(tmp_path / "q")
    exrk = short_pair(b"", b"q")
    s.append(1, b"", b"q", b"\x00\x00", b"ready")
    assert s.append_run_taken(7, exrk, [b"\x00\x00"] * 3, [b"a", b"bb", b"c"], False) is None
    assert s.ready_count == 4
    s.close()
