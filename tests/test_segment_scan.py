"""segment.scan takes runs of alike records in one step (a restart with 10 M queued
messages spent 12 s parsing each record): it must find exactly what a record-by-record
walk finds, for any mix of records, acks, transient messages and torn or chopped tails."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.store import segment as fmt

PERSISTENT = b"\x10\x00\x02"  # delivery-mode 2
TRANSIENT = b"\x10\x00\x01"
LONG = b"\x90\x00" + bytes([70]) + b"a" * 70  # content-type, then delivery-mode: a header > 64 bytes
KINDS = [(b"", b"q", PERSISTENT, 5), (b"", b"q", PERSISTENT, 6), (b"x", b"q", PERSISTENT, 5),
         (b"", b"q", TRANSIENT, 5), (b"", b"q", b"", 0), (b"", b"q", LONG + b"\x02", 5),
         (b"", b"q", LONG + b"\x01", 5)]
# timestamps whose low byte is zero make the scan look at the whole timestamp
STAMPS = [1, 256, 1 << 40, 1_790_000_000_000]


def _fields(buf: bytes, pos: int, size: int) -> tuple[int, int, int, int]:
    """(record end, props offset, props length, body size) of the record at ``pos``;
    IndexError if any of it lies past ``size``."""
    def field(at: int, n: int) -> int:
        if at + n > size:
            raise IndexError(at)
        return at + n

    at = field(pos + 8, 1)
    at = field(at, 1 + buf[at - 1])  # exchange, then the routing key's length byte
    at = field(at, buf[at - 1])
    props_len = fmt.U32.unpack_from(buf, field(at, 4) - 4)[0]
    props_at = at + 4
    body = fmt.U64.unpack_from(buf, field(props_at + props_len, 8) - 8)[0]
    return field(props_at + props_len + 8, body), props_at, props_len, body


def reference(buf: bytes, size: int, file_acks: set[int], persistent_only: bool) -> fmt.ScanResult:
    """One record at a time, as scan did before runs."""
    res = fmt.ScanResult()
    pos = fmt.HEADER_SIZE
    while pos + fmt.FIXED_SIZE <= size and fmt.I64.unpack_from(buf, pos)[0] != 0:
        try:
            end, props_at, props_len, body = _fields(buf, pos, size)
        except IndexError:
            res.garbage = True
            break
        res.count += 1
        if pos in file_acks or (persistent_only and not fmt.is_persistent(buf, props_at, props_len)):
            res.acked.add(pos)
        else:
            res.ready_bytes += body
        pos = end
    if pos + fmt.FIXED_SIZE > size and buf[pos:size].strip(b"\0"):
        res.garbage = True
    res.end = pos
    return res


@settings(max_examples=400, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, len(KINDS) - 1), st.integers(1, 12)), min_size=0, max_size=10),
       ack_picks=st.lists(st.integers(0, 10_000), max_size=20),
       cut=st.integers(0, 1500), zero_ts=st.integers(-1, 60),
       tail=st.sampled_from([b"", b"\0" * 40, b"\x07"]),
       persistent_only=st.booleans(), stamps=st.lists(st.sampled_from(STAMPS), min_size=1, max_size=5))
def test_scan_matches_record_by_record(runs: list[tuple[int, int]], ack_picks: list[int], cut: int,
                                       zero_ts: int, tail: bytes, persistent_only: bool,
                                       stamps: list[int]) -> None:
    buf = bytearray(fmt.HEADER)
    starts = []
    for kind, n in runs:
        ex, rk, props, body_len = KINDS[kind]
        for _ in range(n):
            starts.append(len(buf))
            buf += (struct.pack("<q", stamps[len(starts) % len(stamps)]) + bytes([len(ex)]) + ex
                    + bytes([len(rk)]) + rk + struct.pack("<I", len(props)) + props
                    + struct.pack("<Q", body_len) + b"b" * body_len)
    if 0 <= zero_ts < len(starts):  # a torn record: its timestamp never written
        buf[starts[zero_ts] : starts[zero_ts] + 8] = bytes(8)
    buf += tail
    size = max(fmt.HEADER_SIZE, len(buf) - cut)  # a chopped file
    # acks on record starts and on positions that are not
    acks = {starts[i % len(starts)] if starts and i % 3 else fmt.HEADER_SIZE + i for i in ack_picks}
    got = fmt.scan(bytes(buf), size, acks, persistent_only)
    want = reference(bytes(buf), size, acks, persistent_only)
    assert (got.end, got.count, got.acked, got.ready_bytes, got.garbage) == \
        (want.end, want.count, want.acked, want.ready_bytes, want.garbage)


def test_short_runs_cost_a_short_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records that differ every other one (two alternating kinds) must not make the scan look
    at the whole rest of the segment for each: that was quadratic (a failover's new leader
    loading 11,000 such messages took 3 s and lost its etcd lease meanwhile)."""
    looked = [0]
    alike = fmt._alike

    def counting(buf: object, q: int, rec: int, hdr: bytes, n: int) -> int:
        looked[0] += n
        return alike(buf, q, rec, hdr, n)  # type: ignore[arg-type]

    monkeypatch.setattr(fmt, "_alike", counting)
    buf = bytearray(fmt.HEADER)
    records = 4000
    for i in range(records):
        ex, rk, props, body_len = KINDS[i % 2]
        buf += (struct.pack("<q", 1_700_000_000_000 + i) + bytes([len(ex)]) + ex + bytes([len(rk)]) + rk
                + struct.pack("<I", len(props)) + props + struct.pack("<Q", body_len) + b"b" * body_len)
    got = fmt.scan(bytes(buf), len(buf), set(), False)
    assert got.count == records
    assert looked[0] <= 64 * records, looked[0]
