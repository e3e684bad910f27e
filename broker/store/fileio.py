"""Small durable-file helpers shared by the store modules.

``atomic_write`` is the classic crash-safe replace: write a sibling temp file, fsync it,
rename it over the target, then fsync the directory so the rename itself is durable. A
reader therefore sees either the old or the new content, never a mix, even after power loss.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
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


# ------------------------------------------------------------------ prefaulting a mapping
MADV_POPULATE_WRITE: Final = 23  # Linux 5.14: fault pages in writable, contents unchanged


def _load_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    madvise: Callable[[int, int, int], int] = fn
    return madvise


_MADVISE = _load_madvise()
_populate_works = _MADVISE is not None


def map_address(mm: mmap.mmap) -> int:
    """The address of a writable mapping (for ``populate``; no buffer export is kept)."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def populate(address: int, length: int) -> bool:
    """Fault ``length`` bytes of a shared file mapping in, writable, without changing them
    (MADV_POPULATE_WRITE), with the GIL released: what a first write into each page would
    cost (on ext4, several microseconds per page of an allocated, never written extent) is
    paid here instead. ``address`` must be page aligned and the range allocated on disk (a
    hole on a full disk fails here, with EFAULT, instead of a SIGBUS). False, and no more
    attempts, where the kernel lacks it."""
    global _populate_works
    if not _populate_works or _MADVISE is None:
        return False
    if _MADVISE(address, length, MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:  # an older kernel
        _populate_works = False
    return False
