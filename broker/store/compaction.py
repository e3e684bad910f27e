"""The rewrite that compacts an append-only side file (a stream's publisher sequences, a
queue's delivery counts).

Durability rule: such a file is only ever appended to, except that once it holds mostly dead
records it is replaced whole by its live ones (``fileio.atomic_write``: temp file, fsync,
rename, fsync of the directory), so a crash leaves the old file or the new one, never a mix.
Compaction is an optimisation, never a reason to fail the write that triggered it: on a full
disk the temp file is gone again, the old file and its appended records stay the truth, the
store's disk-full state is raised (logged once per episode) and the caller tries again at its
next record. Any other error is a real failure and propagates.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from broker.errors import DiskFull
from broker.store.fileio import atomic_write
from broker.store.segment_log import SegmentFiles


def out_of_space(files: SegmentFiles, path: Path) -> None:
    """Raise the store's disk-full state for a write to ``path`` that found no space."""
    files.no_space(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))


def rewrite(path: Path, data: bytes, files: SegmentFiles) -> bool:
    """Atomically replace ``path`` with ``data``; False, with nothing changed on disk, if the
    disk is full."""
    try:
        atomic_write(path, data)
    except DiskFull:
        out_of_space(files, path)
        return False
    return True
