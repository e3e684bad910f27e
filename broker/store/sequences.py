"""SequenceLog: a stream's publisher sequences written in order with its log.

Theory of operation
-------------------
The stream protocol deduplicates by (publisher reference, publishing id): a named publisher's
*sequence* is the highest id it stored, and a message whose id is not above it is confirmed
without being stored again. For that to hold across kill -9 and failover, the sequence must
reach the disk and the followers no later than the messages it covers: a sequence kept only in
the offsets file (rewritten at the next sync) lags the log, so a message stored just before a
crash, unconfirmed, would be stored again when its client resends it.

So each change is also appended at once (one ``write``, right after the append that stored the
messages, on the owner thread) to the file ``sequences`` beside the segments: records of
(name length u16, name, sequence u64, end offset u64, crc32 u32), little-endian, after a u32
format version. The *end offset* is the log's next offset when the sequence was set: the
messages the sequence covers lie below it. The record goes to the replication sink right after
the segment bytes it covers, and the file is fsynced by the store's sync, before any confirm.
A process killed after both writes leaves both in the page cache, so recovery sees them.

Recovery reads the records up to the first torn or corrupt one and keeps, per name, the
highest sequence whose end offset the recovered log reaches (a record whose messages did not
survive, say a power loss between the fsyncs, is ignored). The store takes the higher of that
and the sequence in its offsets file. A record lost with its messages is harmless; the one
window left is a kill between the append and this write (two consecutive system calls): those
messages were never confirmed, and a resend stores them again.

The file is rewritten with one record per name (``atomic_write``, reported as a ``replace``)
once it holds ``COMPACT_MIN`` records and four times as many as there are names.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Final

from broker.errors import StoreError
from broker.store.compaction import out_of_space, rewrite
from broker.store.fileio import append_whole
from broker.store.segment_log import SegmentFiles, is_no_space
from broker.store.sink import ReplicationSink

NAME: Final = "sequences"
VERSION: Final = 1
_HEADER: Final = struct.Struct("<I")
_LEN: Final = struct.Struct("<H")
_TAIL: Final = struct.Struct("<QQ")  # sequence, end offset
_CRC: Final = struct.Struct("<I")
COMPACT_MIN: Final = 1024  # records before a rewrite is considered


def encode(name: str, sequence: int, end_offset: int) -> bytes:
    raw = name.encode()
    body = _LEN.pack(len(raw)) + raw + _TAIL.pack(sequence, end_offset)
    return body + _CRC.pack(zlib.crc32(body))


def decode(data: bytes) -> tuple[list[tuple[str, int, int]], int]:
    """The whole records of a file's content as (name, sequence, end offset), and where they
    end (a torn or corrupt tail is where reading stops)."""
    if len(data) < _HEADER.size:
        return [], 0
    (version,) = _HEADER.unpack_from(data, 0)
    if version != VERSION:
        raise StoreError(f"unsupported publisher sequence format version {version}")
    out: list[tuple[str, int, int]] = []
    pos = _HEADER.size
    while pos + _LEN.size <= len(data):
        n = _LEN.unpack_from(data, pos)[0]
        end = pos + _LEN.size + n + _TAIL.size
        if end + _CRC.size > len(data) or _CRC.unpack_from(data, end)[0] != zlib.crc32(data[pos:end]):
            break
        seq, end_offset = _TAIL.unpack_from(data, end - _TAIL.size)
        out.append((data[pos + _LEN.size:end - _TAIL.size].decode(errors="replace"), seq, end_offset))
        pos = end + _CRC.size
    return out, pos


class SequenceLog:
    """The ``sequences`` file of one stream store; every method runs on the owner thread."""

    __slots__ = ("path", "_sink", "_files", "_exists", "_records", "_latest")

    def __init__(self, directory: Path, sink: ReplicationSink, files: SegmentFiles) -> None:
        self.path = directory / NAME
        self._sink = sink
        self._files = files
        self._exists = False  # the file has its header
        self._records = 0
        self._latest: dict[str, tuple[int, int]] = {}  # name -> (sequence, end offset)

    def load(self, next_offset: int) -> dict[str, int]:
        """The sequences the recovered log (``next_offset``) covers; a torn tail is cut off."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            records, end = decode(data)
        except StoreError as exc:
            raise StoreError(f"{self.path}: {exc}") from exc
        self._exists = end >= _HEADER.size
        if end != len(data):
            os.truncate(self.path, end)
            if self._sink.active:
                self._sink.replace(self.path, data[:end])
        self._records = len(records)
        out: dict[str, int] = {}
        for name, seq, end_offset in records:
            if end_offset <= next_offset and seq >= out.get(name, seq):
                out[name] = seq
                self._latest[name] = (seq, end_offset)
        return out

    def append(self, name: str, sequence: int, end_offset: int) -> bool:
        """Write one record now; False if the disk is full (the sequence then lives in the
        offsets file only, as before this file existed)."""
        self._latest[name] = (sequence, end_offset)
        record = encode(name, sequence, end_offset)
        if self._records and self._records >= COMPACT_MIN and self._records > 4 * len(self._latest):
            return self._compact()
        created = not self._exists
        data = _HEADER.pack(VERSION) + record if created else record
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            if not is_no_space(exc):
                raise
            self._files.no_space(self.path, exc)
            return False
        try:
            if not append_whole(fd, data):
                out_of_space(self._files, self.path)
                return False
        finally:
            os.close(fd)
        self._exists = True
        self._records += 1
        if self._sink.active:
            if created:
                self._sink.register_file(self.path)
            self._sink.append(self.path, data)
        return True

    def _compact(self) -> bool:
        data = _HEADER.pack(VERSION) + b"".join(encode(n, s, e) for n, (s, e) in self._latest.items())
        if not rewrite(self.path, data, self._files):
            return False
        self._exists = True
        self._records = len(self._latest)
        if self._sink.active:
            self._sink.replace(self.path, data)
        return True
