"""StreamStore: the append-only log of one stream queue.

Theory of operation
-------------------
A stream is a commit log: messages are appended, numbered by a dense 64-bit *offset*
(0, 1, 2, ...), never removed on ack, and read by any number of consumers from any offset,
again and again. Only retention removes data, and only whole segments from the front.

Files in the queue directory:

* ``msgs.NNNNNNNNNN``: segments in the same record format as classic queues (``segment.py``),
  so the replication layer, recovery rules (zero timestamp = end, torn tail dropped) and
  readers are shared. Written through the same ``SegmentLog`` as ``QueueStore``: space
  allocated before it is written, mapped, timestamp stored last, trimmed when retired.
* ``sidx.NNNNNNNNNN``: the segment index, written when the segment is created: magic,
  version, offset of its first record, timestamp of its first record, crc32. Locating an
  offset or a timestamp is a binary search over these (in memory) plus a walk of ONE segment;
  opening the store reads the index files and walks only the last segment.
* ``offsets``: server-side consumer offsets (consumer tag -> next offset to deliver, i.e. one
  past the last contiguously *acked* message), rewritten atomically on sync when changed.

Segment counts come from the index (next segment's first offset minus this one's); a segment
whose index is missing or whose successor's is (a crash before the index reached the disk) is
walked instead and its index rewritten. Appends after a restart go to a fresh segment, as in
``QueueStore``, so nothing is ever written after recovered bytes.

Retention (``x-max-length``, ``x-max-length-bytes``, ``x-max-age``) deletes the oldest
segments while the log exceeds a limit; the write segment is never deleted, nor the newest
segment holding records while every segment after it is empty (a write segment rolled for a
publish not written yet: ``_records_after_oldest``), so the log may hold fewer messages than
a limit right after a deletion (RabbitMQ semantics: limits are caps,
enforced per segment). Retention runs after the first write into a new segment (the old
one retired) and when asked (``apply_retention``). A segment's newest message is bounded by
the first timestamp of the next segment, which is what the age rule compares.

Chunk-level paths: ``append_run`` writes a run of records as one buffer with one pwrite, its
first timestamp last (recovery sees the whole run or none of it), and sends the replication
sink one append; ``read_run`` slices a run of consecutive records of one segment (bounded in
count and body bytes) for the stream protocol's Deliver chunks; ``read_joined`` returns a run
of alike records with their bodies already joined behind the reader's entry prefix (the
Deliver chunk's data section). A run appended with ``same`` is remembered in memory by its
segment (its span: ``_Seg.note_alike``), so reading it back checks nothing; spans not
remembered (recovered segments, a promoted replica) are proved alike by comparing their
rebuilt heads first. The on-disk format is unchanged by either.

Read-only access for analytics (a stopped broker's data dir, a follower's replicated copy)
goes through ``list_segments`` / ``iter_segment``: they never write, and stop at the first
zero or incomplete record, so a segment being appended to is read up to its last complete
record.

Threads: like ``QueueStore``, ``sync`` may run on a worker thread; it takes ``_lock`` to
snapshot what it must write and fsyncs outside it. The sink is called only from the owner
(event loop) thread.
"""

from __future__ import annotations

import array
import bisect
import functools
import json
import mmap
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from broker.errors import StoreError
from broker.store import segment as fmt
from broker.store.fileio import atomic_write
from broker.store.segment import HEADER, HEADER_SIZE, LogSegment
from broker.store.segment_log import SegmentFiles, SegmentLog, is_no_space
from broker.store.sequences import SequenceLog
from broker.store.sink import NULL_SINK, ReplicationSink

DEFAULT_SEGMENT_SIZE: Final = 8 * 1024 * 1024
OFFSETS_NAME: Final = "offsets"
INDEX_PREFIX: Final = "sidx."
_INDEX: Final = struct.Struct("<4sIQq")  # magic, version, first offset, first timestamp (ms)
_INDEX_MAGIC: Final = b"SKSI"
_INDEX_VERSION: Final = 1
_CRC: Final = struct.Struct("<I")
# largest span of alike records checked by one rebuild-and-compare in ``read_run``: larger
# copies cost more than the per-record loop saves (fresh large allocations), so they walk
_ONE_COMPARE_MAX: Final = 64 * 1024
# alike runs remembered (``_Seg.note_alike``): those of at least _ALIKE_MIN records, at most
# _ALIKE_MAX per segment, in the newest _ALIKE_SEGMENTS segments (at most 256 KiB of spans a
# segment, 2 MiB a stream); any other run is proved alike when read
_ALIKE_MIN: Final = 8
_ALIKE_MAX: Final = 1 << 14
_ALIKE_SEGMENTS: Final = 8
_I64: Final = fmt.I64
_U32_PACK: Final = fmt.U32.pack
_U64_PACK: Final = fmt.U64.pack
_U32_FROM: Final = fmt.U32.unpack_from
_U64_FROM: Final = fmt.U64.unpack_from

# (offset, timestamp_ms, exchange, routing_key, props, body)
Record = tuple[int, int, bytes, bytes, bytes, bytes]

_AGE_UNITS: Final = {"Y": 365 * 86400, "M": 30 * 86400, "D": 86400, "h": 3600, "m": 60, "s": 1}
_AGE_RE: Final = re.compile(r"^(\d+)([YMDhms])$")


def parse_age(value: str) -> int:
    """``7D``/``12h``/``30m``/``10s`` (also ``Y``, ``M``) as milliseconds; ValueError otherwise."""
    m = _AGE_RE.match(value.strip())
    if m is None:
        raise ValueError(f"invalid age {value!r} (expected e.g. 7D, 12h, 30m, 10s)")
    return int(m.group(1)) * _AGE_UNITS[m.group(2)] * 1000


def index_name(num: int) -> str:
    return f"{INDEX_PREFIX}{num:010d}"


def encode_index(first_offset: int, first_ts: int) -> bytes:
    head = _INDEX.pack(_INDEX_MAGIC, _INDEX_VERSION, first_offset, first_ts)
    return head + _CRC.pack(zlib.crc32(head))


def decode_index(data: bytes) -> tuple[int, int] | None:
    """(first offset, first timestamp) or None if missing, torn or foreign."""
    if len(data) != _INDEX.size + _CRC.size:
        return None
    head = data[:_INDEX.size]
    if _CRC.unpack_from(data, _INDEX.size)[0] != zlib.crc32(head):
        return None
    magic, version, first_offset, first_ts = _INDEX.unpack(head)
    if magic != _INDEX_MAGIC or version != _INDEX_VERSION:
        return None
    return int(first_offset), int(first_ts)


@dataclass
class Retention:
    max_length: int | None = None
    max_bytes: int | None = None
    max_age_ms: int | None = None

    @property
    def active(self) -> bool:
        return not (self.max_length is None and self.max_bytes is None and self.max_age_ms is None)


class _Seg(LogSegment):
    __slots__ = ("idx_path", "first_offset", "first_ts", "_alike_starts", "_alike_ends")

    def __init__(self, directory: Path, num: int, first_offset: int, first_ts: int) -> None:
        super().__init__(directory, num)
        self.idx_path = directory / index_name(num)
        self.first_offset = first_offset
        self.first_ts = first_ts
        # spans of runs appended alike (``append_run(same=True)``) by this process, in order:
        # ``read_joined`` reads them without comparing heads; memory only, never recovered
        self._alike_starts = array.array("Q")
        self._alike_ends = array.array("Q")

    def note_alike(self, start: int, end: int) -> None:
        if len(self._alike_starts) < _ALIKE_MAX:
            self._alike_starts.append(start)
            self._alike_ends.append(end)

    def forget_alike(self) -> None:
        self._alike_starts = array.array("Q")
        self._alike_ends = array.array("Q")

    def alike_end(self, pos: int) -> int:
        """The end of the alike run holding the record at ``pos``, or 0 if none is known."""
        i = bisect.bisect_right(self._alike_starts, pos) - 1
        if i >= 0:
            end: int = self._alike_ends[i]
            if pos < end:
                return end
        return 0


@functools.lru_cache(maxsize=64)
def _bodies_at_stride(head_len: int, body_len: int, n: int) -> struct.Struct:
    """Unpacks the bodies of ``n`` records of one head length and one body length."""
    return struct.Struct(f"{head_len}x{body_len}s" * n)


class StreamPosition:
    """A reader's place in the log: the next offset and where its record starts."""

    __slots__ = ("offset", "seg", "pos")

    def __init__(self, offset: int, seg: int, pos: int) -> None:
        self.offset = offset
        self.seg = seg
        self.pos = pos


class StreamStore(SegmentLog[_Seg]):
    __slots__ = ("retention", "_firsts", "_next_offset", "_last_chunk", "_count", "_bytes", "_offsets",
                 "_offsets_path", "_offsets_written", "_offsets_sent", "_seqlog", "_retain_due")

    def __init__(self, directory: Path, *, segment_size: int = DEFAULT_SEGMENT_SIZE,
                 sink: ReplicationSink = NULL_SINK, retention: Retention | None = None,
                 files: SegmentFiles | None = None) -> None:
        self._init_log(directory, segment_size, sink, files)
        self.retention = retention or Retention()
        self._firsts: list[int] = []  # first offsets, parallel to _order (bisect)
        self._next_offset = 0
        self._last_chunk: int | None = None  # first offset of the last append; None: not known yet
        self._count = 0
        self._bytes = 0  # segment bytes on disk (header + records)
        self._retain_due = False  # a segment was retired: retention runs after the next write
        self._offsets: dict[str, int] = {}
        self._offsets_path = directory / OFFSETS_NAME
        self._offsets_written = b""
        self._offsets_sent = b""
        self._unsynced_paths: set[Path] = set()
        self._seqlog = SequenceLog(directory, sink, self._files)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._recover()
        except OSError as exc:
            self._close_files()
            raise StoreError(f"stream store {directory}: {exc}") from exc
        except BaseException:
            self._close_files()
            raise

    # ------------------------------------------------------------------ appending

    def append(self, timestamp_ms: int, exchange: bytes, routing_key: bytes,
               props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int:
        """Append one record; returns its offset."""
        size = fmt.record_size(exchange, routing_key, props, body)
        seg, mm = self._room(size, timestamp_ms)
        pos = seg.end
        fmt.write_record(self._wfd, pos, size, exchange, routing_key, props, body)
        return self._written(seg, mm, pos, pos + size, timestamp_ms, 1)

    def _room(self, size: int, timestamp_ms: int) -> tuple[_Seg, mmap.mmap]:
        """The write segment with ``size`` bytes of room, and its map."""
        seg = self._wseg
        if seg is None or seg.end + size > self._wcap:
            seg = self._roll(size, timestamp_ms)
        mm = self._wmm
        assert mm is not None
        return seg, mm

    def _written(self, seg: _Seg, mm: mmap.mmap, pos: int, end: int, timestamp_ms: int, count: int) -> int:
        """Publish ``count`` records written at ``pos``..``end`` of the write segment, complete
        but for the first one's timestamp, which goes in now: last, so the record (or the
        whole run) becomes visible to readers and recovery at once. Returns the first offset."""
        _I64.pack_into(mm, pos, timestamp_ms if timestamp_ms else 1)
        seg.end = end
        seg.count += count
        offset = self._next_offset
        self._next_offset = offset + count
        self._last_chunk = offset
        self._count += count
        self._bytes += end - pos
        self._dirty = True
        self._seg_unsynced = True
        if self._sink.active:
            self._sink.append(seg.path, mm[pos:end])
        if self._retain_due:
            self._retain_due = False
            self.apply_retention(timestamp_ms)
        return offset

    def append_run(self, timestamp_ms: int, exrk: bytes, props: list[bytes], bodies: list[bytes],
                   same: bool = False) -> int:
        """Append a run of records with one timestamp, exchange and routing key (``exrk``:
        the two short strings) as one write; returns the first one's offset.

        Chunk-level append: the records are joined into one buffer and written with one
        pwrite into one segment (room for all of them allocated first, so DiskFull stores
        none), the first record's timestamp last, so a reader or recovery after kill -9 sees
        the whole run or none of it; the counters, the index (the segment's first offset)
        and the replication sink are updated once for the run. ``same``: one properties value
        and one body length for the whole run (the records' heads are then all alike)."""
        k = len(bodies)
        if not k:
            return self._next_offset
        ts = _I64.pack(timestamp_ms if timestamp_ms else 1)
        if same:
            head = b"".join((ts, exrk, _U32_PACK(len(props[0])), props[0], _U64_PACK(len(bodies[0]))))
            blob = head + head.join(bodies)
        else:
            blob = fmt.join_records(ts, exrk, props, bodies)
        size = len(blob)
        seg, mm = self._room(size, timestamp_ms)
        pos = seg.end
        fmt.write_at(self._wfd, pos + 8, (memoryview(blob)[8:],), size - 8)  # first timestamp still zero
        if same and k >= _ALIKE_MIN:
            seg.note_alike(pos, pos + size)
        return self._written(seg, mm, pos, pos + size, timestamp_ms, k)

    def make_room(self, size: int, props: bytes | memoryview, timestamp_ms: int) -> None:
        """The write segment with ``size`` bytes of room allocated (a new one, stamped
        ``timestamp_ms``, if need be): DiskFull now, before a message or run routed to several
        queues is written anywhere. The appends that follow fit without rolling."""
        seg = self._wseg
        if seg is None or seg.end + size > self._wcap:
            self._roll(size, timestamp_ms)

    def _roll(self, need: int, first_ts: int) -> _Seg:
        """The write segment with room for ``need`` bytes: more of it allocated, or a new
        segment (index file first) starting with a record stamped ``first_ts``."""
        seg = self._grow(need)
        if seg is not None:
            return seg
        if self._closed:
            raise StoreError(f"stream store {self.directory} is closed")
        seg = _Seg(self.directory, self._next_num, self._next_offset, first_ts if first_ts else 1)
        index = encode_index(seg.first_offset, seg.first_ts)
        # Index before the segment: a segment file never exists without its index unless the
        # index write itself was lost (recovery then rebuilds it from the neighbours).
        _write_new(seg.idx_path, index, self._files)
        try:
            old = self._start_segment(seg, need)
        except BaseException:
            seg.idx_path.unlink(missing_ok=True)
            raise
        with self._lock:
            self._firsts.append(seg.first_offset)
            self._bytes += HEADER_SIZE
            self._unsynced_paths.add(seg.idx_path)
        if len(self._order) > _ALIKE_SEGMENTS:
            self._segs[self._order[-_ALIKE_SEGMENTS - 1]].forget_alike()
        if self._sink.active:
            self._sink.replace(seg.idx_path, index)
        if old is not None and self.retention.active:
            self._retain_due = True  # once a record is in the new segment (``_written``)
        return seg

    # ------------------------------------------------------------------ retention

    def apply_retention(self, now_ms: int) -> int:
        """Delete oldest whole segments while a limit is exceeded; returns segments deleted."""
        r = self.retention
        deleted = 0
        while len(self._order) > 1:
            oldest = self._segs[self._order[0]]
            if oldest is self._wseg:
                break
            newer = self._segs[self._order[1]]
            over = ((r.max_length is not None and self._count > r.max_length)
                    or (r.max_bytes is not None and self._bytes > r.max_bytes)
                    or (r.max_age_ms is not None and newer.first_ts < now_ms - r.max_age_ms))
            if not over or not self._records_after_oldest():
                break
            self._delete_oldest()
            deleted += 1
        return deleted

    def next_age_expiry(self) -> int | None:
        """When (ms) the age limit next removes a segment, or None (no limit, nothing removable).

        The oldest segment goes once its successor's first timestamp (a bound on its newest
        message) is older than ``max_age``; the write segment is never removed.
        """
        age = self.retention.max_age_ms
        if age is None or len(self._order) < 2 or self._segs[self._order[0]] is self._wseg \
                or not self._records_after_oldest():
            return None
        return self._segs[self._order[1]].first_ts + age

    def _records_after_oldest(self) -> bool:
        """Whether a segment newer than the oldest holds a record. Room made for a publish
        (``make_room``) rolls an empty write segment before anything is written, and the
        publish may still be refused (a full disk at another queue it reaches): retention
        keeps the newest segment holding records until one after it does, so it never
        empties a stream (whose extent, read over AMQP as a count, would then be lost)."""
        segs = self._segs
        return any(segs[num].count for num in reversed(self._order[1:]))

    def _delete_oldest(self) -> None:
        seg = self._segs[self._order[0]]
        self._unmap(seg)
        with self._lock:
            del self._segs[seg.num]
            del self._order[0]
            del self._firsts[0]
            self._count -= seg.count
            self._bytes -= seg.end
            self._unsynced_paths.discard(seg.path)
            self._unsynced_paths.discard(seg.idx_path)
            # Segment first, then its index: an orphan index is ignored at recovery.
            seg.path.unlink(missing_ok=True)
            seg.idx_path.unlink(missing_ok=True)
            self._dir_unsynced = True
        if self._sink.active:
            self._sink.delete(seg.path)
            self._sink.delete(seg.idx_path)

    # ------------------------------------------------------------------ locating

    @property
    def first_offset(self) -> int:
        """Offset of the oldest message still held (== next_offset when empty)."""
        for num in self._order:
            seg = self._segs[num]
            if seg.count:
                return seg.first_offset
        return self._next_offset

    @property
    def next_offset(self) -> int:
        return self._next_offset

    @property
    def count(self) -> int:
        return self._count

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def segment_infos(self) -> list[tuple[int, int, int, int]]:
        """(segment number, first offset, first timestamp, count) of each segment, oldest first."""
        segs = [self._segs[n] for n in self._order]
        return [(s.num, s.first_offset, s.first_ts, s.count) for s in segs]

    @property
    def last_chunk_offset(self) -> int:
        """Offset of the first message of the last chunk stored (``next_offset`` when empty):
        where RabbitMQ's offset spec ``last`` starts.

        A chunk is what one append stored: one ``append_run`` (a stream-protocol Publish
        frame, an AMQP publish run) or one ``append``. Appends made since this store was
        opened are remembered exactly; after a restart (or on a new leader, which opens the
        replicated files) the last chunk is read back from the newest segment holding
        records: its trailing records that share the last one's timestamp (a run is stored
        with one timestamp), so two appends within the same millisecond read back as one."""
        first = self.first_offset
        if self._last_chunk is None:
            self._last_chunk = self._recovered_last_chunk()
        return min(max(self._last_chunk, first), self._next_offset)

    def _recovered_last_chunk(self) -> int:
        for num in reversed(self._order):
            seg = self._segs[num]
            if not seg.count:
                continue
            mm = self._map_read(seg)
            pos = HEADER_SIZE
            start, ts = 0, None
            for i in range(seg.count):  # one walk of one segment, once per store opening
                t = _I64.unpack_from(mm, pos)[0]
                if t != ts:
                    start, ts = i, t
                pos = fmt.record_end(mm, pos)[0]
            return seg.first_offset + start
        return self._next_offset

    def seek(self, offset: int) -> StreamPosition:
        """A position at ``offset`` clamped to [first_offset, next_offset]."""
        first = self.first_offset
        if offset <= first:
            offset = first
        if offset >= self._next_offset or not self._order:
            w = self._wseg
            if w is not None:  # the next append lands here
                return StreamPosition(self._next_offset, w.num, w.end)
            return StreamPosition(self._next_offset, self._next_num, HEADER_SIZE)
        i = bisect.bisect_right(self._firsts, offset) - 1
        seg = self._segs[self._order[i]]
        mm = self._map_read(seg)
        pos = HEADER_SIZE
        for _ in range(offset - seg.first_offset):  # walk within ONE segment
            pos = fmt.record_end(mm, pos)[0]
        return StreamPosition(offset, seg.num, pos)

    def offset_for_timestamp(self, ts_ms: int) -> int:
        """Offset of the first message with timestamp >= ``ts_ms`` (next_offset if none)."""
        j = bisect.bisect_left([self._segs[n].first_ts for n in self._order], ts_ms)
        if j > 0:
            seg = self._segs[self._order[j - 1]]
            mm = self._map_read(seg)
            pos = HEADER_SIZE
            for i in range(seg.count):
                if _I64.unpack_from(mm, pos)[0] >= ts_ms:
                    return seg.first_offset + i
                pos = fmt.record_end(mm, pos)[0]
        if j < len(self._order):
            return self._segs[self._order[j]].first_offset
        return self._next_offset

    def read_next(self, p: StreamPosition) -> Record | None:
        """The record at ``p`` (advancing ``p``), or None at the end of the log."""
        if self._locate(p) is None:
            return None
        mm = self._map_read(self._segs[p.seg])
        ts, ex, rk, props, body = fmt.read_record(mm, p.pos)
        offset = p.offset
        p.pos = fmt.record_end(mm, p.pos)[0]
        p.offset = offset + 1
        return offset, ts, ex, rk, props, body

    def read_run(self, p: StreamPosition, max_count: int, max_bytes: int
                 ) -> tuple[int, int, list[bytes], list[bytes], bool] | None:
        """Chunk-level read: up to ``max_count`` consecutive records from ``p`` (advancing
        it), stopping early once their bodies reach ``max_bytes`` and at the end of ``p``'s
        segment, as (first offset, first record's timestamp, their properties, their
        bodies, same); None at the end of the log. ``same`` is True only when the read
        proved every record of the run has one properties value and one body length (an
        alike run: their stored heads compared equal), so a consumer may frame them with
        one length prefix without checking; False says nothing. One bounds check per
        segment, not per record: the walk slices the map and keeps no per-record tuple."""
        head = self._run_head(p, max_count)
        if head is None:
            return None
        seg, mm, n = head
        pos = p.pos
        first_ts: int = _I64.unpack_from(mm, pos)[0]
        alike = self._alike_run(mm, pos, n, max_bytes, seg.end)
        if alike is not None:
            p0, bodies, pos = alike
            first = p.offset
            p.pos = pos
            p.offset = first + len(bodies)
            return first, first_ts, [p0] * len(bodies), bodies, True
        props: list[bytes] = []
        bodies = []
        add_p = props.append
        add_b = bodies.append
        size = 0
        i = 0
        while i < n and size < max_bytes:
            q = pos + 9 + mm[pos + 8]
            q += 1 + mm[q]
            end = q + 4 + _U32_FROM(mm, q)[0]
            add_p(mm[q + 4:end])
            q = end + 8 + _U64_FROM(mm, end)[0]
            add_b(mm[end + 8:q])
            size += q - end - 8
            pos = q
            i += 1
        first = p.offset
        p.pos = pos
        p.offset = first + i
        return first, first_ts, props, bodies, False

    def read_records(self, p: StreamPosition, max_count: int, max_bytes: int, max_walk: int = 1 << 16
                     ) -> tuple[int, int, bytes] | None:
        """Raw read: the stored bytes of up to ``max_count`` consecutive records from ``p``
        (advancing it), exactly as they lie in ``p``'s segment (the segment format, see
        ``segment.py``), as (first offset, count, bytes); None at the end of the log. Stops at
        the end of the segment and before the record that would take the bytes past
        ``max_bytes``, but always takes one record. When the rest of the segment is wanted
        and fits, it is one slice with no walk; otherwise the records' lengths are walked, at
        most ``max_walk`` of them (the walk is Python, about 0.3 µs a record)."""
        head = self._run_head(p, max_count)
        if head is None:
            return None
        seg, mm, n = head
        pos = p.pos
        if p.offset + n == seg.first_offset + seg.count and seg.end - pos <= max_bytes:
            end = seg.end
        else:
            limit = pos + max(max_bytes, 1)
            end = fmt.record_end(mm, pos)[0]
            n = min(n, max_walk)
            i = 1
            while i < n:
                nxt = fmt.record_end(mm, end)[0]
                if nxt > limit:
                    break
                end = nxt
                i += 1
            n = i
        first = p.offset
        data = mm[pos:end]
        p.pos = end
        p.offset = first + n
        return first, n, data

    def read_joined(self, p: StreamPosition, max_count: int, max_bytes: int,
                    prefix_for: Callable[[bytes, int], bytes | None]) -> tuple[int, int, int, bytes] | None:
        """An alike run from ``p`` already framed for a consumer: (first offset, timestamp,
        count, data), ``data`` being each body preceded by ``prefix_for(properties, body
        length)``, which the consumer chooses (its wire's entry header); ``p`` advances.
        Bounded as ``read_run``. None, ``p`` untouched, at the end of the log, when fewer
        than two records at ``p`` are alike (the consumer then takes ``read_run``), or when
        ``prefix_for`` says None.

        Where the run came from decides what is checked. A run this store appended with
        ``same`` (its span is in the segment's ``alike`` map) is known alike: its bodies
        are unpacked at a fixed stride with nothing compared. Any other span (a segment
        recovered after a restart, a replica promoted) is proved alike by ``_alike_run``'s
        rebuild-and-compare first. Either way the bodies are joined with the prefix in one
        C-level pass: one bytes object per record, no per-record Python step."""
        head = self._run_head(p, max_count)
        if head is None:
            return None
        seg, mm, n = head
        pos = p.pos
        q = pos + 9 + mm[pos + 8]
        q += 1 + mm[q]
        body_at = q + 4 + _U32_FROM(mm, q)[0] + 8
        bs: int = _U64_FROM(mm, body_at - 8)[0]
        prefix = prefix_for(mm[q + 4:body_at - 8], bs)
        if prefix is None:
            return None
        end = seg.alike_end(pos)
        if end:
            hl = body_at - pos
            stride = hl + bs
            n = min(n, (end - pos) // stride, -(-max_bytes // bs) if bs else n)
            if n < 2:
                return None
            bodies: list[bytes] | tuple[bytes, ...] = _bodies_at_stride(hl, bs, n).unpack_from(mm, pos)
            end = pos + n * stride
        else:
            alike = self._alike_run(mm, pos, n, max_bytes, seg.end)
            if alike is None:
                return None
            _props, bodies, end = alike
            n = len(bodies)
        first = p.offset
        p.pos = end
        p.offset = first + n
        return first, _I64.unpack_from(mm, pos)[0], n, prefix + prefix.join(bodies)

    @staticmethod
    def _alike_run(mm: mmap.mmap, pos: int, n: int, max_bytes: int, end: int
                   ) -> tuple[bytes, list[bytes], int] | None:
        """A run stored by one ``append_run(same=True)`` read in one C-level unpack: its
        records share one head (timestamp, names, properties, body length), so the ones
        from ``pos`` whose head equals the first's are (head, body) at a fixed stride. Only
        that prefix is kept; each of its records began where the one before ended, so this
        is exactly what the record-by-record walk reads. (properties, bodies, end) or None
        when fewer than two records are alike."""
        q = pos + 9 + mm[pos + 8]
        q += 1 + mm[q]
        body_at = q + 4 + _U32_FROM(mm, q)[0] + 8
        hl = body_at - pos
        bs: int = _U64_FROM(mm, body_at - 8)[0]
        stride = hl + bs
        if bs:
            n = min(n, -(-max_bytes // bs))  # stop once the bodies reach max_bytes
        n = min(n, (end - pos) // stride)
        if n < 2:
            return None
        head = mm[pos:body_at]
        blob = mm[pos:pos + n * stride]
        if n * stride <= _ONE_COMPARE_MAX:
            # the usual case, every record of the span alike: the bodies in one unpack that
            # skips the heads, checked by one comparison against the span rebuilt from them
            # (no Python step per record; about half the CPU of the loop below, measured)
            bodies = list(struct.unpack(f"{hl}x{bs}s" * n, blob))
            if head + head.join(bodies) == blob:
                return head[q + 4 - pos:hl - 8], bodies, pos + n * stride
        rows = struct.iter_unpack(f"{hl}s{bs}s", blob)
        bodies = []
        add = bodies.append
        for h, body in rows:
            if h != head:
                break
            add(body)
        if len(bodies) < 2:
            return None
        props = head[q + 4 - pos:hl - 8]
        return props, bodies, pos + len(bodies) * stride

    def _run_head(self, p: StreamPosition, max_count: int) -> tuple[_Seg, mmap.mmap, int] | None:
        """Where a run read from ``p`` starts: its segment, that segment's read map and how
        many records the run may take (``max_count`` at most, never past the segment); None
        at the end of the log. ``read_run`` and ``read_joined`` both start here."""
        if self._locate(p) is None:
            return None
        seg = self._segs[p.seg]
        return seg, self._map_read(seg), min(max_count, seg.first_offset + seg.count - p.offset)

    def _locate(self, p: StreamPosition) -> StreamPosition | None:
        """``p`` moved onto the segment holding its next record (across retention and
        segment ends), or None at the end of the log."""
        while True:
            seg = self._segs.get(p.seg)
            if seg is None or p.offset < seg.first_offset:
                if p.offset >= self._next_offset:
                    return None
                q = self.seek(p.offset)
                if q.seg == p.seg and q.pos == p.pos:
                    return None
                p.offset, p.seg, p.pos = q.offset, q.seg, q.pos
                continue
            if p.offset >= seg.first_offset + seg.count:
                if seg is self._wseg or p.offset >= self._next_offset:
                    return None
                i = bisect.bisect_right(self._order, seg.num)
                if i == len(self._order):
                    return None
                p.seg, p.pos = self._order[i], HEADER_SIZE
                continue
            return p

    def read_at(self, offset: int) -> Record | None:
        if offset < self.first_offset or offset >= self._next_offset:
            return None
        return self.read_next(self.seek(offset))

    # ------------------------------------------------------------------ consumer offsets

    def stored_offset(self, tag: str) -> int | None:
        return self._offsets.get(tag)

    def store_offset(self, tag: str, offset: int) -> None:
        if self._offsets.get(tag) != offset:
            with self._lock:
                self._offsets[tag] = offset
            self._dirty = True

    def store_sequence(self, name: str, value: int) -> None:
        """Store a publisher sequence (``value`` under ``name``, as ``store_offset``) and append
        it at once to the ``sequences`` file, in order with the log (``sequences.py``): it
        survives kill -9 and reaches followers with the messages it covers."""
        self.store_offset(name, value)
        if self._seqlog.append(name, value, self._next_offset):
            with self._lock:
                self._unsynced_paths.add(self._seqlog.path)
            self._dirty = True

    def _offsets_bytes(self) -> bytes:
        return json.dumps({"version": 1, "offsets": self._offsets}, sort_keys=True).encode()

    # ------------------------------------------------------------------ QueueStore-like counters

    @property
    def ready_count(self) -> int:
        return self._count  # RabbitMQ reports a stream's messages as ready

    @property
    def unacked_count(self) -> int:
        return 0

    @property
    def bytes_ready(self) -> int:
        return self._bytes

    @property
    def dirty(self) -> bool:
        return self._dirty

    # ------------------------------------------------------------------ durability

    def flush(self) -> None:
        """Hand a changed offsets file to the sink (owner thread); a closed or deleted stream
        has nothing left to hand over (see ``QueueStore.flush``)."""
        if self._sink.active and not self._closed:
            data = self._offsets_bytes()
            if data != self._offsets_sent:
                self._offsets_sent = data
                self._sink.replace(self._offsets_path, data)

    def _sync_locked(self, full: bool, paths: list[Path]) -> Callable[[], None] | None:
        """Changed consumer offsets are rewritten (atomically) after the fsyncs."""
        offsets = self._offsets_bytes() if self._offsets else b""
        if not offsets or offsets == self._offsets_written:
            return None

        def write_offsets() -> None:
            atomic_write(self._offsets_path, offsets)
            self._offsets_written = offsets

        return write_offsets

    def _before_close(self) -> None:
        self.flush()

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        infos = list_segments(self.directory, scan_last=False)
        nums = [i.num for i in infos]
        for entry in os.scandir(self.directory):
            num = fmt.parse_number(entry.name, INDEX_PREFIX)
            if num is not None and num not in nums:  # orphan index (segment deleted first)
                self._remove_file(Path(entry.path))
        for k, info in enumerate(infos):
            last = k == len(infos) - 1
            if last or info.count is None:
                end, count, first_ts, garbage = _walk(info.path)
                size = info.path.stat().st_size
                if end < size:
                    with open(info.path, "r+b") as f:
                        f.truncate(end)
                    if garbage and self._sink.active:
                        self._sink.replace(info.path, info.path.read_bytes())
                info.count, info.end = count, end
                if info.first_ts is None:
                    info.first_ts = first_ts
        _fill_first_offsets(infos)
        for info in infos:
            assert info.first_offset is not None and info.count is not None
            if info.count == 0 and not info.indexed:
                self._remove_file(info.path)  # crash between creating a segment and its index
                continue
            seg = _Seg(self.directory, info.num, info.first_offset, info.first_ts or 1)
            seg.count = info.count
            seg.end = info.end
            if not info.indexed:
                data = encode_index(seg.first_offset, seg.first_ts)
                atomic_write(seg.idx_path, data)
                if self._sink.active:
                    self._sink.replace(seg.idx_path, data)
            self._segs[seg.num] = seg
            self._order.append(seg.num)
            self._firsts.append(seg.first_offset)
            self._count += seg.count
            self._bytes += seg.end
        if self._order:
            last_seg = self._segs[self._order[-1]]
            self._next_offset = last_seg.first_offset + last_seg.count
        self._next_num = max(nums, default=0) + 1
        try:
            raw = json.loads(self._offsets_path.read_bytes())
            self._offsets = {str(k): int(v) for k, v in raw.get("offsets", {}).items()}
            self._offsets_written = self._offsets_sent = self._offsets_bytes()
        except FileNotFoundError:
            pass
        except (ValueError, AttributeError, TypeError) as exc:
            raise StoreError(f"{self._offsets_path}: unreadable consumer offsets: {exc}") from exc
        for name, seq in self._seqlog.load(self._next_offset).items():
            if seq > self._offsets.get(name, -1):
                self._offsets[name] = seq


# ---------------------------------------------------------------------- read-only access


@dataclass
class SegmentInfo:
    num: int
    path: Path
    first_offset: int | None
    first_ts: int | None
    count: int | None  # None: unknown without walking the segment
    end: int
    indexed: bool


def list_segments(directory: Path, *, scan_last: bool = True) -> list[SegmentInfo]:
    """Segments of a stream directory with their index data, oldest first. Never writes.

    Counts come from consecutive index entries; the last segment (and any segment whose
    own or successor's index is missing) has ``count`` None unless ``scan_last`` walks it.
    """
    nums: list[int] = []
    for entry in os.scandir(directory):
        num = fmt.parse_number(entry.name, "msgs.")
        if num is not None:
            nums.append(num)
    nums.sort()
    infos: list[SegmentInfo] = []
    for num in nums:
        path = directory / fmt.segment_name(num)
        try:
            idx = decode_index((directory / index_name(num)).read_bytes())
            size = path.stat().st_size
        except FileNotFoundError:
            idx, size = None, 0
        infos.append(SegmentInfo(num, path, idx[0] if idx else None, idx[1] if idx else None,
                                 None, size, idx is not None))
    for a, b in zip(infos, infos[1:], strict=False):
        if a.first_offset is not None and b.first_offset is not None:
            a.count = b.first_offset - a.first_offset
    if scan_last:
        for info in infos:
            if info.count is None:
                end, count, first_ts, _garbage = _walk(info.path)
                info.count, info.end = count, end
                if info.first_ts is None:
                    info.first_ts = first_ts
        _fill_first_offsets(infos)
    return infos


def _fill_first_offsets(infos: list[SegmentInfo]) -> None:
    """Derive missing first offsets from neighbours (forward, then backward for a prefix)."""
    for k in range(1, len(infos)):
        prev, cur = infos[k - 1], infos[k]
        if cur.first_offset is None and prev.first_offset is not None and prev.count is not None:
            cur.first_offset = prev.first_offset + prev.count
    for k in range(len(infos) - 2, -1, -1):
        cur, nxt = infos[k], infos[k + 1]
        if cur.first_offset is None and nxt.first_offset is not None and cur.count is not None:
            cur.first_offset = nxt.first_offset - cur.count
    for info in infos:
        if info.first_offset is None:  # no index anywhere: a log that started at 0
            info.first_offset = 0


def _walk(path: Path) -> tuple[int, int, int | None, bool]:
    """(end of good data, record count, first timestamp, garbage seen) of one segment file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_SIZE:
            return HEADER_SIZE, 0, None, False
        head = f.read(HEADER_SIZE)
        if head != HEADER:
            if head == b"\0" * HEADER_SIZE:
                return HEADER_SIZE, 0, None, False
            raise StoreError(f"{path}: unsupported segment header {head!r}")
        if size == HEADER_SIZE:
            return HEADER_SIZE, 0, None, False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            res = fmt.scan(mm, size, set(), False)
            first_ts = _I64.unpack_from(mm, HEADER_SIZE)[0] if res.count else None
    return res.end, res.count, first_ts, res.garbage


def iter_segment(path: Path, start_offset: int, first_offset: int, stop_offset: int | None = None,
                 ) -> Iterator[Record]:
    """Records of one segment file from ``start_offset``, read-only, up to the last complete
    record (or ``stop_offset`` exclusive). Safe on a segment that is still being appended to."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= HEADER_SIZE:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            offset = first_offset
            pos = HEADER_SIZE
            while pos + fmt.FIXED_SIZE <= size:
                if stop_offset is not None and offset >= stop_offset:
                    return
                ts = _I64.unpack_from(mm, pos)[0]
                if ts == 0:
                    return
                try:
                    end, _body = fmt.record_end(mm, pos)
                except (IndexError, struct.error):
                    return
                if end > size:
                    return
                if offset >= start_offset:
                    rec = fmt.read_record(mm, pos)
                    yield offset, ts, rec[1], rec[2], rec[3], rec[4]
                offset += 1
                pos = end


def _write_new(path: Path, data: bytes, files: SegmentFiles) -> None:
    """Create (or overwrite) a small file with ``data``; DiskFull, and no file, if no space."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        if is_no_space(exc):
            raise files.no_space(path, exc) from None
        raise
    os.close(fd)
