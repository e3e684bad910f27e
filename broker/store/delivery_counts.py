"""DeliveryCounts: how often each message of a queue was returned, kept on disk.

Theory of operation
-------------------
A quorum queue (or any queue with ``x-delivery-limit``) counts the returns of each message:
the count is its ``x-delivery-count`` and decides when the delivery limit dead-letters it.
RabbitMQ keeps the count in the queue's Raft log, so it survives a restart; Skred keeps it
next to the queue's segments, in one append-only file ``counts``: a u32 format version, then
records of (msgid u64, count u32), little-endian; a msgid's last record wins. A queue that
never counts never creates the file, and a plain queue never calls in here at all.

Durability follows the acks' rule (``queue_store.py``): a new count is buffered and written
to the file by the store's next sync (within ``ack_sync_interval``), its flush, or at once
with synchronous acks (``write_through``); a full sync fsyncs it. So a count older than the
window survives kill -9 and power loss. The record goes to the replication sink at once,
from the owner thread, so a follower that takes over knows the counts too.

Forgetting (the message was acked or dead-lettered) writes nothing: at recovery only the
counts of messages still in the queue are kept (the caller's ``live`` test). The file is
rewritten with the live counts (``atomic_write``, reported as a ``replace``) once it holds
more than ``COMPACT_MIN`` records and four times as many as there are live counts, so it
stays small however often messages come back. A compaction can forget the count of a
message whose ack is still inside the window; if the broker then dies within that window,
the message comes back counted from 0 (never lost, at most delivered more often).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from broker.errors import StoreError
from broker.store.compaction import out_of_space, rewrite
from broker.store.fileio import append_whole
from broker.store.segment_log import SegmentFiles
from broker.store.sink import ReplicationSink

NAME: Final = "counts"
VERSION: Final = 1
_HEADER: Final = struct.Struct("<I")
_RECORD: Final = struct.Struct("<QI")
COMPACT_MIN: Final = 4096  # records before a rewrite is considered


class DeliveryCounts:
    """The counts of one queue store. ``lock`` is the store's (its sync thread writes the
    buffer); every other method runs on the owner thread."""

    __slots__ = ("_buf", "_exists", "_files", "_lock", "_records", "_sink", "_unsynced", "counts", "path")

    def __init__(self, directory: str, lock: threading.Lock, sink: ReplicationSink,
                 files: SegmentFiles) -> None:
        self.path = Path(directory) / NAME
        self.counts: dict[int, int] = {}
        self._lock = lock
        self._sink = sink
        self._files = files
        self._buf = bytearray()  # records not yet in the file
        self._records = 0  # records in the file and the buffer
        self._exists = False  # the file (or its header in the buffer) exists
        self._unsynced = False  # written since the last fsync

    # ------------------------------------------------------------------ owner thread
    def set(self, msgid: int, count: int) -> None:
        self.counts[msgid] = count
        record = _RECORD.pack(msgid, count)
        created = not self._exists
        with self._lock:
            if created:
                self._exists = True
                self._buf += _HEADER.pack(VERSION)
            self._buf += record
        self._records += 1
        if self._sink.active:
            if created:
                self._sink.register_file(self.path)
                self._sink.append(self.path, _HEADER.pack(VERSION))
            self._sink.append(self.path, record)
        if self._records > COMPACT_MIN and self._records > 4 * len(self.counts):
            self._compact()

    def forget(self, msgid: int) -> None:
        self.counts.pop(msgid, None)

    def keep_only(self, msgids: Iterable[int]) -> None:
        """Forget every count but those of ``msgids`` (after a purge: the unacked ones)."""
        self.counts = {m: self.counts[m] for m in msgids if m in self.counts}

    def _compact(self) -> None:
        data = _HEADER.pack(VERSION) + b"".join(_RECORD.pack(m, n) for m, n in self.counts.items())
        with self._lock:
            if not rewrite(self.path, data, self._files):
                return  # the appends stay valid; the next set tries again
            self._buf.clear()
            self._unsynced = False
        self._records = len(self.counts)
        if self._sink.active:
            self._sink.replace(self.path, data)

    # ------------------------------------------------------------------ under the store's lock
    def write_locked(self) -> None:
        """Append the buffered records to the file (opened per write: no descriptor kept)."""
        if not self._buf:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            if not append_whole(fd, self._buf):  # whole records or nothing: tried again next sync
                out_of_space(self._files, self.path)
                return
        finally:
            os.close(fd)
        self._buf.clear()
        self._unsynced = True

    def take_unsynced(self) -> bool:
        """Whether the file was written since the last call (a full sync fsyncs it then)."""
        unsynced, self._unsynced = self._unsynced, False
        return unsynced

    # ------------------------------------------------------------------ recovery
    @classmethod
    def load(cls, directory: str, lock: threading.Lock, sink: ReplicationSink, files: SegmentFiles,
             live: Callable[[int], bool], remove: Callable[[Path], None]) -> DeliveryCounts | None:
        """The counts of the messages still in the queue (``live``); None, and the file
        removed, when none is left."""
        self = cls(directory, lock, sink, files)
        data = self.path.read_bytes()
        if len(data) >= _HEADER.size:
            (version,) = _HEADER.unpack_from(data, 0)
            if version != VERSION:
                raise StoreError(f"{self.path}: unsupported delivery count format version {version}")
            end = _HEADER.size + (len(data) - _HEADER.size) // _RECORD.size * _RECORD.size  # torn tail
            for msgid, count in _RECORD.iter_unpack(data[_HEADER.size:end]):
                self.counts[msgid] = count
            self._records = (end - _HEADER.size) // _RECORD.size
            if end != len(data):
                os.truncate(self.path, end)
                if sink.active:
                    sink.replace(self.path, data[:end])
        for msgid in [m for m in self.counts if not live(m)]:
            del self.counts[msgid]
        if not self.counts:
            remove(self.path)
            return None
        self._exists = True  # live counts were read, so the file has its header
        return self
