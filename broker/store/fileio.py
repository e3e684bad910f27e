"""Small durable-file helpers shared by the store modules.

``atomic_write`` is the classic crash-safe replace: write a sibling temp file, fsync it,
rename it over the target, then fsync the directory so the rename itself is durable. A
reader therefore sees either the old or the new content, never a mix, even after power loss.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from broker.errors import DiskFull, no_space


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``, or (DiskFull, OSError) leave it as it was: the temp
    file is removed again, so a full disk costs the write, never the old content."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if no_space(exc):
            raise DiskFull(f"disk full: cannot write {path.name}") from None
        raise
    fsync_dir(path.parent)


def append_whole(fd: int, data: bytes | bytearray) -> bool:
    """Append all of ``data`` to an O_APPEND file, or nothing: False if the disk is full
    (a partial write is cut off again, so the file keeps only whole entries)."""
    view = memoryview(data)
    done = 0
    try:
        while done < len(view):
            done += os.write(fd, view[done:])
    except OSError as exc:
        if not no_space(exc):
            raise
        if done:
            os.ftruncate(fd, os.fstat(fd).st_size - done)
        return False
    return True


def syncfs(directory: Path) -> None:
    """Flush every dirty page and inode of the filesystem holding ``directory`` (syncfs(2);
    sync(2) where the C library lacks it): one call instead of an fsync per file."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _SYNCFS is None:  # pragma: no cover - not Linux
            os.sync()
        elif _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(directory))
    finally:
        os.close(fd)


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        fn: Callable[[int], int] = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    return fn


_SYNCFS: Final = _load_syncfs()


def datasync(fd: int) -> None:
    """fdatasync where the platform has it (skips the mtime-only metadata flush)."""
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover - macOS
        os.fsync(fd)
