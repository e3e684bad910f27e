"""A directory of small files, each replaced whole, made durable by the group commit.

Durability rule: ``put`` writes a sibling temp file and renames it over the name on the event
loop (page cache only, no fsync: microseconds), tells the replication sink at once (so the
cluster's barrier of the next group commit covers it), and marks the directory dirty. The
group commit (``syncer.Syncer``) then calls ``sync`` in its worker thread, which fsyncs every
file written since and the directory, before any acknowledgement that waits for it goes out.
A reader sees the old or the new content, never a mix: rename is atomic, and ext4 writes a
renamed-over file's data before the rename commits (``auto_da_alloc``), so a crash before the
fsync leaves the old version. Names are the caller's (``[0-9a-f]`` digests here), never paths.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from broker.store.fileio import fsync_dir
from broker.store.sink import NULL_SINK, ReplicationSink


class BlobDir:
    def __init__(self, directory: Path, mark_dirty: Callable[[BlobDir], None],
                 sink: ReplicationSink = NULL_SINK) -> None:
        self.directory = directory
        self.mark_dirty = mark_dirty
        self.sink = sink
        self._lock = threading.Lock()  # ``_written`` is filled on the loop, drained by the syncer
        self._written: set[str] = set()
        self._removed = False

    def put(self, name: str, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / name
        tmp = path.with_name(name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        if self.sink.active:
            self.sink.replace(path, data)
        with self._lock:
            self._written.add(name)
        self.mark_dirty(self)

    def delete(self, name: str) -> None:
        path = self.directory / name
        path.unlink(missing_ok=True)
        if self.sink.active:
            self.sink.delete(path)
        with self._lock:
            self._written.discard(name)
            self._removed = True
        self.mark_dirty(self)

    def items(self) -> Iterator[tuple[str, bytes]]:
        """Every file's name and content (temp files of an interrupted ``put`` are skipped)."""
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.iterdir()):
            if path.is_file() and not path.name.endswith(".tmp"):
                yield path.name, path.read_bytes()

    def sync(self, full: bool = False, fsync: bool = True) -> None:
        """The syncer's worker thread: fsync what was written since the last call."""
        with self._lock:
            names, self._written = self._written, set()
            removed, self._removed = self._removed, False
        if not fsync or not (names or removed):
            return  # a bulk sync (syncfs) covers the files
        for name in names:
            try:
                fd = os.open(self.directory / name, os.O_RDONLY)
            except FileNotFoundError:
                continue  # deleted since
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(self.directory)

    def __repr__(self) -> str:
        return f"BlobDir({self.directory})"
