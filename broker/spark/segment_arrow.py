"""Segment bytes -> Arrow columns without a Python object per row (the data-dir read path).

Theory of operation
-------------------
A segment's records are variable-length (see ``broker/store/segment.py``), so finding where
each one starts is inherently sequential: ``walk`` does only that, in a tight Python loop that
reads four length fields per record and keeps the record's start position. Everything else is
column-wise over the whole batch with NumPy: the fixed-width fields (timestamp, lengths) are
gathered from the start positions, and each variable-length field (exchange, routing key,
properties, body) becomes an Arrow binary array whose data buffer is the field's bytes cut out
of the segment with one boolean mask (a +1/-1 difference array over the batch's byte span,
summed) and whose offsets are the running sum of the lengths. Property blobs are then
dictionary-encoded by Arrow, so each distinct blob is decoded once (``rows.PropsDecoder``).

The rows and their order are exactly those of ``rows.fill_from_segment`` for the same bounds:
a record is complete only if it fits in the file, a zero timestamp ends the segment, and
offsets count every record walked; timestamp bounds are applied as a mask afterwards, so a
batch may hold fewer than ``max_rows`` rows (batch boundaries carry no meaning).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from broker.store.segment import FIXED_SIZE, I64, U32, U64, record_end


def walk(buf: Any, size: int, pos: int, offset: int, start: int, stop: int, max_rows: int,
         max_bytes: int) -> tuple[Any, Any, int, int, bool]:
    """The complete records from ``pos`` (whose offset is ``offset``) with offsets in
    ``[start, stop)``, at most ``max_rows`` of them or about ``max_bytes`` walked.

    Returns (start positions, their timestamps: NumPy int64 arrays, next position, next
    offset, finished). The loop leaves the zero-timestamp check to NumPy afterwards: a zero
    (preallocated) area reads as records of 22 bytes, checked at once, and a torn record (its
    lengths written, not its timestamp) is cut off with everything walked after it.
    """
    import numpy as np  # type: ignore[import-not-found,import-untyped,unused-ignore]

    while offset < start and pos + FIXED_SIZE <= size:  # skip to ``start``, checking each record
        end = _end(buf, size, pos)
        if end is None:
            return *_none(np), pos, offset, True
        offset += 1
        pos = end
    u32 = U32.unpack_from
    u64 = U64.unpack_from
    starts: list[int] = []
    add = starts.append
    first = offset
    limit = min(max_rows, stop - offset)
    budget_end = pos + max_bytes
    n = 0
    done = False
    try:
        while n < limit:
            if pos >= budget_end:
                break
            q = pos + 9 + buf[pos + 8]
            q += 1 + buf[q]
            q += 4 + u32(buf, q)[0]
            end = q + 8 + u64(buf, q)[0]
            if end > size or end == pos + FIXED_SIZE:
                if end > size or not I64.unpack_from(buf, pos)[0]:
                    done = True
                    break
            add(pos)
            n += 1
            pos = end
        else:
            done = offset + n >= stop
    except (IndexError, struct.error):  # a length field past the end: an incomplete record
        done = True
    at = np.asarray(starts, dtype=np.int64)
    stamps = _fixed(np, np.frombuffer(buf, dtype=np.uint8, count=size), at, 8, "<i8")
    torn = np.flatnonzero(stamps == 0)
    if torn.size:
        k = int(torn[0])
        return at[:k], stamps[:k], int(at[k]), first + k, True
    return at, stamps, pos, first + n, done or pos + FIXED_SIZE > size


def _end(buf: Any, size: int, pos: int) -> int | None:
    """The end of the complete record at ``pos``, None if it is not one (the segment ends)."""
    if not I64.unpack_from(buf, pos)[0]:
        return None
    try:
        end = record_end(buf, pos)[0]
    except (IndexError, struct.error):  # a length field past the end
        return None
    return None if end > size else end


def _none(np: Any) -> Any:
    return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)


@dataclass
class SegmentColumns:
    """One batch's columns: NumPy offsets and millisecond stamps, Arrow binary fields."""

    offsets: Any
    stamps: Any
    exchanges: Any
    keys: Any
    props: Any
    bodies: Any

    def __len__(self) -> int:
        return len(self.offsets)


def columns(buf: Any, at: Any, stamps: Any, first_offset: int, ts_lo: int | None,
            ts_hi: int | None) -> SegmentColumns:
    """The columns of the records at ``at`` with timestamps ``stamps`` (from ``walk``; the
    first has offset ``first_offset`` and the rest follow it one by one), minus those outside
    the inclusive timestamp bounds."""
    import numpy as np  # type: ignore[import-not-found,import-untyped,unused-ignore]

    u8 = np.frombuffer(buf, dtype=np.uint8)
    try:
        offsets = np.arange(first_offset, first_offset + len(at), dtype=np.int64)
        if ts_lo is not None or ts_hi is not None:
            keep = np.ones(len(at), dtype=np.bool_)
            if ts_lo is not None:
                keep &= stamps >= ts_lo
            if ts_hi is not None:
                keep &= stamps <= ts_hi
            at, offsets, stamps = at[keep], offsets[keep], stamps[keep]
        ex_at = at + 9
        ex_len = u8[at + 8].astype(np.int64)
        rk_at = ex_at + ex_len + 1
        rk_len = u8[rk_at - 1].astype(np.int64)
        pr_at = rk_at + rk_len + 4
        pr_len = _fixed(np, u8, pr_at - 4, 4, "<u4").astype(np.int64)
        body_at = pr_at + pr_len + 8
        body_len = _fixed(np, u8, body_at - 8, 8, "<u8").astype(np.int64)
        return SegmentColumns(offsets, stamps, _binary(np, u8, ex_at, ex_len),
                              _binary(np, u8, rk_at, rk_len), _binary(np, u8, pr_at, pr_len),
                              _binary(np, u8, body_at, body_len))
    finally:
        del u8  # no view of an mmap may outlive this call (the caller closes it)


def _fixed(np: Any, u8: Any, at: Any, width: int, dtype: str) -> Any:
    """The little-endian ``dtype`` values ``width`` bytes long at positions ``at``."""
    if not len(at):
        return np.zeros(0, dtype=dtype)
    return u8[at[:, None] + np.arange(width)].view(dtype).reshape(-1)


def _binary(np: Any, u8: Any, at: Any, lengths: Any) -> Any:
    """An Arrow binary array of the byte ranges ``[at, at + lengths)`` (ascending, disjoint).

    The ranges and the gaps between them, alternating, cover the batch's byte span with
    ascending offsets, so they are one binary array over the segment bytes as they lie;
    taking its even elements copies the ranges out (in Arrow, without a Python object each).
    """
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]

    n = len(at)
    if not n:
        return pa.array([], type=pa.binary())
    base = int(at[0])
    edges = np.empty(2 * n, dtype=np.int64)
    edges[0::2] = at - base
    edges[1::2] = at + lengths - base
    span = int(edges[-1])
    wide = span >= 1 << 31
    typ, dtype = (pa.large_binary(), np.int64) if wide else (pa.binary(), np.int32)
    runs = pa.Array.from_buffers(typ, 2 * n - 1, [None, pa.py_buffer(edges.astype(dtype)),
                                                 pa.py_buffer(u8[base:base + span])])
    out = runs.take(pa.array(np.arange(0, 2 * n, 2, dtype=np.int32)))
    return out.cast(pa.binary()) if wide else out
