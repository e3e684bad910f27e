"""StreamStore: offsets, index-based seek, recovery, retention, stored consumer offsets."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.store.stream_store import (
    Retention,
    StreamStore,
    index_name,
    iter_segment,
    list_segments,
    parse_age,
)

T0 = 1_700_000_000_000


def _fill(s: StreamStore, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        assert s.append(T0 + i * 10, b"ex", b"rk", b"\x00\x00", b"body-%d" % i) == i


def test_append_seek_and_read(tmp_path: Path) -> None:
    s = StreamStore(tmp_path, segment_size=1024)
    _fill(s, 300)
    assert (s.first_offset, s.next_offset, s.count) == (0, 300, 300)
    assert len(s.segment_infos()) > 5
    for off in (0, 1, 77, 150, 299):
        rec = s.read_at(off)
        assert rec is not None and rec[0] == off and rec[5] == b"body-%d" % off
    p = s.seek(120)
    got = [s.read_next(p) for _ in range(3)]
    assert [r[0] for r in got if r] == [120, 121, 122]
    end = s.seek(10_000)
    assert end.offset == 300 and s.read_next(end) is None
    s.append(T0 + 5000, b"", b"k", b"\x00\x00", b"late")
    rec = s.read_next(end)
    assert rec is not None and rec[0] == 300 and rec[5] == b"late"
    s.close()


def test_timestamp_lookup(tmp_path: Path) -> None:
    s = StreamStore(tmp_path, segment_size=1024)
    _fill(s, 300)
    assert s.offset_for_timestamp(0) == 0
    assert s.offset_for_timestamp(T0 + 1500) == 150
    assert s.offset_for_timestamp(T0 + 1505) == 151  # first at or after
    assert s.offset_for_timestamp(T0 + 10**9) == 300
    s.close()


def test_recovery_uses_index_and_offsets_survive(tmp_path: Path) -> None:
    s = StreamStore(tmp_path, segment_size=1024)
    _fill(s, 200)
    s.store_offset("c1", 42)
    s.close()
    s = StreamStore(tmp_path, segment_size=1024)
    assert (s.first_offset, s.next_offset, s.stored_offset("c1")) == (0, 200, 42)
    assert s.append(T0, b"", b"", b"\x00\x00", b"x") == 200  # fresh segment, next offset
    s.close()


def test_missing_index_is_rebuilt(tmp_path: Path) -> None:
    s = StreamStore(tmp_path, segment_size=1024)
    _fill(s, 200)
    s.close()
    nums = [i.num for i in list_segments(tmp_path)]
    (tmp_path / index_name(nums[3])).unlink()  # lost in a crash
    (tmp_path / index_name(nums[-1])).write_bytes(b"torn")
    s = StreamStore(tmp_path, segment_size=1024)
    assert s.next_offset == 200
    assert [r[0] for r in (s.read_at(o) for o in (0, 99, 199)) if r] == [0, 99, 199]
    assert (tmp_path / index_name(nums[3])).exists()
    s.close()


def test_torn_tail_is_dropped(tmp_path: Path) -> None:
    s = StreamStore(tmp_path, segment_size=1 << 20)
    _fill(s, 10)
    s.close()
    seg = list_segments(tmp_path)[-1].path
    data = seg.read_bytes()
    seg.write_bytes(data[:-3])  # chop the last record
    s = StreamStore(tmp_path, segment_size=1 << 20)
    assert s.next_offset == 9
    s.close()


@pytest.mark.parametrize("retention", [Retention(max_length=100), Retention(max_bytes=3000),
                                       Retention(max_age_ms=500)])
def test_retention_deletes_whole_oldest_segments(tmp_path: Path, retention: Retention) -> None:
    s = StreamStore(tmp_path, segment_size=1024, retention=retention)
    _fill(s, 300)
    s.apply_retention(T0 + 300 * 10)
    infos = s.segment_infos()
    assert s.first_offset > 0 and s.next_offset == 300
    assert infos[0][1] == s.first_offset  # a whole segment boundary
    assert s.count == 300 - s.first_offset
    if retention.max_length is not None:
        assert s.count <= 100
    if retention.max_bytes is not None:
        assert s.size_bytes <= 3000
    # A reader positioned before the retained data jumps to the oldest message.
    p = s.seek(0)
    rec = s.read_next(p)
    assert rec is not None and rec[0] == s.first_offset
    s.close()
    assert len(list_segments(tmp_path)) == len(infos)


@pytest.mark.parametrize("retention", [Retention(max_bytes=1), Retention(max_length=0),
                                       Retention(max_age_ms=1)])
def test_retention_never_empties_a_written_stream(tmp_path: Path, retention: Retention) -> None:
    """Room made for a publish (``make_room``, before a message routed to several queues is
    written anywhere) rolls a new, empty write segment; retention then must keep the newest
    segment holding records, or a publish refused afterwards (a full disk at another queue)
    leaves the stream empty: its extent read as (0, 0) over AMQP (a count of 0) and readers at
    ``latest`` lost their place. The kept segment goes once a record is in a newer one."""
    s = StreamStore(tmp_path, segment_size=64, retention=retention)
    for i in range(5):
        s.append(T0 + i, b"", b"k", b"\x00\x00", b"x" * 100)
    before = (s.first_offset, s.next_offset, s.count)
    assert before[1:] == (5, 5 - before[0]) and before[2] >= 1
    s.make_room(200, b"\x00\x00", T0 + 10_000)  # the publish is then refused: nothing written
    assert (s.first_offset, s.next_offset, s.count) == before
    s.apply_retention(T0 + 20_000)  # the age timer, a policy change
    assert s.next_age_expiry() is None  # nothing removable: no age timer spinning
    assert (s.first_offset, s.count) == (4, 1)
    s.append(T0 + 30_000, b"", b"k", b"\x00\x00", b"y" * 100)  # into the room made: the old one goes
    assert (s.first_offset, s.next_offset, s.count) == (5, 6, 1)
    s.append(T0 + 30_001, b"", b"k", b"\x00\x00", b"z" * 100)
    s.apply_retention(T0 + 40_000)  # the age rule: the segment of y is older than z's now
    assert (s.first_offset, s.next_offset, s.count) == (6, 7, 1)
    s.close()
    s = StreamStore(tmp_path, segment_size=64, retention=retention)
    assert (s.first_offset, s.next_offset) == (6, 7)
    s.close()


def test_read_only_listing_of_live_segment(tmp_path: Path) -> None:
    s = StreamStore(tmp_path, segment_size=1 << 20)
    _fill(s, 50)  # still open: the write segment is preallocated with zeros
    infos = list_segments(tmp_path)
    assert [(i.first_offset, i.count) for i in infos] == [(0, 50)]
    recs = list(iter_segment(infos[0].path, 45, 0))
    assert [r[0] for r in recs] == [45, 46, 47, 48, 49]
    s.close()


def test_parse_age() -> None:
    assert parse_age("7D") == 7 * 86400_000
    assert parse_age("12h") == 12 * 3600_000
    assert parse_age("30m") == 1800_000
    assert parse_age("10s") == 10_000
    for bad in ("7", "1w", "h", "", "7 days"):
        with pytest.raises(ValueError):
            parse_age(bad)


def test_last_chunk_is_the_last_append_and_survives_reopening(tmp_path: Path) -> None:
    """``last`` (RabbitMQ: the first message of the last chunk): the last append's first offset,
    read back after reopening from the trailing records that share the last timestamp."""
    s = StreamStore(tmp_path)
    assert s.last_chunk_offset == 0  # empty: where the next append lands
    _fill(s, 3)
    assert s.last_chunk_offset == 2
    s.append_run(T0 + 100, b"\x00\x02rk", [b"\x00\x00"] * 4, [b"a", b"b", b"c", b"d"])
    assert s.last_chunk_offset == 3
    s.close()
    s = StreamStore(tmp_path)
    assert (s.last_chunk_offset, s.next_offset) == (3, 7)
    s.append_run(T0 + 200, b"\x00\x02rk", [b"\x00\x00"] * 2, [b"e", b"f"], same=True)
    assert s.last_chunk_offset == 7
    s.close()
    s = StreamStore(tmp_path)  # the newest segment now holds only the last run
    assert s.last_chunk_offset == 7
    s.close()
