"""The definitions log (``definitions.amqp``): durable exchanges, queues and bindings.

Theory of operation: the broker appends one opaque record per durable declare/bind/delete
(it stores the encoded AMQP method frame); on boot it replays ``load()`` in order. Deletes
leave dead records behind, so after many of them the broker calls ``compact(current)``,
which writes the live records to a temp file, fsyncs and renames it over the log.

Format: a 4-byte little-endian format version (1), then records framed as
``u32 length | bytes``. A crash can tear only the last record (appends are sequential);
``load()`` stops at it and trims it, so later appends continue after the last good record.
Each append is one ``write`` (low rate: declarations, not messages); ``sync()`` makes them
durable and the broker acknowledges a durable declaration only after it.
"""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path
from typing import Final

from broker.errors import DiskFull, StoreError, no_space
from broker.store.fileio import append_whole, atomic_write, fsync_dir
from broker.store.sink import NULL_SINK, ReplicationSink

VERSION: Final = 1
_HEADER: Final = struct.pack("<I", VERSION)
_U32: Final = struct.Struct("<I")


class DefinitionsLog:
    def __init__(self, path: Path, sink: ReplicationSink = NULL_SINK) -> None:
        self.path = path
        self._sink = sink
        self._fd: int | None = None
        self._dirty = False
        self.appended_since_compact = 0

    def load(self) -> list[bytes]:
        """Every complete record in order; a torn last record is dropped (and trimmed)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        records, good_end = _parse(self.path, data)
        if good_end < len(data):
            self._trim(data[:good_end])
        return records

    def append(self, record: bytes) -> None:
        """Append one record, or none of it: on a full disk (DiskFull) a partly written
        record is cut off again, so the log stays a sequence of whole records."""
        fd = self._open()
        framed = _U32.pack(len(record)) + record
        if not append_whole(fd, framed):
            raise DiskFull(f"disk full: cannot append to {self.path.name}")
        self._dirty = True
        self.appended_since_compact += 1
        if self._sink.active:
            self._sink.append(self.path, framed)

    def size(self) -> int:
        """Where the next record goes: a mark for ``cut``."""
        return os.fstat(self._open()).st_size

    def cut(self, size: int) -> None:
        """Drop every record appended after ``size`` (a mark from ``size()``): how a change of
        many records that failed half-way is taken back. Truncating needs no disk space."""
        self.sync()
        fd = self._open()
        if os.fstat(fd).st_size <= size:
            return
        os.ftruncate(fd, size)
        os.fsync(fd)
        if self._sink.active:
            self._sink.replace(self.path, self.path.read_bytes())

    def compact(self, records: list[bytes]) -> None:
        """Replace the log with exactly ``records`` (crash-safe: tmp + fsync + rename)."""
        parts = [_HEADER]
        for record in records:
            parts.append(_U32.pack(len(record)))
            parts.append(record)
        data = b"".join(parts)
        self._close_fd()
        atomic_write(self.path, data)
        self.appended_since_compact = 0
        self._dirty = False
        if self._sink.active:
            self._sink.replace(self.path, data)

    def sync(self, full: bool = False, fsync: bool = True) -> None:
        if self._fd is not None and self._dirty:
            self._dirty = False
            if fsync:  # else the caller's syncfs covers it
                os.fsync(self._fd)

    def close(self) -> None:
        self.sync()
        self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _open(self) -> int:
        if self._fd is not None:
            return self._fd
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        good_end = _parse(self.path, data)[1] if data else 0
        if good_end == 0:
            # New log (an empty or header-less file counts as new: a crash right after
            # create). The header goes in with the creation, so a reader never sees a
            # non-empty file without one.
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            try:
                if os.write(fd, _HEADER) != len(_HEADER):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(fd)
            except OSError as exc:
                os.close(fd)
                self.path.unlink(missing_ok=True)  # no file is a new log; a torn header is not
                if no_space(exc):
                    raise DiskFull(f"disk full: cannot create {self.path.name}") from None
                raise
            fsync_dir(self.path.parent)
            if self._sink.active:
                self._sink.register_file(self.path)
                self._sink.append(self.path, _HEADER)
        else:
            # Never append after a torn tail: the new record would be unreachable.
            if good_end < len(data):
                self._trim(data[:good_end])
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._fd = fd
        return fd

    def _trim(self, good: bytes) -> None:
        with open(self.path, "r+b") as f:
            f.truncate(len(good))
            os.fsync(f.fileno())
        if self._sink.active:
            self._sink.replace(self.path, good)


def _parse(path: Path, data: bytes) -> tuple[list[bytes], int]:
    """(records, end of the last complete record)."""
    if len(data) < 4:
        # A crash while writing the header of a brand-new log: nothing in it yet.
        if data.strip(b"\0"):
            raise StoreError(f"{path}: truncated header")
        return [], 0
    (version,) = _U32.unpack_from(data, 0)
    if version != VERSION:
        raise StoreError(f"{path}: unsupported definitions format version {version} (expected {VERSION})")
    records: list[bytes] = []
    pos = 4
    size = len(data)
    while pos + 4 <= size:
        (length,) = _U32.unpack_from(data, pos)
        end = pos + 4 + length
        if end > size:
            break
        records.append(data[pos + 4:end])
        pos = end
    return records, pos


def read_records(path: Path) -> list[bytes]:
    """Every complete record of the log at ``path``, read only (a torn last record is left
    where it is, for the broker to trim on its next start): for offline tools."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return _parse(path, data)[0]
