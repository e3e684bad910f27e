"""Exclusive lock on a data directory.

Two brokers writing the same segments would corrupt them, so a node takes an advisory
``flock(LOCK_EX | LOCK_NB)`` on ``<data_dir>/.lock`` at start and writes its pid there for
the error message of the next one. flock locks die with the process (kill -9 included), so
there are no stale locks to clean up; the file itself is left in place on release because
unlinking a lock file races with a process that has just opened it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from broker.errors import DataDirLocked


class DataDirLock:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / ".lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise DataDirLocked(
                f"data directory {self.data_dir} is in use by another process (pid {holder}); "
                f"stop it or choose another data directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text or "unknown"
