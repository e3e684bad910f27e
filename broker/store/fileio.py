"""Small durable-file helpers shared by the store modules.

``atomic_write`` is the classic crash-safe replace: write a sibling temp file, fsync it,
rename it over the target, then fsync the directory so the rename itself is durable. A
reader therefore sees either the old or the new content, never a mix, even after power loss.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def datasync(fd: int) -> None:
    """fdatasync where the platform has it (skips the mtime-only metadata flush)."""
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover - macOS
        os.fsync(fd)
