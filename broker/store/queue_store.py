"""QueueStore: the disk-first message store of one queue.

Theory of operation
-------------------
Files in the queue directory: segments ``msgs.NNNNNNNNNN`` (format in ``segment.py``), one
ack file ``acks.NNNNNNNNNN`` per segment that has acks (u32 version header, then u32
positions of acked records), ``meta`` (delivered high-water mark, next segment number, and
whether the store was closed cleanly), and for queues that count returns, ``counts``
(``delivery_counts.py``).

Writing. The write segment, its disk allocation (space reserved before it is written, so
a full disk is ``DiskFull``, never SIGBUS), roll-over and retirement are ``SegmentLog``'s
(``segment_log.py``); ``append`` copies the record into the map by slice assignment and
stores the timestamp last, so it becomes visible atomically even if the process dies
mid-append (the page cache keeps what was written). No syscall per message. A message
larger than the segment size gets a segment of its own.

Memory. No per-message Python object for ready messages: a cursor (segment, position)
walks the segments in order, and each segment keeps only counters and the set of acked
positions. Requeued msgids wait in a heap (served before the cursor, lowest first, which
is publish order); unacked msgids sit in a set (bounded by consumer prefetch). Only the
write segment, the one retired last and the cursor segment stay mapped (a backlog
nobody reads is not resident); others are mapped on demand and unmapped when the cursor
moves on. Per store (100k declared queues must fit in a few hundred MB):
the directory is kept as a ``str`` (a ``Path`` costs ~0.5 KB; ``directory`` builds one on
demand) and the five bookkeeping sets start as one shared, immutable empty set and are
allocated by ``_allocate_sets`` when the store first gets a segment (the first append,
or recovery finding one) -- nothing can be unacked, requeued or pending before that, so
the hot paths keep calling ``.add`` on them without a check.

Acks. ``ack`` buffers the position in memory; every ``sync`` writes the buffer to the ack
file. A segment whose records are all acked is deleted (segment file first, then its
ack file, so a crash in between leaves an orphan ack file rather than resurrecting messages;
both on the segment worker, see ``segment_log``), except the write segment. ``purge`` acks
every ready message (segments entirely past the cursor are simply deleted).

Durability window. Settlements (ack, reject, nack, purge, autoack deliveries) and the
delivered high-water mark (``meta``, which drives ``redelivered`` after a restart) are not
covered by publisher confirms, so the store tells its owner when it turns dirty
(``notify``): the node's syncer then runs a *full* sync within ``ack_sync_interval``, which
writes and fsyncs them. A settlement older than that window therefore survives kill -9 and
power loss, and a message delivered before it comes back flagged redelivered. With
``write_through`` (a synchronous interval) acks and the mark are written to their files
as they happen, before the next frame is read, and fsynced by the group commit that follows
at once. Ack files and ``meta`` are opened per write and closed again: a queue holds no
descriptor for them (100k queues must fit a 20k descriptor limit).

Threads. ``sync`` runs on a worker thread while the event loop thread keeps
appending. Under ``_lock`` it writes the buffered acks and meta and ``dup``s the dirty
fds; it fsyncs outside the lock (``os.fsync`` releases the GIL). fsync of the segment fd
covers the pages written through the shared mapping, so a sync covers everything appended
before it was called. ``_sync_lock`` serialises whole syncs against each other and against
close. Replication: every mutation is reported to the sink from the owner thread
(``append``, ``ack``, ``purge``, ``flush``, ``close``, ``delete``); ``sync`` never calls the sink.

Redelivered after a crash. The mark on disk lags deliveries by up to the window, so only a
cleanly closed store (``close`` writes meta flagged so) can trust it; the first change after
opening one (an append, a delivery past the mark, or at once when it holds messages)
overwrites that meta, and replicates it, before anything is delivered; and it is on disk
before the first delivery: the stores a boot reopens share one syncfs
(``SegmentFiles.sync_opened``), and one still unsynced at a delivery fdatasyncs it first. A store recovered
without the flag (kill -9, a replica's copy, no meta) counts every recovered message as
delivered: RabbitMQ's rule after an unclean shutdown.

Recovery (constructor). Segments are scanned in order, stopping at the first zero or torn
record; ack positions that are not record starts are dropped; with ``persistent_only``
transient messages count as acked; fully acked segments are deleted; every other message is
READY again (at-least-once). Appends always go to a fresh segment after a restart, so
nothing is ever written after recovered bytes; a durable queue's fresh segment is made ahead
on the segment worker (or one made ahead and left unused is taken; ``segment_log``). Messages
at or below the persisted delivered
high-water mark report ``is_redelivered``.

Deferred recovery (``deferred=True``, ``DeferredQueueStore``). A boot replaying 50,000
durable queues spent nearly all its time reading 50,000 directories (a scandir and a meta
read each, milliseconds apiece on a cold or busy disk). So boot makes a plain queue's store
without touching its directory and the recovery above runs on the first use of anything
but its identity -- a publish, a delivery, a counter the management API or the metrics
read -- or when the node's reader gets to it (``SegmentFiles.open_deferred``, in slices
once the node serves). Nothing is lost by waiting: until it is read, the directory is as
the last run left it, so a kill -9 before then recovers exactly what it would have, and a
clean stop leaves it untouched (its meta still says how the previous run ended).
"""

from __future__ import annotations

import bisect
import errno
import heapq
import logging
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Final

from broker.errors import StoreError
from broker.store import segment as fmt
from broker.store.api import DeliverMany, DeliverOne, DeliverSame
from broker.store.delivery_counts import NAME as COUNTS_NAME
from broker.store.delivery_counts import DeliveryCounts
from broker.store.fileio import append_whole, atomic_write, datasync, fsync_dir
from broker.store.segment import HEADER, HEADER_SIZE, POS_MASK, Segment, record_end
from broker.store.segment_log import SegmentFiles, SegmentLog, datasync_path, is_no_space
from broker.store.sink import NULL_SINK, ReplicationSink

DEFAULT_SEGMENT_SIZE: Final = 8 * 1024 * 1024
META_NAME: Final = "meta"
# magic, version, delivered high-water mark, next segment number, flags; then a crc32 of those.
_META: Final = struct.Struct("<4sIQQI")
_META_MAGIC: Final = b"SKQM"
_META_VERSION: Final = 2  # 1 had no flags (read as "not closed cleanly")
_META_V1_SIZE: Final = struct.calcsize("<4sIQQ")
_META_CLEAN: Final = 1  # flags: written by close(); the mark is exact
_CRC: Final = struct.Struct("<I")
# A delivery pass that found a record unlike the next one looks for runs of equal records again
# this many deliveries later (the probe copies and compares two record heads).
_PROBE_AFTER_MISS: Final = 16
_U32: Final = struct.Struct("<I")
_I64_PACK_INTO: Final = fmt.I64.pack_into
_I64_PACK: Final = fmt.I64.pack
_U32_PACK_INTO: Final = fmt.U32.pack_into
_U64_PACK_INTO: Final = fmt.U64.pack_into
_U32_PACK: Final = fmt.U32.pack
_U32_UNPACK: Final = fmt.U32.unpack_from
_U64_UNPACK: Final = fmt.U64.unpack_from
_U64_PACK: Final = fmt.U64.pack
_I64_UNPACK: Final = fmt.I64.unpack_from
_NO_POSITIONS: Final[list[int]] = []  # never appended to: each autoack run starts a new list

log = logging.getLogger(__name__)


def _pack_positions(positions: list[int]) -> bytes:
    """Ack-file bytes for ``positions``: little-endian u32 each, packed in one call."""
    return struct.pack(f"<{len(positions)}I", *positions)


class _Unallocated(set[Any]):
    """The stand-in for a store's bookkeeping sets until the store has a segment.

    It is always empty, so every read, ``discard``, ``clear`` and ``remove`` (KeyError)
    behaves as on the real set; ``add``/``update`` (the only other mutators the store
    uses) raise, so a missing ``_allocate_sets`` is a loud bug, not state shared between
    stores.
    """

    __slots__ = ()

    def add(self, element: Any) -> None:
        raise RuntimeError("QueueStore bookkeeping set used before _allocate_sets()")

    def update(self, *others: Iterable[Any]) -> None:
        raise RuntimeError("QueueStore bookkeeping set used before _allocate_sets()")


_NO_SET: Final[set[Any]] = _Unallocated()


class QueueStore(SegmentLog[Segment]):

    __slots__ = (
        "_aa_positions",
        "_clean_on_disk",
        "_closing",
        "_aa_seg",
        "_ack_pending",
        "_ack_unsynced",
        "_bytes_ready",
        "_cnum",
        "_counts",
        "_cpos",
        "_heap",
        "_hwm",
        "_meta_sent",
        "_meta_unsynced",
        "_open_unsynced",
        "_meta_written",
        "_notify",
        "_persistent_only",
        "_ready",
        "_recovered_hwm",
        "_requeued",
        "_through",
        "_unacked",
    )

    def __init__(self, directory: str | Path, *, segment_size: int = DEFAULT_SEGMENT_SIZE,
                 sink: ReplicationSink = NULL_SINK, persistent_only: bool = False,
                 notify: Callable[[QueueStore], None] | None = None, write_through: bool = False,
                 files: SegmentFiles | None = None, deferred: bool = False) -> None:
        self._init_log(directory, segment_size, sink, files)
        self._persistent_only = persistent_only
        # Called (owner thread) when the store goes from clean to dirty, so the node's
        # syncer can make the change durable within its window; None: nobody syncs it.
        self._notify = notify
        # Settlements and the delivered mark go to their files at once (synchronous acks).
        self._through = write_through
        # Cursor: next never-delivered position; (_cnum, _cpos) may name a deleted or
        # not-yet-created segment, in which case it moves to the next existing one.
        self._cnum = 1
        self._cpos = HEADER_SIZE
        self._heap: list[int] = []  # requeued msgids (ready)
        # autoack deliveries whose ack-file bytes end_pass() still has to write
        self._aa_seg: Segment | None = None
        self._aa_positions: list[int] = _NO_POSITIONS
        # The five sets below are _NO_SET until _allocate_sets() (first segment).
        self._requeued: set[int] = _NO_SET  # requeued msgids, ready or unacked again
        self._unacked: set[int] = _NO_SET
        self._ready = 0
        self._bytes_ready = 0
        self._hwm = 0  # highest msgid ever returned by shift()
        self._recovered_hwm = 0
        # Sync bookkeeping (shared with the sync thread under _lock).
        self._unsynced_paths: set[Path] = _NO_SET  # retired write segments awaiting fsync
        self._ack_pending: set[int] = _NO_SET  # segments with buffered ack bytes
        self._ack_unsynced: set[int] = _NO_SET  # segments whose ack file was written, not fsynced
        self._meta_written = b""  # meta as last written to the file (fsynced or not)
        self._meta_unsynced = False  # meta written since its last fsync
        self._meta_sent = b""
        self._closing = False  # close() runs: the meta it writes says "closed cleanly"
        self._clean_on_disk = False  # the meta file says "closed cleanly" (see _set_dirty)
        self._open_unsynced = False  # the meta replacing that is written, not yet fsynced
        self._counts: DeliveryCounts | None = None  # delivery_counts.py: only queues that count
        if deferred:  # read on first use or by the node's opener (DeferredQueueStore)
            self._files.deferred[self] = None
            self.__class__ = DeferredQueueStore
            return
        self._open_directory()

    def _open_directory(self) -> None:
        """Create the directory or recover what it holds (the constructor's disk work)."""
        try:
            try:
                names = [entry.name for entry in os.scandir(self._dir)]
            except FileNotFoundError:  # a new queue: one failed scandir, not a stat and a mkdir
                os.makedirs(self._dir, exist_ok=True)
                self._recover([])
                if self._persistent_only:
                    # A durable queue's persistent messages are always stored: its first
                    # segment is made now, off the loop (segment_log). A transient queue's
                    # messages to a waiting autoack consumer never touch the store (the direct
                    # hand-over), where a made segment would only cost a creation and an unlink.
                    self._prepare_first()
                return
            self._recover(names)
            if self._persistent_only:
                self._prepare_next()  # made ahead, as a new queue's first segment (segment_log)
        except OSError as exc:
            self._close_files()
            raise StoreError(f"queue store {self._dir}: {exc}") from exc
        except BaseException:
            self._close_files()
            raise

    @property
    def _meta_path(self) -> str:
        return os.path.join(self._dir, META_NAME)

    def _allocate_sets(self) -> None:
        """Replace the shared empty stand-ins with real sets (under _lock: sync reads some)."""
        if self._unacked is _NO_SET:
            self._requeued = set()
            self._unacked = set()
            self._unsynced_paths = set()
            self._ack_pending = set()
            self._ack_unsynced = set()

    def _set_dirty(self) -> None:
        """Something not yet durable changed: tell the syncer (once per clean -> dirty).

        The first change after opening a cleanly closed store (an append, or a delivery
        past the mark) first overwrites its "closed cleanly" meta, so a crash from here
        on is seen as one."""
        if self._clean_on_disk:
            with self._lock:
                self._mark_open()
        self._dirty = True
        if self._notify is not None:
            self._notify(self)

    def _hwm_moved(self) -> None:
        """The delivered high-water mark rose: durable within the window, or at once."""
        if self._open_unsynced:
            self._sync_open_meta()
        if not self._dirty:
            self._set_dirty()
        if self._through:
            self._write_through()

    # ------------------------------------------------------------------ publishing

    def append(self, timestamp_ms: int, exchange: bytes, routing_key: bytes,
               props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int:
        size = fmt.record_size(exchange, routing_key, props, body)
        seg = self._wseg
        if seg is None or seg.end + size > self._wcap:
            seg = self._roll(size)
        mm = self._wmm
        assert mm is not None
        pos = seg.end
        end = pos + size
        fmt.write_record(self._wfd, pos, size, exchange, routing_key, props, body)
        _I64_PACK_INTO(mm, pos, timestamp_ms or 1)  # last: publishes the record atomically
        seg.end = end
        seg.count += 1
        self._ready += 1
        self._bytes_ready += len(body)
        self._seg_unsynced = True
        if not self._dirty:
            self._set_dirty()
        if self._sink.active:
            self._sink.append(seg.path, mm[pos:end])
        return (seg.num << 32) | pos

    def append_run(self, timestamp_ms: int, exrk: bytes, props: list[bytes], bodies: list[bytes],
                   same: bool) -> None:
        """append() for a run of messages (``props[i]``, ``bodies[i]``, each body under
        segment.PWRITE_MIN) with one timestamp, exchange and routing key (``exrk``: the
        two short strings): one join and one copy into the map per segment they land
        in. ``same``: all properties are equal and all bodies are of one length.

        The first record's timestamp is written last, so a reader (recovery after
        kill -9) sees all of the run's records or none of them. All or nothing: the run
        goes into one segment, whose space is allocated before anything is written, so
        DiskFull leaves nothing of it stored.
        """
        k = len(bodies)
        if not k:
            return
        if not same:
            self._append_mixed(timestamp_ms, exrk, props, bodies)
            return
        body_len = len(bodies[0])
        p0 = props[0]
        mid = b"".join((exrk, _U32_PACK(len(p0)), p0, _U64_PACK(body_len)))
        rec = 8 + len(mid) + body_len
        sep = _I64_PACK(timestamp_ms or 1) + mid
        seg = self.reserve(k * rec)
        mm = self._wmm
        assert mm is not None
        pos = seg.end
        end = pos + k * rec
        # the first timestamp stays zero until the end
        fmt.write_at(self._wfd, pos + 8, (mid, sep.join(bodies)), end - pos - 8)
        self._run_written(seg, mm, pos, end, timestamp_ms, k, k * body_len)

    def reserve(self, size: int) -> Segment:
        """The write segment, with ``size`` bytes of records' room allocated: DiskFull (or
        StoreError) now, before anything is written. A run of records, or one message
        routed to several queues, reserves first, so a full disk stores all of it or none."""
        seg = self._wseg
        if seg is None or self._wmm is None or seg.end + size > self._wcap:
            seg = self._roll(size)
        return seg

    def make_room(self, size: int, props: bytes | memoryview, timestamp_ms: int) -> None:
        """``reserve`` as every store kind offers it (``api.QueueCounters``): a message or run
        routed to several queues has room in all of them before any of them is written."""
        self.reserve(size)

    @staticmethod
    def run_size(exrk: bytes, props: list[bytes], bodies: list[bytes], same: bool) -> int:
        """Bytes ``append_run`` needs for this run (what to ``reserve``)."""
        k = len(bodies)
        fixed = fmt.FIXED_SIZE - 2 + len(exrk)  # FIXED_SIZE counts the two length octets
        if same:
            return k * (fixed + len(props[0]) + len(bodies[0]))
        return k * fixed + sum(map(len, props)) + sum(map(len, bodies))

    def _append_mixed(self, timestamp_ms: int, exrk: bytes, props: list[bytes], bodies: list[bytes]) -> None:
        blob = fmt.join_records(_I64_PACK(timestamp_ms or 1), exrk, props, bodies)
        size = len(blob)
        seg = self.reserve(size)
        mm = self._wmm
        assert mm is not None
        pos = seg.end
        # the first timestamp stays zero until the end
        fmt.write_at(self._wfd, pos + 8, (memoryview(blob)[8:],), size - 8)
        self._run_written(seg, mm, pos, pos + size, timestamp_ms, len(bodies), sum(map(len, bodies)))

    def _run_written(self, seg: Segment, mm: mmap.mmap, pos: int, end: int, timestamp_ms: int, count: int,
                     body_bytes: int) -> None:
        """Publish ``count`` records written at ``pos``..``end`` of the write segment, all
        complete but the first one's timestamp, which goes in now (last, atomically)."""
        _I64_PACK_INTO(mm, pos, timestamp_ms or 1)
        seg.end = end
        seg.count += count
        if self._sink.active:
            self._sink.append(seg.path, mm[pos:end])
        self._ready += count
        self._bytes_ready += body_bytes
        self._seg_unsynced = True
        if not self._dirty:
            self._set_dirty()

    def append_taken(self, timestamp_ms: int, exchange: bytes, routing_key: bytes,
                     props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int:
        """append() a message that goes straight to a consumer: it is unacked at once.

        Only for a store with nothing ready (the caller checks ``ready_count``), so
        the new record is the one the cursor reaches next.
        """
        at = (self._cnum << 32) | self._cpos
        msgid = self.append(timestamp_ms, exchange, routing_key, props, body)
        if msgid == at and not self._heap:
            # the cursor sat right where the record went: step over it
            seg = self._wseg
            assert seg is not None
            self._cpos = seg.end
            self._ready -= 1
            self._bytes_ready -= len(body)
            self._unacked.add(msgid)
            if msgid > self._hwm:
                self._hwm = msgid
                self._hwm_moved()
            return msgid
        if self.shift() != msgid:  # e.g. acked records after recovery lay before it
            raise StoreError(f"append_taken on a queue with ready messages ({self._dir})")
        return msgid

    def append_run_taken(self, timestamp_ms: int, exrk: bytes, props: list[bytes], bodies: list[bytes],
                         same: bool) -> list[int] | None:
        """append_run() for messages that go straight to one consumer: their msgids, unacked
        at once (the consumer gets the bytes in hand; nothing is read back from the map).
        None when the cursor was not where the run went (it then stays ready for
        deliver_run). Only for a store with nothing ready (the caller checks)."""
        at = (self._cnum << 32) | self._cpos
        self.append_run(timestamp_ms, exrk, props, bodies, same)
        seg = self._wseg
        assert seg is not None
        fixed = fmt.FIXED_SIZE - 2 + len(exrk)  # FIXED_SIZE counts the two length octets
        size = QueueStore.run_size(exrk, props, bodies, same)
        pos = seg.end - size
        base = seg.num << 32
        if base | pos != at or self._heap:
            return None
        if same:
            msgids = list(range(base | pos, base | seg.end, fixed + len(props[0]) + len(bodies[0])))
        else:
            msgids = []
            add = msgids.append
            for p, body in zip(props, bodies, strict=True):
                add(base | pos)
                pos += fixed + len(p) + len(body)
        k = len(bodies)
        self._cpos = seg.end
        self._ready -= k
        self._bytes_ready -= sum(map(len, bodies))
        self._unacked.update(msgids)
        if msgids[-1] > self._hwm:
            self._hwm = msgids[-1]
            self._hwm_moved()
        return msgids

    def _roll(self, need: int, want: int = 0) -> Segment:
        """The write segment with room for a record of ``need`` bytes (``want``: for a run
        of that many): more of it allocated, or a new segment. DiskFull if no space."""
        if self._unacked is _NO_SET:
            with self._lock:
                self._allocate_sets()
        seg = self._grow(need, want)
        if seg is not None:
            return seg
        seg = Segment(self.directory, self._next_num)
        old = self._start_segment(seg, need, want)
        if old is not None and len(old.acked) == old.count:
            self._delete_segment(old)
        return seg

    # ------------------------------------------------------------------ consuming

    def shift(self) -> int | None:
        heap = self._heap
        if heap:
            msgid = heapq.heappop(heap)
            self._bytes_ready -= self.read_body_size(msgid)
        else:
            found = self._cursor(True)
            if found is None:
                return None
            msgid = found
        self._unacked.add(msgid)
        self._ready -= 1
        if msgid > self._hwm:
            self._hwm = msgid
            self._hwm_moved()
        return msgid

    def next_delivery(self, autoack: bool) -> tuple[int, bytes, bytes, bytes, bool] | None:
        """shift() + read() in one pass for the delivery hot path.

        Returns (msgid, exchange and routing key as the two AMQP short strings
        they are stored as, props, body, redelivered), or None when empty. With
        ``autoack`` the message is acked at once instead of becoming unacked.
        The common case (the sequential cursor, nothing requeued) parses the
        record once and returns slices of the map. deliver_run() parses the same
        way for a whole run; this one-message form serves round-robin passes over
        several consumers, where a run per message measured about 12 % slower.
        """
        if self._open_unsynced:
            self._sync_open_meta()
        seg = self._segs.get(self._cnum)
        pos = self._cpos
        if self._heap or seg is None or pos >= seg.end or seg.mm is None or (seg.acked and pos in seg.acked):
            msgid = self.shift()
            if msgid is None:
                return None
            _ts, ex, rk, props, body = self.read(msgid)
            redelivered = self.is_redelivered(msgid)
            if autoack:
                self.ack(msgid)
            return msgid, fmt.short_pair(ex, rk), props, body, redelivered
        mm = seg.mm
        seg.used = True  # SegmentFiles: not evicted under this call
        p = pos + 8
        rk_at = p + 1 + mm[p]
        p_at = rk_at + 1 + mm[rk_at]
        exrk = mm[p:p_at]
        pend = p_at + 4 + _U32_UNPACK(mm, p_at)[0]
        props = mm[p_at + 4 : pend]
        b_len = _U64_UNPACK(mm, pend)[0]
        bend = pend + 8 + b_len
        body = mm[pend + 8 : bend]
        self._cpos = bend
        self._bytes_ready -= b_len
        self._ready -= 1
        msgid = (seg.num << 32) | pos
        if msgid > self._hwm:
            self._hwm = msgid
            if not self._dirty or self._through:
                self._hwm_moved()
        redelivered = msgid <= self._recovered_hwm
        if autoack:
            # Acked at once; the ack file bytes are written for the whole run by
            # end_pass() (or when the run moves on to another segment).
            acked = seg.acked
            acked.add(pos)
            if self._aa_seg is seg:
                self._aa_positions.append(pos)
            else:
                self.end_pass()
                self._aa_seg = seg
                self._aa_positions = [pos]
            if len(acked) == seg.count and seg is not self._wseg:
                self.end_pass()
                self._delete_segment(seg)
        else:
            self._unacked.add(msgid)
        return msgid, exrk, props, body, redelivered

    def deliver_run(self, k: int, autoack: bool, deliver: DeliverOne, max_bytes: int,
                    deliver_same: DeliverSame | None = None, deliver_many: DeliverMany | None = None,
                    ) -> tuple[int, int, int]:
        """Hand up to ``k`` ready messages, in order, to ``deliver`` (next_delivery's fields).

        Stops early when the queue is empty or once more than ``max_bytes`` of
        bodies went out. Returns (messages, of which redelivered, body bytes).
        Consecutive records of the cursor's mapped segment are parsed in one
        loop with its state in locals; anything else (requeued messages, a
        segment end, an acked record ahead of the cursor after recovery) takes
        next_delivery(). Autoack acks are written to the ack file by end_pass().

        With ``deliver_same``, consecutive first-time records that differ only in
        their bodies (same exchange, routing key, properties and body size: the
        bytes between timestamp and body are equal) go to it as one run of
        (msgids, exrk, props, bodies) instead of one ``deliver`` call each. With
        ``deliver_many``, the other consecutive first-time records with the same exchange
        and routing key go to it as lists (msgids, exrk, props, bodies), so that they are
        framed and written in one go; nothing is handed on out of order.
        """
        if self._open_unsynced:
            self._sync_open_meta()
        n = red = nbytes = 0
        b_ids: list[int] = []  # the batch for deliver_many
        b_props: list[bytes] = []
        b_bodies: list[bytes] = []
        b_exrk = b""

        def flush() -> None:
            nonlocal b_ids, b_props, b_bodies
            if b_ids:
                assert deliver_many is not None
                ids, props, bodies = b_ids, b_props, b_bodies
                b_ids, b_props, b_bodies = [], [], []
                deliver_many(ids, b_exrk, props, bodies)

        while n < k and nbytes <= max_bytes:
            seg = self._segs.get(self._cnum)
            pos = self._cpos
            if self._heap or seg is None or pos >= seg.end or seg.mm is None \
                    or (seg.acked and pos in seg.acked):
                flush()
                got = self.next_delivery(autoack)
                if got is None:
                    break
                n += 1
                red += got[4]
                nbytes += len(got[3])
                deliver(*got)
                continue
            mm = seg.mm
            seg.used = True  # SegmentFiles: not evicted under this run (deliver may publish)
            end = seg.end
            base = seg.num << 32
            acked = seg.acked
            recovered_hwm = self._recovered_hwm
            positions: list[int] | None = None
            if autoack:
                if self._aa_seg is not seg:
                    self.end_pass()
                    self._aa_seg = seg
                    self._aa_positions = []
                positions = self._aa_positions
            unacked = self._unacked
            msgid = 0
            probe_at = 0  # records that differ from the next one: look for runs again from the n-th
            while n < k and pos < end and nbytes <= max_bytes:
                if acked and pos in acked:  # only after recovery can acked records lie ahead
                    break
                p = pos + 8
                rk_at = p + 1 + mm[p]
                p_at = rk_at + 1 + mm[rk_at]
                pend = p_at + 4 + _U32_UNPACK(mm, p_at)[0]
                b_len = _U64_UNPACK(mm, pend)[0]
                bend = pend + 8 + b_len
                msgid = base | pos
                if deliver_same is not None and msgid > recovered_hwm and bend < end and n >= probe_at:
                    # a run of records like this one? compare the bytes between
                    # timestamp and body; equal bytes mean an equal record size
                    rec = bend - pos
                    stop = pos + rec * min(k - n, (max_bytes - nbytes) // (b_len or 1) + 1)
                    if stop > end:
                        stop = end
                    q = bend
                    if q + rec <= stop:
                        hl = pend + 8 - p
                        hdr = mm[p : p + hl]
                        while q + rec <= stop and mm[q + 8 : q + 8 + hl] == hdr:
                            q += rec
                    if q > bend and not (acked and not acked.isdisjoint(range(pos, q, rec))):
                        m = (q - pos) // rec
                        hb = 8 + hl
                        bodies = [mm[x : x + b_len] for x in range(pos + hb, q + hb, rec)]  # m, even if empty
                        if positions is not None:
                            acked.update(range(pos, q, rec))
                            positions.extend(range(pos, q, rec))
                        else:
                            unacked.update(range(msgid, base | q, rec))
                        self._cpos = q
                        self._ready -= m
                        self._bytes_ready -= m * b_len
                        n += m
                        nbytes += m * b_len
                        flush()
                        deliver_same(range(msgid, base | q, rec), mm[p:p_at], mm[p_at + 4 : pend], bodies)
                        msgid = base | (q - rec)
                        pos = q
                        continue
                    probe_at = n + _PROBE_AFTER_MISS  # messages that differ (ids, headers, sizes)
                if positions is not None:
                    acked.add(pos)
                    positions.append(pos)
                else:
                    unacked.add(msgid)
                self._cpos = bend
                self._ready -= 1
                self._bytes_ready -= b_len
                redelivered = msgid <= recovered_hwm
                n += 1
                red += redelivered
                nbytes += b_len
                pos = bend
                exrk = mm[p:p_at]
                if deliver_many is not None and not redelivered:
                    if exrk != b_exrk:
                        flush()
                        b_exrk = exrk
                    b_ids.append(msgid)
                    b_props.append(mm[p_at + 4 : pend])
                    b_bodies.append(mm[pend + 8 : bend])
                    continue
                flush()
                deliver(msgid, exrk, mm[p_at + 4 : pend], mm[pend + 8 : bend], redelivered)
            flush()
            if msgid > self._hwm:
                self._hwm = msgid
                self._hwm_moved()
            if positions is not None and len(acked) == seg.count and seg is not self._wseg:
                self.end_pass()
                self._delete_segment(seg)
        return n, red, nbytes

    def end_pass(self) -> None:
        """Record the acks of the autoack deliveries made since the last call."""
        seg = self._aa_seg
        if seg is not None:
            positions = self._aa_positions
            self._aa_seg = None
            self._aa_positions = _NO_POSITIONS
            if positions and self._segs.get(seg.num) is seg:
                self._append_acks(seg, _pack_positions(positions))
                if self._through:
                    self._write_through()

    def stored_props(self) -> Iterator[tuple[int, bytes]]:
        """(msgid, properties) of every record not acked, in order, without consuming.

        For a scan at boot (e.g. rebuilding a deduplication set) before the first
        delivery. Segments mapped for the scan are unmapped again, so a long queue
        does not stay resident.
        """
        for num in list(self._order):
            seg = self._segs.get(num)
            if seg is None or len(seg.acked) >= seg.count:
                continue
            mapped_here = seg.mm is None
            mm = self._map_read(seg) if mapped_here else seg.mm
            assert mm is not None
            try:
                pos = HEADER_SIZE
                acked = seg.acked
                while pos < seg.end:
                    if pos not in acked:
                        p_at = pos + 9 + mm[pos + 8]
                        p_at += 1 + mm[p_at]
                        plen = _U32_UNPACK(mm, p_at)[0]
                        yield (num << 32) | pos, bytes(mm[p_at + 4 : p_at + 4 + plen])
                    pos = fmt.record_end(mm, pos)[0]
            finally:
                if mapped_here and seg is not self._wseg:
                    self._unmap(seg)

    def peek(self) -> int | None:
        if self._heap:
            return self._heap[0]
        return self._cursor(False)

    def _cursor(self, take: bool) -> int | None:
        """The READY msgid at the cursor (skipping acked positions); advance past it if ``take``."""
        while True:
            seg = self._segs.get(self._cnum)
            pos = self._cpos
            if seg is None or pos >= seg.end:
                if seg is not None and seg is self._wseg:
                    return None
                if not self._next_cursor_segment():
                    return None
                continue
            mm = seg.mm if seg.mm is not None else self._map_read(seg)
            if pos in seg.acked:  # only after recovery can acked positions lie ahead
                self._cpos = record_end(mm, pos)[0]
                continue
            if take:
                end, body_size = record_end(mm, pos)
                self._cpos = end
                self._bytes_ready -= body_size
            return (seg.num << 32) | pos

    def _keep_mapped(self, seg: Segment) -> bool:
        return seg.num == self._cnum

    def _next_cursor_segment(self) -> bool:
        i = bisect.bisect_right(self._order, self._cnum)
        if i == len(self._order):
            return False
        self._cnum = self._order[i]
        self._cpos = HEADER_SIZE
        # Keep only the write and cursor segments mapped (RSS stays small for long queues).
        for seg in self._segs.values():
            if seg.mm is not None and seg is not self._wseg and seg.num != self._cnum:
                self._unmap(seg)
        return True

    def _segment_of(self, msgid: int) -> Segment:
        seg = self._segs.get(msgid >> 32)
        if seg is None:
            raise KeyError(f"no message {msgid:#x} in {self.directory}")
        return seg

    def read(self, msgid: int) -> tuple[int, bytes, bytes, bytes, bytes]:
        seg = self._segment_of(msgid)
        mm = seg.mm if seg.mm is not None else self._map_read(seg)
        return fmt.read_record(mm, msgid & POS_MASK)

    def read_timestamp(self, msgid: int) -> int:
        """The publish time (ms) of ``msgid``, without copying the record."""
        seg = self._segment_of(msgid)
        mm = seg.mm if seg.mm is not None else self._map_read(seg)
        ts: int = _I64_UNPACK(mm, msgid & POS_MASK)[0]
        return ts

    def read_body_size(self, msgid: int) -> int:
        seg = self._segment_of(msgid)
        mm = seg.mm if seg.mm is not None else self._map_read(seg)
        return fmt.body_size_at(mm, msgid & POS_MASK)

    def ack(self, msgid: int) -> None:
        """Unacked -> gone. KeyError if ``msgid`` is not unacked."""
        self._unacked.remove(msgid)
        if self._requeued:
            self._requeued.discard(msgid)
        seg = self._segs[msgid >> 32]
        self._ack_position(seg, msgid & POS_MASK)
        if len(seg.acked) == seg.count and seg is not self._wseg:
            self._delete_segment(seg)
        if self._through:
            self._write_through()

    def ack_many(self, msgids: list[int]) -> None:
        """ack() for many msgids with one lock round per segment run (multiple=true acks)."""
        unacked = self._unacked
        requeued = self._requeued
        segs = self._segs
        run_seg: Segment | None = None
        run: list[int] = []
        for msgid in msgids:
            unacked.remove(msgid)
            if requeued:
                requeued.discard(msgid)
            seg = segs[msgid >> 32]
            if seg is not run_seg:
                if run_seg is not None:
                    self._ack_run(run_seg, run)
                run_seg, run = seg, []
            run.append(msgid & POS_MASK)
        if run_seg is not None:
            self._ack_run(run_seg, run)
        if self._through:
            self._write_through()

    def _ack_run(self, seg: Segment, positions: list[int]) -> None:
        seg.acked.update(positions)
        self._append_acks(seg, _pack_positions(positions))
        if len(seg.acked) == seg.count and seg is not self._wseg:
            self._delete_segment(seg)

    def _ack_position(self, seg: Segment, pos: int) -> None:
        seg.acked.add(pos)
        self._append_acks(seg, _U32.pack(pos))

    def _append_acks(self, seg: Segment, packed: bytes) -> None:
        """Buffer ack positions for ``seg``'s ack file (written at flush/sync) and replicate them."""
        created = not seg.ack_exists
        with self._lock:
            if created:
                seg.ack_exists = True
                seg.ack_buf += HEADER
            seg.ack_buf += packed
            self._ack_pending.add(seg.num)
        if not self._dirty:
            self._set_dirty()
        if self._sink.active:
            if created:
                self._sink.register_file(seg.ack_path)
                self._sink.append(seg.ack_path, HEADER)
            self._sink.append(seg.ack_path, packed)

    def merge_acks(self, num: int, positions: Iterable[int]) -> int:
        """Ack, in segment ``num``, the ready messages at ``positions``: acks another copy of
        this store has on disk (a replica, whose segment holds the very same bytes: the caller
        checked). A message a consumer holds is left to its ack or requeue. Returns how many
        were acked here."""
        seg = self._segs.get(num)
        if seg is None:
            return 0
        mm = seg.mm if seg.mm is not None else self._map_read(seg)
        heap_hit = False
        n = 0
        for pos in sorted(set(positions)):
            if pos < HEADER_SIZE or pos >= seg.end or pos in seg.acked:
                continue
            msgid = (num << 32) | pos
            if msgid in self._unacked:
                continue
            if msgid in self._requeued:
                self._heap.remove(msgid)
                self._requeued.discard(msgid)
                heap_hit = True
            elif num < self._cnum or (num == self._cnum and pos < self._cpos):
                continue  # behind the cursor and not held: settled already
            self._ack_position(seg, pos)
            self._ready -= 1
            self._bytes_ready -= fmt.body_size_at(mm, pos)
            n += 1
        if heap_hit:
            heapq.heapify(self._heap)
        if n:
            if len(seg.acked) == seg.count and seg is not self._wseg:
                self._delete_segment(seg)
            if not self._dirty:
                self._set_dirty()
            if self._through:
                self._write_through()
        return n

    def requeue(self, msgid: int) -> None:
        """Unacked -> ready again (served before new messages, in msgid order)."""
        self._unacked.remove(msgid)
        heapq.heappush(self._heap, msgid)
        self._requeued.add(msgid)
        self._ready += 1
        self._bytes_ready += self.read_body_size(msgid)

    def is_redelivered(self, msgid: int) -> bool:
        return msgid in self._requeued or msgid <= self._recovered_hwm

    # Delivery counts (x-delivery-count): durable like acks, see delivery_counts.py.
    @property
    def counting(self) -> bool:
        """Whether any message in the store has a delivery count."""
        return self._counts is not None and bool(self._counts.counts)

    def count_of(self, msgid: int) -> int:
        return 0 if self._counts is None else self._counts.counts.get(msgid, 0)

    def set_count(self, msgid: int, count: int) -> None:
        if self._counts is None:
            self._counts = DeliveryCounts(self._dir, self._lock, self._sink, self._files)
        self._counts.set(msgid, count)
        if not self._dirty:
            self._set_dirty()
        if self._through:
            self._write_through()

    def forget_count(self, msgid: int) -> None:
        if self._counts is not None:
            self._counts.forget(msgid)

    def purge(self) -> int:
        """Drop every READY message (acked on disk); unacked ones stay. Returns the count."""
        purged = self._ready
        touched: list[Segment] = []
        for msgid in self._heap:
            self._requeued.discard(msgid)
            hseg = self._segs[msgid >> 32]
            self._ack_position(hseg, msgid & POS_MASK)
            touched.append(hseg)
        self._heap.clear()
        # Everything from the cursor on is ready (unacked msgids all lie before it).
        for num in [n for n in self._order if n >= self._cnum]:
            seg = self._segs.get(num)
            if seg is None:
                continue
            if num > self._cnum and seg is not self._wseg:
                self._delete_segment(seg)
                continue
            mm = seg.mm if seg.mm is not None else self._map_read(seg)
            pos = self._cpos if num == self._cnum else HEADER_SIZE
            while pos < seg.end:
                if pos not in seg.acked:
                    self._ack_position(seg, pos)
                pos = record_end(mm, pos)[0]
            touched.append(seg)
        for seg in touched:
            if self._segs.get(seg.num) is seg and len(seg.acked) == seg.count and seg is not self._wseg:
                self._delete_segment(seg)
        if self._order:
            last = self._segs[self._order[-1]]
            self._cnum, self._cpos = last.num, last.end
        else:
            self._cnum, self._cpos = self._next_num, HEADER_SIZE
        self._ready = 0
        self._bytes_ready = 0
        if self._counts is not None:
            self._counts.keep_only(self._unacked)
        if self._through:
            self._write_through()
        return purged

    def _delete_segment(self, seg: Segment) -> None:
        self._unmap(seg)
        with self._lock:
            del self._segs[seg.num]
            self._order.remove(seg.num)
            self._ack_pending.discard(seg.num)
            self._ack_unsynced.discard(seg.num)
            self._unsynced_paths.discard(seg.path)
            seg.ack_buf.clear()
            # Segment first: a crash in between leaves an orphan ack file (harmless, removed
            # at recovery); the other order would bring the acked messages back. On the
            # segment worker, in this order (segment_log's module doc: removing off the loop).
            self._remove_later(seg.path, seg.ack_path)
        if self._sink.active:
            self._sink.delete(seg.path)
            if seg.ack_exists:
                self._sink.delete(seg.ack_path)

    # ------------------------------------------------------------------ counters

    @property
    def ready_count(self) -> int:
        return self._ready

    @property
    def unacked_count(self) -> int:
        return len(self._unacked)

    @property
    def bytes_ready(self) -> int:
        return self._bytes_ready

    @property
    def dirty(self) -> bool:
        return self._dirty

    # ------------------------------------------------------------------ durability

    def flush(self) -> None:
        """Write buffered ack bytes to the ack files (no fsync); send a changed meta to the sink.
        A closed store has nothing left to flush (``close`` flushed first; a deleted one's
        files are gone), as ``sync`` has nothing left to sync: the group commit may still hold
        it when its queue is deleted."""
        with self._lock:
            if self._closed:
                return
            self._write_acks_locked()
            if self._counts is not None:
                self._counts.write_locked()
        if self._sink.active:
            meta = self._meta_bytes()
            if meta != self._meta_sent:
                self._meta_sent = meta
                self._sink.replace(Path(self._meta_path), meta)

    def _write_through(self) -> None:
        """Synchronous settlements: acks and the delivered mark reach their files now
        (kill -9 can no longer lose them); the syncer's next group commit fsyncs them.
        A write that fails leaves them buffered in this dirty store: that commit writes them
        again and, if it fails too, refuses the waiters that depend on this store (a
        purge-ok) and logs it. The settlement itself is done; the client that sent it is
        not told otherwise."""
        with self._lock:
            if self._closed:
                return
            try:
                self._write_acks_locked()
                if self._counts is not None:
                    self._counts.write_locked()
                meta = self._meta_bytes()
                if meta != self._meta_written:
                    self._write_meta(meta, fsync=False)
            except OSError:
                pass  # the callers marked the store dirty first: the syncer has it

    def _write_acks_locked(self) -> None:
        """Append every segment's buffered ack bytes to its ack file (open, write, close:
        no descriptor is held between writes, see ``sync``)."""
        failed: list[int] = []
        for num in self._ack_pending:
            seg = self._segs[num]
            fd = os.open(seg.ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                if not append_whole(fd, seg.ack_buf):
                    # Disk full: the acks stay buffered (and in memory) for the next sync;
                    # deleting fully acked segments is what frees space meanwhile.
                    self._files.no_space(seg.ack_path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
                    failed.append(num)
                    continue
            finally:
                os.close(fd)
            if not seg.ack_written:
                seg.ack_written = True
                self._dir_unsynced = True
            seg.ack_buf.clear()
            self._ack_unsynced.add(num)
        self._ack_pending.clear()
        if failed:
            self._ack_pending.update(failed)

    def _sync_locked(self, full: bool, paths: list[Path]) -> None:
        """Every sync writes buffered acks and a changed delivered mark (``meta``) to
        their files, so a kill -9 after it cannot lose them; the segment data that
        publisher confirms wait on is fsynced by ``SegmentLog.sync``. A full sync (the
        syncer's window sync, at most ``ack_sync_interval`` after a settlement) fsyncs
        the ack files and ``meta`` too (``_settle_locked``), with the segment or, from the
        syncer, on its settling thread after the confirms were answered; a group commit for
        confirms leaves them to the window, since every extra fdatasync adds a journal commit
        to every confirm's latency."""
        self._write_acks_locked()
        if self._counts is not None:
            self._counts.write_locked()
        meta = self._meta_bytes()
        if meta != self._meta_written and self._write_meta(meta, fsync=False):
            self._meta_unsynced = True

    def _settle_locked(self, paths: list[Path]) -> None:
        """The ack files, delivery counts and ``meta`` written since their last fsync (a full
        sync's share: ``SegmentLog.settle``)."""
        counts = self._counts
        if counts is not None and counts.take_unsynced():
            paths.append(counts.path)
        if self._ack_unsynced:
            paths.extend(self._segs[n].ack_path for n in self._ack_unsynced if n in self._segs)
            self._ack_unsynced.clear()
        if self._meta_unsynced:
            self._meta_unsynced = False
            paths.append(Path(self._meta_path))

    def _meta_bytes(self) -> bytes:
        flags = _META_CLEAN if self._closing else 0
        head = _META.pack(_META_MAGIC, _META_VERSION, self._hwm, self._next_num, flags)
        return head + _CRC.pack(zlib.crc32(head))

    def _mark_open(self) -> None:
        """Replace a "closed cleanly" meta with an open one, on disk and on the replicas,
        before anything is delivered: from now on the mark on disk may lag deliveries.
        (Owner thread, under ``_lock``; fsynced by the next full sync. On a full disk the
        file goes: no meta reads as "not closed cleanly" too.)"""
        self._clean_on_disk = False
        self._open_unsynced = True
        meta = self._meta_bytes()
        if not self._write_meta(meta, fsync=False):
            self._remove_file(Path(self._meta_path))  # tells the replicas too
            self._meta_written = self._meta_sent = b""
            return
        self._meta_unsynced = True
        if self._sink.active:
            self._meta_sent = meta
            self._sink.replace(Path(self._meta_path), meta)

    def _opened_synced(self) -> None:
        """The node's syncfs made the open meta durable (``SegmentFiles.sync_opened``)."""
        self._open_unsynced = False

    def _sync_open_meta(self) -> None:
        """Before the first delivery after a clean open: the meta that replaced "closed
        cleanly" goes to disk first (one fdatasync; the directory's fsync if the full disk
        made it a removal), so a power cut cannot bring back the old mark and with it
        messages delivered since without the redelivered flag. Boot's syncfs usually did it."""
        self._open_unsynced = False
        path = Path(self._meta_path)
        try:
            if os.path.exists(path):
                datasync_path(path)
            else:
                fsync_dir(path.parent)
        except OSError as exc:
            self._open_unsynced = True  # tried again before the next delivery
            raise StoreError(f"queue store {self._dir}: {exc}") from exc

    def _write_meta(self, meta: bytes, fsync: bool) -> bool:
        """Overwrite meta in place (fixed size, one pwrite); False if the disk is full (the
        next sync tries again). Opened per write (at most once per sync), so a queue holds
        no descriptor for it."""
        created = not self._meta_written and not os.path.exists(self._meta_path)
        fd = os.open(self._meta_path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, meta, 0)
            if fsync:
                datasync(fd)
        except OSError as exc:
            if not is_no_space(exc):
                raise
            self._files.no_space(Path(self._meta_path), exc)
            return False
        finally:
            os.close(fd)
        self._meta_written = meta
        self._dir_unsynced |= created
        return True

    def _before_close(self) -> None:
        self.end_pass()
        self._closing = True  # the meta flush() and the final sync write says "closed cleanly"
        self.flush()

    # ------------------------------------------------------------------ recovery

    def _recover(self, names: list[str]) -> None:
        """Recover from the directory holding the files ``names``."""
        seg_nums: list[int] = []
        ack_nums: set[int] = set()
        has_counts = False
        for name in names:
            if name == COUNTS_NAME:
                has_counts = True
                continue
            num = fmt.parse_number(name, "msgs.")
            if num is not None:
                seg_nums.append(num)
                continue
            num = fmt.parse_number(name, "acks.")
            if num is not None:
                ack_nums.add(num)
        hwm, next_num, clean = self._read_meta() if META_NAME in names else (0, 1, False)
        directory = self.directory
        if seg_nums:
            self._allocate_sets()  # still in the constructor: no sync thread yet
        highest = max(seg_nums, default=0)
        made = highest if highest and highest not in ack_nums and self._persistent_only \
            and highest >= max(next_num, (hwm >> 32) + 1) and self._made_unused(highest) else 0
        for num in sorted(seg_nums):
            if num == made:
                continue
            seg = self._recover_segment(directory, num, num in ack_nums)
            if seg is None:
                continue
            self._segs[num] = seg
            self._order.append(num)
        for num in ack_nums:
            if num not in self._segs:  # orphan: its segment was deleted (or dropped above)
                self._remove_file(directory / fmt.ack_name(num))
        # New segments must sort after every msgid ever delivered, even after the segments
        # holding them are gone, or the redelivered mark would cover new messages.
        if not clean and self._order:
            # Not closed cleanly: the mark on disk may lag what was delivered (it is written
            # within the sync window), so every recovered message may have been delivered and
            # comes back flagged (as RabbitMQ does after an unclean shutdown).
            hwm = max(hwm, (self._order[-1] << 32) | POS_MASK)
        self._hwm = self._recovered_hwm = hwm
        self._next_num = max(next_num, highest + 1, (hwm >> 32) + 1, 1)
        if made:
            self._adopt_made(made)
        if clean and self._order:
            self._mark_open()  # before anything is delivered (replicas: before anyone serves)
            if self._open_unsynced:  # the node's one syncfs at boot makes it durable
                self._files.opened.append(self._opened_synced)
        else:
            self._clean_on_disk = clean
        self._cnum = self._order[0] if self._order else self._next_num
        self._cpos = HEADER_SIZE
        if has_counts:
            self._counts = DeliveryCounts.load(self._dir, self._lock, self._sink, self._files,
                                               self._is_stored, self._remove_file)

    def _is_stored(self, msgid: int) -> bool:
        """Whether ``msgid`` names a recovered record that is not acked."""
        seg = self._segs.get(msgid >> 32)
        pos = msgid & POS_MASK
        return seg is not None and HEADER_SIZE <= pos < seg.end and pos not in seg.acked

    def _recover_segment(self, directory: Path, num: int, has_acks: bool) -> Segment | None:
        seg = Segment(directory, num)
        file_acks = self._read_acks(seg.ack_path) if has_acks else set()
        fd = os.open(seg.path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEADER_SIZE, 0)
            if len(head) < HEADER_SIZE or head == b"\0" * HEADER_SIZE:
                # Crash between creating the file and writing its header: never held data.
                if _all_zero(fd, size):
                    os.close(fd)
                    fd = -1
                    self._remove_file(seg.path)
                    if has_acks:
                        self._remove_file(seg.ack_path)
                    return None
                raise StoreError(f"{seg.path}: missing format header")
            (version,) = _U32.unpack(head)
            if version != fmt.VERSION:
                raise StoreError(f"{seg.path}: unsupported segment format version {version} "
                                 f"(expected {fmt.VERSION})")
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
                res = fmt.scan(mm, size, file_acks, self._persistent_only)
                good = mm[:res.end] if res.garbage and self._sink.active else b""
            if res.end < size and (res.garbage or self._sink.active):
                # Drop a torn tail; the zeros a segment was allocated with only where a
                # replica's copy (its logical bytes) must match: each truncate is a journal
                # transaction, and 100k queues must boot and stop in reasonable time.
                os.ftruncate(fd, res.end)
                if res.garbage and self._sink.active:
                    self._sink.replace(seg.path, good)
        finally:
            if fd >= 0:
                os.close(fd)
        seg.end = res.end
        seg.count = res.count
        seg.acked = res.acked
        seg.ack_exists = seg.ack_written = has_acks
        valid_file_acks = file_acks & res.acked
        if len(valid_file_acks) != len(file_acks):
            # Positions past the data end or off record boundaries: rewrite without them.
            data = HEADER + b"".join(_U32.pack(p) for p in sorted(valid_file_acks))
            atomic_write(seg.ack_path, data)
            if self._sink.active:
                self._sink.replace(seg.ack_path, data)
        if seg.count == len(seg.acked):
            self._remove_file(seg.path)
            if has_acks:
                self._remove_file(seg.ack_path)
            return None
        self._ready += seg.count - len(seg.acked)
        self._bytes_ready += res.ready_bytes
        return seg

    def _read_acks(self, path: Path) -> set[int]:
        data = path.read_bytes()
        if len(data) < HEADER_SIZE:
            return set()  # crash while creating it: no acks recorded yet
        (version,) = _U32.unpack_from(data, 0)
        if version != fmt.VERSION:
            raise StoreError(f"{path}: unsupported ack file format version {version}")
        usable = HEADER_SIZE + (len(data) - HEADER_SIZE) // 4 * 4  # drop a torn last entry
        return {p for (p,) in _U32.iter_unpack(data[HEADER_SIZE:usable])}

    def _read_meta(self) -> tuple[int, int, bool]:
        """(delivered high-water mark, next segment number, closed cleanly); defaults (not
        clean) if missing or garbage."""
        try:
            with open(self._meta_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return 0, 1, False
        size = len(data) - _CRC.size
        if size not in (_META.size, _META_V1_SIZE):
            return 0, 1, False
        head = data[:size]
        if _CRC.unpack_from(data, size)[0] != zlib.crc32(head):
            return 0, 1, False
        magic, version, hwm, next_num = struct.unpack_from("<4sIQQ", head)
        if magic != _META_MAGIC or version not in (1, _META_VERSION):
            return 0, 1, False
        flags = _META.unpack(head)[4] if version == _META_VERSION and size == _META.size else 0
        self._meta_written = data
        return int(hwm), int(next_num), bool(flags & _META_CLEAN)


def _all_zero(fd: int, size: int) -> bool:
    chunk = 1 << 20
    for offset in range(0, size, chunk):
        if os.pread(fd, chunk, offset).strip(b"\0"):
            return False
    return True


# What a deferred store answers without reading its directory: its type and where it lives.
_AS_IS: Final = frozenset({"__class__", "_dir", "directory", "_files", "unread"})
# What it does without reading it: an unread store changed nothing on disk, so it has
# nothing to flush or sync (the cluster leader flushes every store when a follower
# connects), closing it is nothing and deleting it removes the directory as it is.
_IDLE: Final = frozenset({"flush", "sync"})
_UNREAD: Final = frozenset({"close", "delete"})


def _idle(*_args: object, **_kwargs: object) -> None:
    """``flush``/``sync`` of a store never read: nothing is buffered."""


class DeferredQueueStore(QueueStore):
    """A durable queue's store as boot leaves it: its directory not read yet.

    Any attribute looked up on it but those in ``_AS_IS`` first recovers it (the
    constructor's work, ``QueueStore._open_directory``) and turns it into a plain
    ``QueueStore`` in place, so whoever holds it (the queue, the syncer, a priority store)
    keeps holding the same object and the hot paths never test for it. ``flush`` and
    ``sync`` have nothing to do, ``close`` and ``delete`` need nothing read: the store
    becomes a closed ``QueueStore`` at once.
    Counters (``ready_count`` ...) read it too: the management API and the metrics never
    show a queue's numbers before its recovery found them.
    """

    __slots__ = ()
    unread = True

    def __getattribute__(self, name: str) -> Any:
        if name not in _AS_IS:
            if name in _IDLE:
                return _idle
            if name in _UNREAD:
                _close_unread(self)
            else:
                _read_deferred(self)
        return object.__getattribute__(self, name)


def _read_deferred(store: QueueStore) -> None:
    """Recover a deferred store now; from here on it is a plain ``QueueStore``. One that
    cannot be read (a corrupt segment, an unreadable file) is logged and stays empty and
    closed: that queue refuses messages (``StoreError``), every other queue carries on."""
    object.__setattr__(store, "__class__", QueueStore)
    store._files.deferred.pop(store, None)
    try:
        store._open_directory()
    except Exception as exc:
        log.error("queue store %s cannot be recovered, the queue is closed: %s", store._dir, exc)
        store._segs = {}
        store._order = []
        store._ready = store._bytes_ready = 0
        store._counts = None
        store._closed = True


def read_ahead(directories: list[str], stop: threading.Event) -> int:
    """Read what recovering the stores in ``directories`` reads first (the listing and the
    meta), so that their recovery on the event loop finds it in the kernel's caches: on a
    busy disk that is most of a recovery's time. For a worker thread: it only reads, and a
    directory gone meanwhile is skipped. Returns how many it read before ``stop`` was set."""
    done = 0
    for directory in directories:
        if stop.is_set():
            break
        try:
            os.listdir(directory)
            with open(os.path.join(directory, META_NAME), "rb") as f:
                f.read()
        except OSError:
            pass
        done += 1
    return done


def _close_unread(store: QueueStore) -> None:
    object.__setattr__(store, "__class__", QueueStore)
    store._files.deferred.pop(store, None)
    store._closed = True
