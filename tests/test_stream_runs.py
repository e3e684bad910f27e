"""Chunk-level append and read of stream queues (the stream protocol's hot paths), no sockets.

A published batch is stored as one run (one write, one replication record, all or nothing after
kill -9); a subscription reads a run of a segment and frames it as one Deliver chunk, and what a
client sees is the same with the chunk path forced off (the vhost's fast-path switch).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.model.fastpaths import FastPaths
from broker.model.stream import StreamQueue
from broker.store import segment as fmt
from broker.store.sink import NullSink
from broker.store.stream_store import StreamStore
from broker.streamproto import codec as C
from broker.streamproto.session import _PLAIN_PROPS, StreamSession, Subscription, _stream_props

EXRK = fmt.short_pair(b"", b"s")
TS = 1_700_000_000_000


class RecordingSink(NullSink):
    """A replication sink that keeps what it is sent (the cluster's follower feed)."""

    active = True

    def __init__(self) -> None:
        self.appends: list[bytes] = []

    def append(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        self.appends.append(bytes(data))


def _queue(directory: Path, sink: Any = None, fast: bool = True, segment_size: int = 1 << 20
           ) -> tuple[StreamQueue, list[Callable[[], None]]]:
    pending: list[Callable[[], None]] = []
    store = StreamStore(directory, segment_size=segment_size, **({"sink": sink} if sink else {}))
    q = StreamQueue("/", "s", arguments={"x-queue-type": "stream"}, stream=store,
                    schedule=pending.append, on_unused=lambda q: None, on_dirty=lambda s: None)
    q.fast = FastPaths()
    q.fast.on = fast
    return q, pending


def _records(s: StreamStore) -> list[tuple[int, int, bytes, bytes, bytes, bytes]]:
    p = s.seek(0)
    out = []
    while (r := s.read_next(p)) is not None:
        out.append(r)
    return out


def test_publish_run_is_one_write_one_replication_record(tmp_path: Path) -> None:
    sink = RecordingSink()
    q, _ = _queue(tmp_path / "run", sink)
    props = [_PLAIN_PROPS, _stream_props("eu"), _PLAIN_PROPS] * 100
    bodies = [b"m%d" % i for i in range(300)]
    q.publish(TS, b"", b"s", _PLAIN_PROPS, b"first", True)  # the segment exists (its header sent)
    sink.appends.clear()
    q.publish_run(TS, b"", b"s", props, bodies, True, EXRK, False)
    assert len(sink.appends) == 1  # main: one per message (300)
    one, _ = _queue(tmp_path / "one")
    one.publish(TS, b"", b"s", _PLAIN_PROPS, b"first", True)
    for p, b in zip(props, bodies, strict=True):
        one.publish(TS, b"", b"s", p, b, True)
    assert _records(q.stream) == _records(one.stream)  # same records as one by one
    sizes = (fmt.record_size(b"", b"s", p, b) for p, b in zip(props, bodies, strict=True))
    assert len(sink.appends[0]) == sum(sizes)
    q.close()
    reopened = StreamStore(tmp_path / "run", segment_size=1 << 20)
    assert [r[5] for r in _records(reopened)] == [b"first", *bodies]
    reopened.close()
    one.close()


def test_a_run_cut_before_its_first_timestamp_is_gone_whole(tmp_path: Path) -> None:
    """kill -9 between the run's write and its first timestamp: recovery keeps none of it."""
    s = StreamStore(tmp_path / "s", segment_size=1 << 20)
    s.append_run(TS, EXRK, [_PLAIN_PROPS] * 3, [b"a", b"b", b"c"])
    seg = s._segs[s._order[-1]]
    at = seg.end
    s.append_run(TS, EXRK, [_PLAIN_PROPS] * 50, [b"x" * 10] * 50)
    path = seg.path
    s.close()
    with path.open("r+b") as f:  # what the crash leaves: the run written, its first stamp not
        f.seek(at)
        f.write(bytes(8))
    r = StreamStore(tmp_path / "s", segment_size=1 << 20)
    assert r.count == 3 and [x[5] for x in _records(r)] == [b"a", b"b", b"c"]
    assert r.append_run(TS, EXRK, [_PLAIN_PROPS], [b"d"]) == 3  # offsets go on densely
    r.close()


def test_read_run_is_read_next_in_bounded_runs(tmp_path: Path) -> None:
    s = StreamStore(tmp_path / "s", segment_size=600)  # several segments
    bodies = [b"y" * (i % 7) for i in range(60)]
    for i in range(0, 60, 6):
        s.append_run(TS + i, EXRK, [_PLAIN_PROPS] * 6, bodies[i:i + 6])
    want = _records(s)
    p = s.seek(0)
    got: list[tuple[int, int, bytes, bytes]] = []
    runs = 0
    while (run := s.read_run(p, 4, 1 << 20)) is not None:
        first, ts, props, bods, _same = run
        assert 1 <= len(bods) <= 4 and ts == want[first][1]
        got.extend((first + i, want[first + i][1], props[i], bods[i]) for i in range(len(bods)))
        runs += 1
    assert got == [(r[0], r[1], r[4], r[5]) for r in want]
    assert runs > 60 // 4  # runs also end at segment ends
    p = s.seek(10)
    first, _, _, bods, _ = s.read_run(p, 100, 1) or (0, 0, [], [], False)
    assert first == 10 and bods == [b"yyy"]  # the byte bound stops the run after one body
    s.close()


def test_read_records_is_read_next_as_raw_segment_bytes(tmp_path: Path) -> None:
    """``read_records`` (the Spark network read's answer): raw records, bounded by count, bytes
    and walk, never across a segment end; decoding them gives exactly ``read_next``'s records."""
    s = StreamStore(tmp_path / "s", segment_size=700)  # several segments
    for i in range(0, 60, 6):
        s.append_run(TS + i, EXRK, [_PLAIN_PROPS] * 6, [b"y" * 5] * 6, same=True)
        s.append(TS + i, b"amq.direct", b"k%d" % i, b"", b"z" * (i % 11))
    want = _records(s)
    for max_count, max_bytes, max_walk in ((1 << 20, 1 << 20, 1 << 16), (5, 1 << 20, 1 << 16),
                                           (1 << 20, 90, 1 << 16), (1 << 20, 1 << 20, 3), (1, 0, 1)):
        p = s.seek(7)
        got = []
        while (answer := s.read_records(p, max_count, max_bytes, max_walk)) is not None:
            first, n, data = answer
            assert 1 <= n <= max_count and (n == 1 or len(data) <= max_bytes)
            pos = 0
            for k in range(n):
                ts, ex, rk, props, body = fmt.read_record(data, pos)
                got.append((first + k, ts, ex, rk, props, body))
                pos = fmt.record_end(data, pos)[0]
            assert pos == len(data)
        assert got == want[7:], (max_count, max_bytes, max_walk)
    s.close()


def _chunks(data: bytes) -> list[tuple[int, int, list[bytes]]]:
    """(first offset, timestamp, messages) of each Deliver in ``data``, CRCs checked."""
    out = []
    r = C.FrameReader(1 << 24)
    for f in r.feed(data):
        assert f.key == C.DELIVER
        head = struct.unpack_from(">BbbHIqQQIi", f.payload)
        n, ts, first, crc, size = head[3], head[5], head[7], head[8], head[9]
        body = f.payload[-size:]
        assert zlib.crc32(body) == crc
        msgs, pos = [], 0
        for _ in range(n):
            ln = struct.unpack_from(">I", body, pos)[0]
            msgs.append(body[pos + 4:pos + 4 + ln])
            pos += 4 + ln
        out.append((first, ts, msgs))
    return out


class _Out:
    writable = True

    def __init__(self) -> None:
        self.data = bytearray()
        self.soon_calls: list[Callable[[], None]] = []

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        pass

    def soon(self, fn: Callable[[], None]) -> None:
        self.soon_calls.append(fn)


def _publish_mixed(q: StreamQueue) -> None:
    for i in range(0, 400, 40):  # stream-client runs, with and without filter values
        props = [_PLAIN_PROPS if j % 3 else _stream_props(f"v{j}") for j in range(40)]
        q.publish_run(TS + i, b"", b"s", props, [b"b%d" % (i + j) for j in range(40)], True, EXRK, False)
    q.publish(TS + 500, b"", b"s", b"\x00\x00", b"from amqp", True)  # another protocol's message


def _consume(tmp_path: Path, fast: bool, credit: int,
             publish: Callable[[StreamQueue], None] = _publish_mixed) -> list[tuple[int, int, list[bytes]]]:
    q, pending = _queue(tmp_path, fast=fast, segment_size=2048)
    publish(q)
    out = _Out()
    session = StreamSession.__new__(StreamSession)
    session.out = out
    session.closed = False
    sub = Subscription(session, 1, q, credit, {})
    sub.start(C.OffsetSpec(C.OFFSET_FIRST, 0))
    for _ in range(10_000):
        if pending:
            pending.pop(0)()
        elif out.soon_calls:
            out.soon_calls.pop(0)()
        elif sub.credit < 3:
            sub.credit += 1
            q.schedule_delivery()
        else:
            break
    q.close()
    return _chunks(bytes(out.data))


def test_chunk_path_changes_nothing_a_client_sees(tmp_path: Path) -> None:
    fast = _consume(tmp_path / "fast", True, 2)
    slow = _consume(tmp_path / "slow", False, 2)
    msgs = [m for _, _, ms in fast for m in ms]
    assert msgs == [m for _, _, ms in slow for m in ms]
    assert len(msgs) == 401 and msgs[-1] == b"\x00\x53\x75\xa0\x09from amqp"
    offsets = [first + i for first, _, ms in fast for i in range(len(ms))]
    assert offsets == list(range(401))
    # the chunks' first offsets and timestamps agree where they start at the same offset
    slow_at = {first: ts for first, ts, _ in slow}
    assert all(slow_at.get(first, ts) == ts for first, ts, _ in fast)


def test_publish_frames_decode_alike_uniform_or_not() -> None:
    """The one-unpack decode of equal-sized messages and the field-by-field one agree; a frame
    that only looks uniform from its first message is parsed field by field; short frames raise."""
    def frame(msgs: list[tuple[int, bytes]]) -> bytes:
        return b"\x07" + struct.pack(">i", len(msgs)) + b"".join(
            struct.pack(">Qi", i, len(d)) + d for i, d in msgs)

    uniform = [(i, b"%04d" % i) for i in range(1, 300)]
    mixed = [(1, b"ab"), (2, b""), (3, b"abcd"), (4, b"abcdefghij")]
    tricky = [(1, b"xxxx"), (2, b"yy"), (3, b"zzzzzz")]  # 3 x (12+4) bytes in all, like uniform
    for msgs in (uniform, mixed, tricky, []):
        b = C.decode_publish_batch(frame(msgs), 1)
        assert (b.pub_id, b.ids, b.datas, b.filters) == (7, [i for i, _ in msgs], [d for _, d in msgs], None)
    for cut in (frame(uniform)[:-1], frame(mixed)[:-3], frame(uniform) + b"\x00"):
        try:
            C.decode_publish_batch(cut, 1)
        except C.Malformed:
            continue
        raise AssertionError("a cut or padded Publish frame decoded")


def test_read_run_of_alike_records_equals_the_walk(tmp_path: Path) -> None:
    """Runs stored with one record head (``same``) are read in one unpack: the same records,
    stopping where the heads change (another run's timestamp, an odd body, other properties)."""
    s = StreamStore(tmp_path / "s", segment_size=4096)
    s.append_run(TS, EXRK, [_PLAIN_PROPS] * 20, [b"%02d" % i for i in range(20)], same=True)
    s.append_run(TS + 1, EXRK, [_PLAIN_PROPS] * 20, [b"%02d" % i for i in range(20)], same=True)
    s.append_run(TS + 1, EXRK, [_PLAIN_PROPS] * 3, [b"a", b"bb", b"c"])
    s.append_run(TS + 1, EXRK, [_stream_props("f")] * 30, [b"z" * 40] * 30, same=True)
    s.append_run(TS + 2, EXRK, [_PLAIN_PROPS] * 5, [b""] * 5, same=True)
    want = [(r[0], r[1], r[4], r[5]) for r in _records(s)]
    for count, nbytes in ((256, 1 << 20), (7, 1 << 20), (256, 50), (1, 1)):
        p = s.seek(0)
        got: list[tuple[int, int, bytes, bytes]] = []
        while (run := s.read_run(p, count, nbytes)) is not None:
            first, ts, props, bodies, _same = run
            assert ts == want[first][1] and len(bodies) <= count
            assert sum(map(len, bodies[:-1])) < nbytes  # stopped once the bound was reached
            got.extend((first + i, want[first + i][1], props[i], bodies[i]) for i in range(len(bodies)))
        assert got == want, (count, nbytes)
    s.close()
    big = StreamStore(tmp_path / "big", segment_size=1 << 20)  # spans past the one-compare bound
    big.append_run(TS, EXRK, [_PLAIN_PROPS] * 100, [b"y" * 1000] * 100, same=True)
    big.append_run(TS + 1, EXRK, [_PLAIN_PROPS] * 100, [b"w" * 1000] * 100, same=True)
    runs = []
    p = big.seek(0)
    while (run := big.read_run(p, 256, 1 << 20)) is not None:
        runs.append((run[0], run[3]))
    assert runs == [(0, [b"y" * 1000] * 100), (100, [b"w" * 1000] * 100)]
    big.close()


def test_deliver_chunks_frame_alike_with_equal_or_mixed_lengths() -> None:
    for msgs in ([b"abcd"] * 5, [b"a", b"", b"abc"], [b""] * 3, [b"x"]):
        (first, ts, got), = _chunks(C.encode_deliver_run(3, 42, TS, msgs))
        assert (first, ts, got) == (42, TS, msgs)


def _publish_alike_and_not(q: StreamQueue) -> None:
    """Alike runs (one head: properties, body length) beside runs that only nearly are: the
    same properties with other lengths, the same length with other properties, an alike run
    followed at once by one odd record, empty bodies, and AMQP-style properties (framed)."""
    amqp = b"\x00\x00"
    q.publish_run(TS, b"", b"s", [_PLAIN_PROPS] * 30, [b"%03d" % i for i in range(30)], True, EXRK, True)
    q.publish_run(TS, b"", b"s", [_PLAIN_PROPS] * 4, [b"a", b"bb", b"c", b"dd"], True, EXRK, False)
    q.publish_run(TS, b"", b"s", [_PLAIN_PROPS, _stream_props("f")] * 3, [b"xy"] * 6, True, EXRK, False)
    g = _stream_props("g")
    q.publish_run(TS, b"", b"s", [g] * 12, [b"g%02d" % i for i in range(12)], True, EXRK, True)
    q.publish_run(TS, b"", b"s", [g], [b"g1000"], True, EXRK, False)  # the same head but its length
    q.publish_run(TS + 1, b"", b"s", [amqp] * 9, [b"m%d" % i for i in range(9)], True, EXRK, True)
    q.publish_run(TS + 1, b"", b"s", [amqp] * 3, [b"", b"m", b"mm"], True, EXRK, False)
    q.publish_run(TS + 2, b"", b"s", [amqp] * 5, [b""] * 5, True, EXRK, True)
    q.publish_run(TS + 2, b"", b"s", [_PLAIN_PROPS] * 5, [b""] * 5, True, EXRK, True)
    q.publish_run(TS + 3, b"", b"s", [amqp] * 3, [b"z" * 300] * 3, True, EXRK, True)  # 4-byte size code


def test_read_run_says_same_only_of_runs_that_are(tmp_path: Path) -> None:
    """``read_run``'s ``same`` hint (one properties value, one body length: the consumer frames
    the run without checking) is True only where it holds, and is True for the alike runs."""
    q, _ = _queue(tmp_path, segment_size=4096)
    _publish_alike_and_not(q)
    s = q.stream
    want = [(r[0], r[4], r[5]) for r in _records(s)]
    for count, nbytes in ((256, 1 << 20), (5, 1 << 20), (256, 20), (1, 1)):
        p = s.seek(0)
        got: list[tuple[int, bytes, bytes]] = []
        hinted = 0
        while (run := s.read_run(p, count, nbytes)) is not None:
            first, _ts, props, bodies, same = run
            if same:
                assert len(set(props)) == 1 and len(set(map(len, bodies))) == 1, (first, count, nbytes)
                hinted += len(bodies)
            got.extend((first + i, props[i], bodies[i]) for i in range(len(bodies)))
        assert got == want, (count, nbytes)
        assert hinted >= (30 if count > 1 and nbytes > 1 else 0), (count, nbytes)
    q.close()


def test_hinted_chunks_deliver_what_the_record_path_does(tmp_path: Path) -> None:
    """Delivered through a subscription, alike runs framed on the hint (no per-message length
    check, one stream-message prefix) give a client exactly the record-by-record path's
    messages, mixed runs included."""
    fast = _consume(tmp_path / "fast", True, 2, _publish_alike_and_not)
    slow = _consume(tmp_path / "slow", False, 2, _publish_alike_and_not)
    msgs = [m for _, _, ms in fast for m in ms]
    assert msgs == [m for _, _, ms in slow for m in ms]
    assert len(msgs) == 30 + 4 + 6 + 12 + 1 + 9 + 3 + 5 + 5 + 3
    assert msgs[:2] == [b"000", b"001"] and msgs[-1] == b"\x00\x53\x75\xb0\x00\x00\x01\x2c" + b"z" * 300
    offsets = [first + i for first, _, ms in fast for i in range(len(ms))]
    assert offsets == list(range(len(msgs)))


def test_encode_deliver_run_same_size_frames_as_the_check_does() -> None:
    for msgs in ([b"abcd"] * 5, [b""] * 3, [b"x"]):
        assert C.encode_deliver_run(3, 42, TS, msgs, 7, True) == C.encode_deliver_run(3, 42, TS, msgs, 7)


def _head(props: bytes, body_len: int, ts: int = TS) -> bytes:
    """A record's stored head as ``segment.py`` lays it out (what ``read_joined`` splits on)."""
    return struct.pack("<q", ts) + EXRK + struct.pack("<I", len(props)) + props + struct.pack("<Q", body_len)


def _publish_with_traps(q: StreamQueue) -> None:
    """``_publish_alike_and_not`` and alike runs whose bodies hold their own head's bytes (at
    the start, the end, straddling two records' worth), which no search for heads may take
    for record boundaries, and long runs crossing chunk and segment bounds."""
    _publish_alike_and_not(q)
    for ts, size in ((TS + 10, 80), (TS + 11, 120)):
        h = _head(_PLAIN_PROPS, size, ts)
        bodies = [b"%0*d" % (size, i) for i in range(20)]
        bodies[3] = h + bodies[3][len(h):]
        bodies[7] = bodies[7][:size - len(h)] + h
        bodies[8] = h[5:] + bodies[8][len(h) - 5:]  # with record 9's head: the head twice over
        q.publish_run(ts, b"", b"s", [_PLAIN_PROPS] * 20, bodies, True, EXRK, True)
    g = _stream_props("g")
    q.publish_run(TS + 12, b"", b"s", [g] * 300, [b"h%04d" % i for i in range(300)], True, EXRK, True)
    plain = [_PLAIN_PROPS] * 600
    q.publish_run(TS + 13, b"", b"s", plain, [b"%05d" % i for i in range(600)], True, EXRK, True)


def _walk_joined(s: StreamStore, want: dict[int, int], start: int, count: int, nbytes: int
                 ) -> tuple[list[tuple[int, int, bytes, bytes]], int]:
    """The records from ``start`` as a subscription reads them (``read_joined``, else
    ``read_run``), and how many came joined; ``want``: each offset's timestamp."""
    def prefix_for(props: bytes, size: int) -> bytes:
        return b"<" + struct.pack(">HI", len(props), size) + props

    p = s.seek(start)
    got: list[tuple[int, int, bytes, bytes]] = []
    joined = 0
    while True:
        j = s.read_joined(p, count, nbytes, prefix_for)
        if j is not None:
            first, ts, n, data = j
            assert 2 <= n <= count and ts == want[first]
            pos = size = 0
            for i in range(n):
                plen, size = struct.unpack_from(">HI", data, pos + 1)
                props = data[pos + 7:pos + 7 + plen]
                pos += 7 + plen
                got.append((first + i, want[first + i], props, data[pos:pos + size]))
                pos += size
            assert pos == len(data) and size * (n - 1) < nbytes  # stopped once the bound was reached
            joined += n
            continue
        run = s.read_run(p, count, nbytes)
        if run is None:
            return got, joined
        first, ts, props_l, bodies, _same = run
        got.extend((first + i, want[first + i], props_l[i], bodies[i]) for i in range(len(bodies)))


def test_read_joined_frames_what_read_run_reads(tmp_path: Path) -> None:
    """Store level: walking as a subscription does, from every kind of start, under count and
    byte bounds, gives the record walk's records; the joined path takes the alike runs, both
    those this store wrote (known alike) and, after a reopen, those it proves alike."""
    q, _ = _queue(tmp_path, segment_size=8192)
    _publish_with_traps(q)
    want = [(r[0], r[1], r[4], r[5]) for r in _records(q.stream)]
    stamps = {r[0]: r[1] for r in want}
    q.close()
    for reopened in (False, True):
        if reopened:
            s = StreamStore(tmp_path, segment_size=8192)
        else:
            q, _ = _queue(tmp_path / "live", segment_size=8192)
            _publish_with_traps(q)
            s = q.stream
        for count, nbytes in ((256, 1 << 20), (7, 1 << 20), (256, 50), (1, 1)):
            for start in (0, 1, 31, 45, 80, 100, 145, 400, len(want) - 1):
                got, joined = _walk_joined(s, stamps, start, count, nbytes)
                assert got == want[start:], (reopened, count, nbytes, start)
                if start == 0 and count > 1 and nbytes > 1:
                    least = 30 + 40 + 300 + 600 if count > 7 and nbytes > 1000 else 1
                    assert joined >= least, (reopened, count, nbytes)
        s.close()


def _consume_from(tmp_path: Path, fast: bool, credit: int, spec: C.OffsetSpec,
                  arguments: dict[str, Any] | None = None) -> tuple[list[tuple[int, int, list[bytes]]], int]:
    """What a subscription sends, and how many of its chunks went the joined way."""
    q, pending = _queue(tmp_path, fast=fast, segment_size=8192)
    _publish_with_traps(q)
    out = _Out()
    session = StreamSession.__new__(StreamSession)
    session.out = out
    session.closed = False
    sub = Subscription(session, 1, q, credit, arguments or {})
    joined = 0
    deliver_joined = sub.deliver_joined

    def counted(*a: Any) -> None:
        nonlocal joined
        joined += 1
        deliver_joined(*a)

    sub.deliver_joined = counted  # type: ignore[method-assign]
    sub.start(spec)
    for _ in range(20_000):
        if pending:
            pending.pop(0)()
        elif out.soon_calls:
            out.soon_calls.pop(0)()
        elif sub.credit < 1:
            sub.credit += 1  # one chunk at a time: the credit limit in force all along
            q.schedule_delivery()
        else:
            break
    q.close()
    return _chunks(bytes(out.data)), joined


def test_joined_chunks_deliver_what_the_record_path_does(tmp_path: Path) -> None:
    """Through a subscription: the joined path (fast paths on) and the record-by-record path
    (off) send the same messages at the same offsets, from the first record, mid-run starts
    and the last, with a filter (record path both ways), one credit at a time."""
    total = 30 + 4 + 6 + 12 + 1 + 9 + 3 + 5 + 5 + 3 + 40 + 300 + 600
    cases: list[tuple[C.OffsetSpec, dict[str, Any] | None]] = [
        (C.OffsetSpec(C.OFFSET_FIRST), None), (C.OffsetSpec(C.OFFSET_OFFSET, 17), None),
        (C.OffsetSpec(C.OFFSET_OFFSET, total - 250), None), (C.OffsetSpec(C.OFFSET_LAST), None),
        (C.OffsetSpec(C.OFFSET_FIRST), {"x-stream-filter": ["g"], "x-stream-match-unfiltered": False})]
    for k, (spec, args) in enumerate(cases):
        fast, joined = _consume_from(tmp_path / f"fast{k}", True, 1, spec, args)
        slow, _ = _consume_from(tmp_path / f"slow{k}", False, 1, spec, args)
        flat = [(first + i, m) for first, _, ms in fast for i, m in enumerate(ms)]
        assert flat == [(first + i, m) for first, _, ms in slow for i, m in enumerate(ms)], k
        stamps = {first: ts for first, ts, _ in slow}
        assert all(stamps.get(first, ts) == ts for first, ts, _ in fast)
        if args is None:
            start = spec.value if spec.kind == C.OFFSET_OFFSET else 0
            if spec.kind != C.OFFSET_LAST:
                assert [o for o, _ in flat] == list(range(start, total)), k
                assert joined >= (4 if spec.kind == C.OFFSET_FIRST else 1), k  # alike runs went joined
        else:
            assert joined == 0 and len(flat) == 12 + 1 + 300  # filtered: record by record
    assert flat[0][1] == b"g00"


def test_a_filtered_subscription_gets_only_its_values(tmp_path: Path) -> None:
    """``filter.N`` properties become the subscription's ``x-stream-filter``, and starting the
    subscription (which sets its start offset) keeps them (it used to replace them, so a
    filtered stream-protocol subscription got every message)."""
    q, pending = _queue(tmp_path, segment_size=8192)
    _publish_alike_and_not(q)
    out = _Out()
    session = StreamSession.__new__(StreamSession)
    session.out = out
    session.closed = False
    sub = Subscription(session, 1, q, 100, {"x-stream-filter": ["f"], "x-stream-match-unfiltered": False})
    sub.start(C.OffsetSpec(C.OFFSET_FIRST))
    while pending or out.soon_calls:
        (pending or out.soon_calls).pop(0)()
    q.close()
    assert [m for _, _, ms in _chunks(bytes(out.data)) for m in ms] == [b"xy"] * 3
