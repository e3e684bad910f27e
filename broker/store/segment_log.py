"""SegmentLog: the numbered, append-only segment files under a queue store and a stream store.

Theory of operation
-------------------
A log is a directory of segments ``msgs.NNNNNNNNNN`` (record format in ``segment.py``). Only
the newest one, the *write segment*, is written. It is created with its full size
(``segment_size``, or more for a larger record) as a sparse file and mapped read-write;
records are copied into the map, so an append costs no system call.

Disk space is allocated for real before it is written (``posix_fallocate``): first a small
chunk, then chunks that double up to 1 MiB as the segment fills. A page of a shared file
mapping without a block behind it is filled on first touch, and if the disk is full then
the kernel can only answer with SIGBUS, killing the broker. With the space reserved first,
a full disk is ``posix_fallocate`` failing with ENOSPC: the store raises ``DiskFull``
before anything of the record is written, logs it once (until space comes back), and
stays usable (reads, acks and deletes need no new space; deleted segments free some).
The hot path compares the append's end with ``_wcap``, the *allocated* end, so growing the
allocation is the same slow branch as rolling to a new segment (``_roll`` in the stores).

Allocating ahead. ``posix_fallocate`` is a journal transaction: while the group commit's
thread is inside an fdatasync of the same filesystem it waits for that commit, measured
3-13 ms of wall time for 0.1 ms of CPU on the event loop (issue 31: the manual-ack cells'
maxima). So once a write segment has ``AHEAD_FROM`` bytes allocated, each growth also hands
the *next* chunk to the segment worker thread (on a ``dup`` of the write fd, so a roll, a
retirement or an eviction that closes the log's descriptor meanwhile does not matter), and
the next growth adopts that chunk when it is done: no system call on the loop. A chunk not
done yet, or one that failed (a full disk), is ignored and the loop allocates as before, so
``DiskFull`` is still raised there, before anything of the record is written. A chunk that
lands after the segment was retired and trimmed only extends the file with zeros
(allocated, at most ``ALLOC_STEP_MAX``), which recovery reads as the end of the records, as
it does the zero tail of a sparse segment.

Rolling creates the next segment, then retires the old write segment: unmapped and
truncated to its used size (which also returns the unused allocation). Creating a file,
allocating its first blocks and mapping it costs 0.1 ms and up to 20 ms under load, which
would stall every connection: once the write segment is half allocated, a worker thread
prepares a *spare* (``next-segment.tmp``: created, allocated, header written, mapped), and the
roll renames it to the next segment's name, one metadata operation on the event loop. The
spare holds no record, and recovery ignores its name (and replication its ``.tmp``: a
follower hears of the segment when it is adopted, as of a created one), so a crash
leaves at most an unused file that the next spare replaces; the directory is fsynced for the rename as for a
creation. Without a spare ready (or one too small for a large record) the roll creates the
segment itself, as before. A segment's data is
fsynced by ``sync`` through a ``dup`` of the write fd taken under ``_lock`` (the fsync itself
runs outside the lock, on the syncer's worker thread); retired segments written since the
last sync are fsynced by path. Files created or removed mark the directory for an fsync.

The first segment, made ahead. A new queue's first message created its first segment on the
loop (create, truncate, allocate: three journal transactions, up to 13 ms each under load;
1,000 new queues getting their first message stalled every connection for seconds). So a log
made in a new directory that will be written (``_prepare_first``; ``QueueStore``: a durable
queue's) hands the creation of its first segment to the segment worker at once:
``create_file`` under the final name, ``FIRST_SIZE`` long with
``FIRST_ALLOC`` allocated and the header written, then closed. The log keeps no descriptor and
no mapping for it (an idle queue costs one small file, not two of the node's descriptors),
and the first append only opens and maps it (``_take_first``, ``O_NOATIME``: no journal
transaction; a first record larger than ``FIRST_ALLOC`` allocates the rest there, as before,
and one larger than ``FIRST_SIZE`` extends it to the usual size first). It is small
because an idle queue may keep it for long: a queue that fills it rolls to a full-sized
segment, the spare prepared at half of it as for any segment. The job runs under
``_lock`` and only while the log still wants it (``_first``), so an append that comes first
either cancels a job not started (and creates the segment itself, as before) or waits for
the one running. Durability is the creation's: the adopting append marks the directory for
the next sync's fsync and the segment's data is fsynced with its records, before any confirm.
A crash before the first append leaves a segment without records, which recovery removes (as
it removes one whose header was never written); so does a close other than the node's
shutdown (a shutdown leaves it to recovery rather than one unlink per idle queue). The
replication sink hears of the segment when it is adopted, as of a spare.
A recovered durable queue appends to a fresh segment after a restart, so its recovery makes
that segment ahead the same way (``_prepare_next``); one made ahead and never used, which a
clean shutdown leaves, is taken as it is (``_made_unused``, ``_adopt_made``): no removal and
no creation on the loop, at the recovery or at the first append.

Removing off the loop. An unlink is a journal transaction too (measured up to 31 ms on the
loop behind the group commit's fdatasync), so the files of a fully acked segment are
removed on the segment worker (``_remove_later``): one job per segment that unlinks its files
in the order given (the subclass's crash rule: a queue's segment before its ack file), and
the worker is one thread, so a log's removals happen in the order they were asked for. The
job marks the directory for the next sync's fsync after the unlinks (a job landing after a
sync took the mark leaves it for the next one; until then the removal may not survive a
crash, which recovery handles as it does a crash before the removal: an all-acked segment or
an orphan ack file is removed at boot). The replication sink hears of the removal from the
loop when it is asked for. ``close`` waits for the log's removals (``removed``) first: a clean
stop leaves no such file behind.

Deleting off the loop. Removing a queue's directory on the loop (an ``rmtree``: an unlink per
file and an rmdir, plus the trims of retired segments) stalled every connection for 105-272 ms
per burst of deletes (issue 31). ``delete`` closes descriptors and mappings (no trim: the
files go), reports every file to the sink, and renames the directory to a *tombstone*
(``paths.tombstone_path``): one metadata operation on the loop, all the durability a delete
needs (the definitions log, written first, says the queue is gone; the name is free for a new
queue at once). The segment worker removes the tombstone. A queue declared again under the
same name gets a new directory at the old path while jobs of the old log may still be queued:

* the first-segment job (``_make_first``) checks ``_closed`` under ``_lock``, which the delete
  sets under ``_lock`` before the rename: it does nothing, or it ran before and its file went
  with the tombstone;
* a spare's job is dropped by a job queued after it (``_drop_spare``): the worker is one
  thread, so both run before any job of the new log, and whatever the spare's job made (in the
  tombstone, or at the old path if it ran after the rename) is closed and removed before the new
  log's spare can exist;
* a removal job (``_unlink_in_order``) opens the directory first and unlinks relative to that
  descriptor, then checks ``_gone``, which the delete sets before the rename. Not set: the open
  came before the rename, so the descriptor is the old directory (a tombstone by now, perhaps)
  and no new file can be hit; set: it does nothing, the tombstone's removal takes the files.

A crash before the worker removed a tombstone leaves it; the next boot's sweep
(``remove_tombstones_later``, per vhost directory) removes it on the worker. No live
directory's name has the tombstone suffix, so the sweep never touches a live queue. A
``delete(inside=True)`` (a priority queue's levels, directories inside the queue's) skips the
rename: the enclosing delete's one rename takes them along.

The subclasses add what their records mean: ``QueueStore`` acks and the delivered mark,
``StreamStore`` offsets, the segment index and retention. Both report every file mutation to
the replication sink from the owner (event loop) thread; ``sync`` never calls the sink.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import resource
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

from broker.errors import DiskFull, StoreError
from broker.store import segment as fmt
from broker.store.fileio import datasync, fsync_dir, syncfs
from broker.store.paths import TOMBSTONE_SUFFIX, tombstone_path
from broker.store.segment import HEADER, HEADER_SIZE, LogSegment
from broker.store.sink import ReplicationSink

log = logging.getLogger(__name__)

ALLOC_FIRST: Final = 16 * 1024  # first allocation of a segment: small queues stay small on disk
ALLOC_STEP_MAX: Final = 1024 * 1024  # allocation chunks double up to this
AHEAD_FROM: Final = 256 * 1024  # a segment this far allocated grows ahead, off the loop (module doc)
MIN_MAPS: Final = 64  # mapped segments a node may always keep, whatever its limits
_PAGE: Final = 4096
_NO_SPACE: Final = (errno.ENOSPC, errno.EDQUOT)
_NOATIME: Final = getattr(os, "O_NOATIME", 0)
# A new log's first segment, made ahead on the segment worker (module doc): this small (a queue
# declared and never used keeps no more on disk, and a copy of the data dir reads no more of it),
# one page of it allocated (the header and the first records).
FIRST_SIZE: Final = 64 * 1024
FIRST_ALLOC: Final = _PAGE
_FIRST_NONE, _FIRST_PENDING, _FIRST_READY = 0, 1, 2  # SegmentLog._first

S = TypeVar("S", bound=LogSegment)


# Retired write segments waiting for the next sync keep at most this many descriptors open.
RETIRED_OPEN = 16


def default_max_maps() -> int:
    """How many segments a node keeps mapped: a mapped write segment costs two descriptors
    (ours and the one CPython's mmap keeps) and one of the kernel's ``vm.max_map_count``
    mappings, and both must leave room for sockets and everything else."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):  # pragma: no cover - no such limit
        soft = 1024
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = 1 << 20
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            max_maps = int(f.read())
    except (OSError, ValueError):
        max_maps = 65530
    return max(MIN_MAPS, min(soft // 4, max_maps // 2))


class SegmentFiles:
    """What the segment logs of one node share: the disk (a full disk is logged once per
    episode) and a bound on mapped segments.

    Every mapping a log makes is registered here; past ``max_maps`` the oldest mapping is
    given back to its log (``SegmentLog._evict``: a read map is simply unmapped, the write
    segment is unmapped and its descriptor closed, to be mapped again by the next append
    or read). Eviction is a clock: a log marks a segment ``used`` where it works on it,
    and such a segment gets a second round before it goes, so a mapping held by the call
    in progress is not evicted under it (that would take ``max_maps`` other mappings made
    within one call). A store given none has its own.
    """

    __slots__ = ("full", "max_maps", "_maps", "evictions", "shutting_down", "opened", "deferred")

    def __init__(self, max_maps: int | None = None) -> None:
        self.full = False
        # Set by the node before it closes every store: closing logs leave their last
        # segment's zero tail in place (recovery stops at zeros) instead of trimming it,
        # since one truncate per queue (a journal transaction each) made stopping 3,000
        # queues take 16 s.
        self.shutting_down = False
        self.max_maps = max(MIN_MAPS, max_maps if max_maps is not None else default_max_maps())
        self._maps: OrderedDict[LogSegment, SegmentLog[Any]] = OrderedDict()
        self.evictions = 0
        # Stores whose "not closed cleanly" meta, written as they opened, awaits an fsync:
        # the node makes them durable with one syncfs at boot (``sync_opened``); a store
        # still waiting fsyncs its own before it delivers (``QueueStore``).
        self.opened: list[Callable[[], None]] = []
        # Durable queue stores a boot made without reading their directories
        # (``queue_store.DeferredQueueStore``): each is read on first use, or by the node
        # through ``open_deferred`` once it serves.
        self.deferred: dict[SegmentLog[Any], None] = {}

    def sync_opened(self, directory: Path) -> int:
        """One syncfs of the filesystem holding ``directory`` (the data dir) for every open
        meta written since the last call, instead of an fsync per queue; returns how many."""
        done, self.opened = self.opened, []
        if done:
            syncfs(directory)
            for synced in done:
                synced()
        return len(done)

    def deferred_dirs(self) -> list[str]:
        """The directories of the deferred stores, in the order they were made."""
        return [log_._dir for log_ in self.deferred]

    def open_deferred(self, limit: int) -> int:
        """Read up to ``limit`` of the deferred stores; returns how many are still unread."""
        pending = self.deferred
        for _ in range(min(limit, len(pending))):
            store = pending.popitem()[0]  # the newest first (popping the oldest is O(n))
            store.ensure_open()
        return len(pending)

    @property
    def mapped(self) -> int:
        return len(self._maps)

    def add(self, seg: LogSegment, owner: SegmentLog[Any]) -> None:
        """``seg`` of ``owner`` was just mapped; evict others if that is one too many."""
        maps = self._maps
        maps[seg] = owner
        seg.used = True
        while len(maps) > self.max_maps:
            old, log_ = maps.popitem(last=False)
            if old.used:
                old.used = False
                maps[old] = log_
                continue
            self.evictions += 1
            log_._evict(old)

    def forget(self, seg: LogSegment) -> None:
        self._maps.pop(seg, None)

    def no_space(self, path: Path, exc: OSError) -> DiskFull:
        if not self.full:
            self.full = True
            log.warning("disk full: cannot allocate space for %s (%s); publishes are refused "
                        "until space is freed", path, exc.strerror)
        return DiskFull(f"disk full: no space for {path.name}")

    def space(self) -> None:
        if self.full:
            self.full = False
            log.info("disk space available again")


def is_no_space(exc: OSError) -> bool:
    return exc.errno in _NO_SPACE


def _round_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def allocate(fd: int, start: int, end: int, path: Path, disk: SegmentFiles) -> None:
    """Reserve blocks for bytes [start, end) of ``fd``; DiskFull if the disk has none."""
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        if is_no_space(exc):
            raise disk.no_space(path, exc) from None
        raise
    disk.space()


SPARE_NAME: Final = "next-segment.tmp"  # prepared ahead of a roll; .tmp: never replicated
SPARE_ALLOC: Final = ALLOC_STEP_MAX  # allocated with a spare: it follows a segment that filled
_spare_pool: ThreadPoolExecutor | None = None


def _spare_worker() -> ThreadPoolExecutor:
    global _spare_pool
    if _spare_pool is None:
        _spare_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skred-segment")
    return _spare_pool


def _make_spare(path: Path, cap: int, alloc: int, files: SegmentFiles) -> tuple[int, mmap.mmap]:
    """``create_mapped`` for a spare (on the worker thread), replacing one left by a crash."""
    path.unlink(missing_ok=True)
    return create_mapped(path, cap, alloc, files)


def _allocate_ahead(fd: int, start: int, end: int) -> None:
    """On the segment worker: reserve bytes [start, end) of a write segment through ``fd`` (a
    ``dup``, closed here). A failure (a full disk) stays in the future: the loop then
    allocates itself and reports it (module doc)."""
    try:
        os.posix_fallocate(fd, start, end - start)
    finally:
        os.close(fd)


def _drop_spare(fut: Future[tuple[int, mmap.mmap]], path: Path) -> None:
    """Wait for a spare's creation, then close and remove it."""
    try:
        fd, mm = fut.result()
    except Exception:
        return  # nothing was left behind (create_mapped cleans up after itself)
    mm.close()
    os.close(fd)
    path.unlink(missing_ok=True)


def create_file(path: Path, cap: int, alloc: int, files: SegmentFiles) -> int:
    """A new segment file of ``cap`` bytes (sparse) with its first ``alloc`` bytes allocated
    and the format header written; its descriptor. Nothing is left behind on failure."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, cap)
        allocate(fd, 0, alloc, path, files)
        # The header goes in with pwrite, not through the map: the first write fault on a
        # page the page cache does not hold yet costs milliseconds on ext4 (measured 5-10 ms
        # under load, and it stalls the event loop); after a pwrite the page is there.
        if os.pwrite(fd, HEADER, 0) != HEADER_SIZE:
            raise StoreError(f"{path}: short write of the segment header")
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def create_mapped(path: Path, cap: int, alloc: int, files: SegmentFiles) -> tuple[int, mmap.mmap]:
    """``create_file``, mapped read-write. Nothing is left behind on failure."""
    fd = create_file(path, cap, alloc, files)
    try:
        mm = mmap.mmap(fd, cap)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd, mm


class SegmentLog(Generic[S]):
    """The write segment, its allocation, roll-over, retirement and the fsync protocol."""

    unread: bool = False  # a store recovered at boot but not read yet (``DeferredQueueStore``)

    __slots__ = (
        "_ahead", "_closed", "_dir", "_dir_unsynced", "_dirty", "_files", "_first", "_retired", "_lock",
        "_next_num", "_order", "_removing", "_seg_unsynced", "_segment_size", "_segs", "_sink", "_spare",
        "_sync_lock", "_unsynced_paths", "_walloc", "_wcap", "_wfd", "_wlimit", "_wmm", "_wseg", "_gone",
    )
    # Retired segments (and other files) written since the last sync, fsynced by path.
    # Set by the subclass (QueueStore allocates it lazily).
    _unsynced_paths: set[Path]

    def _init_log(self, directory: str | Path, segment_size: int, sink: ReplicationSink,
                  files: SegmentFiles | None) -> None:
        if not fmt.FIXED_SIZE + HEADER_SIZE <= segment_size <= fmt.MAX_SEGMENT_SIZE:
            raise ValueError(f"segment_size out of range: {segment_size}")
        self._dir = os.fspath(directory)
        self._segment_size = segment_size
        self._sink = sink
        self._files = files if files is not None else SegmentFiles()
        self._segs: dict[int, S] = {}
        self._order: list[int] = []  # segment numbers, ascending
        self._next_num = 1
        # Write segment (None until the first append after open).
        self._wseg: S | None = None
        self._wmm: mmap.mmap | None = None
        self._wfd = -1
        self._wcap = 0  # allocated end of the write segment while mapped (else 0): appends
        # up to here need no syscall
        self._walloc = 0  # allocated end of the write segment, mapped or not
        self._wlimit = 0  # size of the write segment file (and of its mapping)
        self._lock = threading.Lock()  # state shared with the sync thread
        self._sync_lock = threading.Lock()  # whole syncs against each other and close
        self._closed = False
        self._dirty = False
        self._seg_unsynced = False  # appended to the write segment since the last sync
        self._dir_unsynced = False  # files created/removed since the last sync
        # Write segments retired since the last sync: (fd or -1, path, used end, unsynced data).
        # The sync thread trims, fsyncs and closes them, off the event loop.
        self._retired: list[tuple[int, Path, int, bool]] = []
        self._spare: Future[tuple[int, mmap.mmap]] | None = None  # the next segment, being prepared
        # The next chunk of the write segment, being allocated off the loop: (segment, its
        # start, its end, the job).
        self._ahead: tuple[S, int, int, Future[None]] | None = None
        self._removing: Future[None] | None = None  # the last removal job (module doc)
        self._first = _FIRST_NONE  # the first segment made ahead: none, being made, ready
        self._gone = False  # deleted: the directory is (being) renamed to a tombstone (module doc)

    @property
    def directory(self) -> Path:
        """The log's directory (built on demand: the log keeps only a ``str``)."""
        return Path(self._dir)

    def ensure_open(self) -> None:
        """Nothing for an open log. A deferred queue store reads its directory on this
        lookup, as on any other (``queue_store.DeferredQueueStore``)."""

    # ------------------------------------------------------------------ writing

    def _grow(self, need: int, want: int = 0) -> S | None:
        """The write segment with at least ``need`` (ideally ``want``) more bytes allocated,
        or None if it cannot take ``need`` more (none, or its mapping is too small)."""
        seg = self._wseg
        if seg is None or seg.end + need > self._wlimit:
            return None
        if self._wmm is None:
            self._remap_write_segment(seg)
            if seg.end + need <= self._walloc:
                return seg
        have = self._walloc
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] is seg and ahead[1] == have and ahead[3].done() \
                and ahead[3].exception() is None:
            have = ahead[2]  # allocated off the loop (see the module doc)
            self._files.space()
        if seg.end + max(need, want) <= have:
            end = have
        else:
            step = min(max(have, ALLOC_FIRST), ALLOC_STEP_MAX)
            end = min(self._wlimit, _round_up(max(seg.end + need, seg.end + want, have + step)))
            allocate(self._wfd, have, end, seg.path, self._files)
        self._wcap = self._walloc = end
        if AHEAD_FROM <= end < self._wlimit and not self._closed:
            ahead_end = min(self._wlimit, end + min(end, ALLOC_STEP_MAX))
            self._ahead = (seg, end, ahead_end, _spare_worker().submit(_allocate_ahead, os.dup(self._wfd),
                                                                        end, ahead_end))
        if end * 2 >= self._wlimit and self._spare is None and not self._closed \
                and self._files.mapped * 2 < self._files.max_maps:
            # half way: prepare the next segment off the event loop (see the module doc)
            self._spare = _spare_worker().submit(_make_spare, Path(self._dir, SPARE_NAME), self._segment_size,
                                                 self._spare_alloc, self._files)
        return seg

    @property
    def _spare_alloc(self) -> int:
        return min(self._segment_size, SPARE_ALLOC)

    def _prepare_first(self) -> None:
        """A new log (nothing on disk yet): have the segment worker make its first segment
        now, so that the first append only opens and maps it (module doc)."""
        self._first = _FIRST_PENDING
        _spare_worker().submit(self._make_first)

    def _make_first(self) -> None:
        """On the segment worker, under ``_lock`` (an append that comes meanwhile waits for
        it, as it would have for its own creation): the first segment, unless the log took
        another way meanwhile (``_take_first``) or was closed.

        Checked first without the lock, which is cheap for a log that took another way
        (``_first`` never becomes pending again). Nothing waits for this worker under the lock:
        ``close`` waits for the log's removals and spare (queued behind this job, for a
        recovered log with segments: ``_prepare_next``) before it takes ``_lock``."""
        if self._first != _FIRST_PENDING:
            return
        with self._lock:
            if self._first != _FIRST_PENDING or self._closed:
                return
            path = Path(self._dir, fmt.segment_name(self._next_num))
            try:
                os.close(create_file(path, self._first_size, FIRST_ALLOC, self._files))
            except Exception as exc:  # the first append creates it itself, and reports a full disk
                log.debug("%s: first segment not made ahead: %s", self, exc)
                self._first = _FIRST_NONE
                return
            self._first = _FIRST_READY

    def _prepare_next(self) -> None:
        """A recovered log: its next segment made ahead like a new log's first (a restart's
        appends go to a fresh segment), unless recovery took one made before (``_adopt_made``)."""
        if self._first == _FIRST_NONE and not self._closed:
            self._prepare_first()

    def _made_unused(self, num: int) -> bool:
        """Whether segment ``num`` is one made ahead (``_make_first``) and never written to: the
        first segment's size, the header, zeros after it. A clean shutdown leaves such a segment
        (it is not removed on the way down: ``_close_files``), and recovery takes it as the next
        segment (``_adopt_made``) instead of removing it on the loop and making another."""
        size = self._first_size
        try:
            fd = os.open(os.path.join(self._dir, fmt.segment_name(num)), os.O_RDONLY | _NOATIME)
        except OSError:
            return False
        try:
            return os.fstat(fd).st_size == size and os.pread(fd, HEADER_SIZE, 0) == HEADER \
                and not os.pread(fd, size - HEADER_SIZE, HEADER_SIZE).strip(b"\0")
        finally:
            os.close(fd)

    def _adopt_made(self, num: int) -> None:
        """Recovery: segment ``num``, made ahead and unused (``_made_unused``), is the next one."""
        self._next_num = num
        self._first = _FIRST_READY

    @property
    def _first_size(self) -> int:
        return min(self._segment_size, FIRST_SIZE)

    def _take_first(self, seg: S, cap: int, need: int, want: int) -> tuple[int, mmap.mmap, int, int] | None:
        """The first segment made ahead as ``seg``, with ``need`` (ideally ``want``) bytes
        allocated past the header: (fd, map, allocated end, size); None when none was made (a
        job not started yet will do nothing). A first record or run larger than the segment
        made gets ``cap`` bytes, as a created one would. DiskFull leaves it ready for the next try."""
        with self._lock:
            ready = self._first == _FIRST_READY
            self._first = _FIRST_NONE
        if not ready:
            return None
        path = seg.path
        size = self._first_size
        # O_NOATIME: mapping the new file would otherwise dirty its inode (a journal transaction)
        fd = os.open(path, os.O_RDWR | _NOATIME)
        try:
            if HEADER_SIZE + need > size:  # (rare) a large first record or run
                os.ftruncate(fd, cap)
                size = cap
            alloc = FIRST_ALLOC
            if HEADER_SIZE + max(need, want) > alloc:  # allocated here, as a created one would be
                end = min(size, _round_up(max(HEADER_SIZE + need, HEADER_SIZE + want, ALLOC_FIRST)))
                allocate(fd, alloc, end, path, self._files)
                alloc = end
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            self._first = _FIRST_READY
            raise
        return fd, mm, alloc, size

    def _take_spare(self, path: Path, cap: int, alloc: int) -> tuple[int, mmap.mmap] | None:
        """The spare, renamed to ``path``, when it is ready and has ``cap`` bytes (``alloc`` of
        them allocated now); None when there is none to take (it is kept if only too small)."""
        fut = self._spare
        if fut is None or not fut.done() or cap > self._segment_size:
            return None
        self._spare = None
        try:
            fd, mm = fut.result()
        except Exception:  # a full disk, say: the roll creates the segment itself and reports it
            return None
        spare = Path(self._dir, SPARE_NAME)
        try:
            if alloc > self._spare_alloc:
                allocate(fd, self._spare_alloc, alloc, path, self._files)
            os.rename(spare, path)
        except BaseException:
            mm.close()
            os.close(fd)
            spare.unlink(missing_ok=True)
            raise
        return fd, mm

    def _remap_write_segment(self, seg: S) -> None:
        """Map the write segment again after ``_evict`` gave its mapping back."""
        self._unmap(seg)  # a read-only map made meanwhile by a reader
        fd = os.open(seg.path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, self._wlimit)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            seg.mm = self._wmm = mm
            self._wfd = fd
            self._wcap = self._walloc
        self._files.add(seg, self)

    def _evict(self, seg: S) -> None:
        """Give ``seg``'s mapping back (SegmentFiles over budget). The write segment stays
        the write segment: unmapped, descriptor closed, its unsynced data fsynced by path;
        the next append maps it again (``_grow``)."""
        fd = -1
        with self._lock:
            mm, seg.mm = seg.mm, None
            if mm is not None and mm is self._wmm:
                self._wmm = None
                self._wcap = 0  # the next append takes the slow path
                fd, self._wfd = self._wfd, -1
                if self._seg_unsynced:
                    self._seg_unsynced = False
                    self._unsynced_paths.add(seg.path)
        if mm is not None:
            mm.close()
        if fd >= 0:
            os.close(fd)

    def _unmap(self, seg: S) -> None:
        seg.unmap()
        self._files.forget(seg)

    def _map_read(self, seg: S) -> mmap.mmap:
        """``seg`` mapped (read-only unless it is the mapped write segment), registered."""
        mm = seg.mm
        if mm is not None:
            seg.used = True
            return mm
        try:
            mm = seg.map_read()
        except (OSError, ValueError) as exc:
            raise StoreError(f"cannot map {seg.path}: {exc}") from exc
        self._files.add(seg, self)
        return mm

    def _start_segment(self, seg: S, need: int, want: int = 0) -> S | None:
        """Create ``seg`` (the next number) as the write segment with room for ``need`` bytes;
        retire the previous one, which is returned. DiskFull leaves everything as it was."""
        if self._closed:  # after close() the write segment is gone, so appends land here
            raise StoreError(f"store {self._dir} is closed")
        cap = max(self._segment_size, need + HEADER_SIZE)
        if cap > fmt.MAX_SEGMENT_SIZE:
            raise StoreError(f"message of {need} bytes is too large for a segment")
        alloc = min(cap, _round_up(max(HEADER_SIZE + need, HEADER_SIZE + want, ALLOC_FIRST)))
        first = self._take_first(seg, cap, need, want) if self._first else None
        taken = self._take_spare(seg.path, cap, alloc) if first is None else None
        if first is not None:
            fd, mm, alloc, cap = first
        elif taken is not None:
            fd, mm = taken
            alloc = max(alloc, self._spare_alloc)
        else:
            fd, mm = create_mapped(seg.path, cap, alloc, self._files)
        seg.mm = mm
        self._files.add(seg, self)
        old = self._wseg
        with self._lock:
            self._next_num = seg.num + 1
            self._segs[seg.num] = seg
            self._order.append(seg.num)
            if old is not None:
                self._retire_write_segment_locked(old)
            self._wseg = seg
            self._ahead = None  # the old segment's
            self._wmm = mm
            self._wfd = fd
            self._wcap = self._walloc = alloc
            self._wlimit = cap
            self._dir_unsynced = True
        if self._sink.active:
            self._sink.register_file(seg.path)
            self._sink.append(seg.path, HEADER)
        if old is not None:
            self._unmap_older_retired()
        return old

    def _unmap_older_retired(self) -> None:
        """Give back the mapping of the segment retired at the previous roll: written back
        by now, so its unmap is cheap (0.25 ms for 8 MiB), and otherwise a backlog nobody
        reads stays mapped whole (10 GB of RSS at 10 M queued 1 KiB messages). The segment
        retired just now keeps its mapping (a caught-up consumer reads it next), and a
        reader's segment (``_keep_mapped``) too; a reader maps the others again when it
        gets there. Older ones were unmapped at earlier rolls."""
        if len(self._order) >= 3:
            seg = self._segs.get(self._order[-3])
            if seg is not None and seg.mm is not None and not self._keep_mapped(seg):
                self._unmap(seg)

    def _keep_mapped(self, seg: S) -> bool:
        """Subclass hook: ``seg`` is being read (stays mapped when the log rolls)."""
        return False

    def _retire_write_segment_locked(self, seg: S) -> None:
        """Unmap the write segment and hand it to the next sync, which trims it to its
        records (returning the unused allocation) and fsyncs it: a truncate is a journal
        transaction (1-2 ms measured under load), which the event loop must not wait for.
        The mapping stays as the segment's read map (consumers usually read it next): an
        unmap of a freshly written 8 MiB mapping costs 1-25 ms, and it is cheaper later,
        once the sync wrote the pages back: the next roll gives it back
        (``_unmap_older_retired``), if the budget, a cursor move or the deletion of the
        segment did not do so first."""
        self._wmm = None
        retired = self._retired
        retired.append((self._wfd, seg.path, seg.end, self._seg_unsynced))
        self._wfd = -1  # now owned by the _retired entry
        if len(retired) > RETIRED_OPEN:
            # Rolling faster than syncs come (a starved syncer, tiny segments): keep only the
            # newest descriptors; the sync trims and fsyncs the others by path.
            fd, path, end, unsynced = retired[-RETIRED_OPEN - 1]
            if fd >= 0:
                os.close(fd)
                retired[-RETIRED_OPEN - 1] = (-1, path, end, unsynced)
        self._wseg = None
        self._wcap = self._walloc = self._wlimit = 0

    # ------------------------------------------------------------------ durability

    def sync(self, full: bool = False, fsync: bool = True) -> None:
        """fsync what was appended (and, per subclass, what else ``full`` covers).

        Safe on a worker thread: ``_sync_locked`` snapshots under ``_lock`` and may
        add paths to fsync and return work to run after them. ``fsync=False`` writes
        what is buffered but leaves the fsyncs to the caller's one ``syncfs`` over the
        whole data dir (many dirty logs: one flush instead of one per file)."""
        with self._sync_lock:
            if self._closed:
                return
            fds: list[int] = []
            seg_unsynced = False
            paths: list[Path] = []
            retired: list[tuple[int, Path, int, bool]] = []
            trimmed = 0  # retired segments done
            trimming = False  # _trim raised: it closed that segment's descriptor
            try:
                try:
                    with self._lock:
                        self._dirty = False
                        seg_unsynced = self._seg_unsynced
                        if seg_unsynced and self._wfd >= 0 and fsync:
                            fds.append(os.dup(self._wfd))
                        self._seg_unsynced = False
                        paths = list(self._unsynced_paths)
                        self._unsynced_paths.clear()
                        retired, self._retired = self._retired, []
                        after = self._sync_locked(full, paths)
                        if full:
                            self._settle_locked(paths)
                        dir_unsynced = self._dir_unsynced
                        self._dir_unsynced = False
                    synced = paths if fsync else []
                    for fd in fds:
                        datasync(fd)
                finally:
                    for fd in fds:
                        os.close(fd)
                trimming = True
                for fd, path, end, unsynced in retired:
                    _trim(fd, path, end, unsynced and fsync)
                    trimmed += 1
                trimming = False
                for path in synced:
                    datasync_path(path)
                if after is not None:
                    after()
                if dir_unsynced and fsync:
                    fsync_dir(self.directory)
            except BaseException:
                left = retired[trimmed:]
                if trimming and left:
                    _fd, path, end, unsynced = left[0]
                    left[0] = (-1, path, end, unsynced)
                self._sync_failed(seg_unsynced, paths, left)
                raise

    def _sync_failed(self, seg_unsynced: bool, paths: list[Path],
                     retired: list[tuple[int, Path, int, bool]]) -> None:
        """A sync raised: everything it took stays due, so the next sync (the group commit
        retries a store that failed) does it again instead of finding nothing to do."""
        with self._lock:
            self._dirty = True
            self._seg_unsynced |= seg_unsynced
            self._unsynced_paths.update(paths)
            self._retired[:0] = retired
            self._dir_unsynced = True

    def _sync_locked(self, full: bool, paths: list[Path]) -> Callable[[], None] | None:
        """Subclass hook, under ``_lock``: write what ``sync`` covers, add paths to fsync."""
        return None

    def settle(self) -> None:
        """fsync the files only a full sync covers and no confirm depends on (``_settle_locked``:
        a queue's ack files, delivered mark and delivery counts), after a ``sync(full=False)``
        wrote them. The syncer runs it on a thread of its own, so that a confirm never waits
        for these journal commits (``broker/syncer.py``, "Settling"). Neither lock is held
        during the fsyncs: a ``sync`` of the same log on the group commit's thread runs
        meanwhile. By path, like a retired segment: a file removed since is simply gone. A
        failure leaves what it did not fsync due for the next sync of any kind."""
        paths: list[Path] = []
        with self._lock:
            if self._closed:
                return
            self._settle_locked(paths)
        for k, path in enumerate(paths):
            try:
                datasync_path(path)
            except BaseException:
                self._sync_failed(False, paths[k:], [])
                raise

    def _settle_locked(self, paths: list[Path]) -> None:
        """Subclass hook, under ``_lock``: take the written but unsynced files that only a full
        sync makes durable (none here)."""

    def _remove_later(self, *paths: Path) -> None:
        """Unlink ``paths`` (files of this log's directory) in this order on the segment worker
        (module doc); the caller has marked the directory and told the sink."""
        self._removing = _spare_worker().submit(self._unlink_in_order, tuple(p.name for p in paths))

    def _unlink_in_order(self, names: tuple[str, ...]) -> None:
        """On the segment worker. A failure leaves the rest (recovery removes what is left).
        Relative to the directory opened before ``_gone`` is read (module doc: a queue declared
        again in the same place never loses a file to the old log's late removal)."""
        try:
            dfd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return  # deleted, the tombstone removed already: nothing left to remove
        name = ""
        try:
            if self._gone:
                return
            for name in names:
                try:
                    os.unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    pass
        except OSError as exc:
            log.warning("%s: could not remove %s: %s", self, name, exc)
        finally:
            os.close(dfd)
        self._dir_unsynced = True  # no lock: see the module doc (at worst the next sync's)

    def removed(self) -> None:
        """Wait until the files this log asked to remove so far are gone (tests, close)."""
        job = self._removing
        if job is not None:
            job.result()
            if self._removing is job:
                self._removing = None

    def _close_files(self) -> None:
        """Unmap everything, trim retired segments and close their descriptors. At node
        shutdown (``SegmentFiles.shutting_down``) the trim is skipped: the zero tail is
        harmless (recovery stops at the first zero record)."""
        self.removed()
        if self._first == _FIRST_READY and not self._files.shutting_down:
            # never used: removed now (at node shutdown left to recovery, which removes a
            # segment without records, rather than one unlink per idle queue on the way down)
            Path(self._dir, fmt.segment_name(self._next_num)).unlink(missing_ok=True)
        self._first = _FIRST_NONE  # a job not started yet does nothing (it sees _closed, too)
        if self._wseg is not None:
            self._retire_write_segment_locked(self._wseg)
        self._ahead = None
        if self._spare is not None:
            _drop_spare(self._spare, Path(self._dir, SPARE_NAME))
            self._spare = None
        for seg in self._segs.values():
            self._unmap(seg)
        retired, self._retired = self._retired, []
        for fd, path, end, _unsynced in retired:
            if not self._files.shutting_down:
                _trim(fd, path, end, False)
            elif fd >= 0:
                os.close(fd)

    def _before_close(self) -> None:
        """Subclass hook: settle what is buffered before the final sync."""

    def close(self) -> None:
        """Settle, sync everything, trim the write segment, unmap. Idempotent. At node
        shutdown (``SegmentFiles.shutting_down``) what is left is written, not fsynced: the
        node's one syncfs after closing every store covers all of them (a queue store's
        closed-cleanly meta is an fsync per queue otherwise)."""
        if self._closed:
            return
        self._before_close()
        self.sync(True, fsync=not self._files.shutting_down)
        # Wait for the worker's jobs of this log before taking ``_lock``: a job making the next
        # segment of a recovered log (``_prepare_next``) may be queued ahead of them and takes
        # ``_lock`` itself. Nothing of this log asks the worker for more meanwhile (the loop
        # asks, and it is here).
        self.removed()
        if self._spare is not None:
            _drop_spare(self._spare, Path(self._dir, SPARE_NAME))
            self._spare = None
        with self._sync_lock, self._lock:
            self._closed = True
            self._close_files()

    def delete(self, *, inside: bool = False) -> None:
        """Close and remove the whole directory (every file reported to the sink): renamed to a
        tombstone here, removed on the segment worker (module doc). ``inside``: the directory
        goes with an enclosing one, whose delete follows (no rename of its own)."""
        with self._sync_lock, self._lock:
            self._gone = True  # before the rename (module doc)
            if not self._closed:  # no flush, trim or fsync: everything is about to go
                self._closed = True
                self._drop_files()
        if self._sink.active:
            try:
                entries = sorted(os.scandir(self._dir), key=lambda e: e.name)
            except FileNotFoundError:
                entries = []
            for entry in entries:
                if entry.is_file():
                    self._sink.delete(Path(entry.path))
        if not inside:
            bury(self._dir)

    def _drop_files(self) -> None:
        """``_close_files`` for a delete: descriptors and mappings go; nothing is trimmed,
        removed or waited for (the tombstone's removal takes the files; module doc)."""
        self._first = _FIRST_NONE
        if self._wseg is not None:
            self._retire_write_segment_locked(self._wseg)
        self._ahead = None
        if self._spare is not None:
            _spare_worker().submit(_drop_spare, self._spare, Path(self._dir, SPARE_NAME))
            self._spare = None
        for seg in self._segs.values():
            self._unmap(seg)
        retired, self._retired = self._retired, []
        for fd, _path, _end, _unsynced in retired:
            if fd >= 0:
                os.close(fd)

    def __repr__(self) -> str:  # names the store in the group commit's failure log
        return f"{type(self).__name__}({self._dir})"

    def _remove_file(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self._dir_unsynced = True
        if self._sink.active:
            self._sink.delete(path)


def bury(directory: str) -> None:
    """Rename ``directory`` to a tombstone (here: the name is free when this returns) and have
    the segment worker remove it (module doc); nothing if there is no such directory."""
    tomb = tombstone_path(directory)
    try:
        os.rename(directory, tomb)
    except FileNotFoundError:
        return  # never made, or gone already
    except OSError as exc:  # the rename refused (say, no space to grow the parent): as before
        log.warning("%s: could not rename for removal (%s); removing it now", directory, exc)
        shutil.rmtree(directory, ignore_errors=True)
        return
    _spare_worker().submit(_remove_tree, tomb)


def _remove_tree(tomb: str) -> None:
    """On the segment worker: remove a deleted log's tombstone (module doc)."""
    shutil.rmtree(tomb, ignore_errors=True)


def _sweep_tombstones(directory: str) -> None:
    """On the segment worker: remove the tombstones a crash left in ``directory``."""
    try:
        entries = [e.path for e in os.scandir(directory) if e.name.endswith(TOMBSTONE_SUFFIX)]
    except OSError:
        return  # no such directory (yet)
    for tomb in entries:
        _remove_tree(tomb)
    if entries:
        log.info("%s: removed %d deleted queue directories left by a crash", directory, len(entries))


def remove_tombstones_later(directory: str | Path) -> None:
    """Have the segment worker remove the tombstones in ``directory`` (a boot: module doc). A
    live directory's name never has the suffix, so this may run while queues are served."""
    _spare_worker().submit(_sweep_tombstones, os.fspath(directory))


def _trim(fd: int, path: Path, end: int, fsync: bool) -> None:
    """Truncate a retired segment to ``end`` (fsync it if asked), then close it; ``fd`` -1:
    by path (its mapping was evicted, or it is gone already)."""
    if fd < 0:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return
    try:
        os.ftruncate(fd, end)
        if fsync:
            datasync(fd)
    finally:
        os.close(fd)


def datasync_path(path: Path) -> None:
    """fdatasync a file by name; a file deleted since has nothing left to make durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        datasync(fd)
    finally:
        os.close(fd)
