"""A growing write segment allocates its next chunk off the event loop (issue 31: a
``posix_fallocate`` on the loop waited 3-16 ms behind the group commit's fdatasync, in the
manual-ack cells). Real files, no sockets; the allocation calls are counted by thread."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from broker.store import segment_log
from broker.store.queue_store import QueueStore

PROPS = b"\x10\x00\x02"  # delivery-mode 2
SEGMENT = 8 * 1024 * 1024
LOOP_ALLOCATES_UP_TO = 512 * 1024  # the first chunks only: small queues stay small on disk
BODY = b"a" * 2000


def _count_fallocates(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int]]:
    """(on the calling thread, start) of every real ``posix_fallocate``."""
    calls: list[tuple[bool, int]] = []
    real = os.posix_fallocate
    me = threading.current_thread()

    def counting(fd: int, offset: int, length: int) -> None:
        calls.append((threading.current_thread() is me, offset))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", counting)
    return calls


def _append_settled(s: QueueStore, n: int) -> list[int]:
    """``n`` appends, each after the chunk allocated ahead (if any) is done: the worker keeps up."""
    ids = []
    for _ in range(n):
        ahead = getattr(s, "_ahead", None)
        if ahead is not None:
            ahead[3].exception(30)  # done, whether it failed or not
        ids.append(s.append(1, b"", b"q", PROPS, BODY))
    return ids


def test_growth_allocates_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_fallocates(monkeypatch)
    s = QueueStore(tmp_path / "q", segment_size=SEGMENT, persistent_only=True)
    ids = _append_settled(s, 2000)  # about 4 MiB: chunks of 16 KiB doubling to 1 MiB
    on_loop = [start for mine, start in calls if mine]
    assert s._walloc > 4 * LOOP_ALLOCATES_UP_TO
    # the small first chunks on the loop, nothing after them
    assert on_loop and max(on_loop) < LOOP_ALLOCATES_UP_TO, on_loop
    assert any(not mine for mine, _ in calls)
    s.close()
    again = QueueStore(tmp_path / "q", segment_size=SEGMENT, persistent_only=True)
    assert again.ready_count == len(ids)
    first = again.shift()
    assert first is not None and again.read(first)[4] == BODY
    again.close()


def test_a_failed_chunk_ahead_is_allocated_on_the_loop(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's allocation failing (a full disk) is not fatal: the loop allocates itself,
    which is where a real full disk raises DiskFull before anything is written."""

    def full(fd: int, start: int, end: int) -> None:
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_log, "_allocate_ahead", full)
    calls = _count_fallocates(monkeypatch)
    s = QueueStore(tmp_path / "q", segment_size=SEGMENT, persistent_only=True)
    ids = _append_settled(s, 1000)
    assert max(start for mine, start in calls if mine) >= LOOP_ALLOCATES_UP_TO
    assert s.ready_count == len(ids)
    s.close()



# ---------------------------------------------------------------- removal of acked segments

SMALL = 64 * 1024  # a segment every ~30 records of BODY


def _count_unlinks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, str]]:
    """(on the calling thread, file name) of every real ``os.unlink``."""
    calls: list[tuple[bool, str]] = []
    real = os.unlink
    me = threading.current_thread()

    def counting(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
        calls.append((threading.current_thread() is me, os.path.basename(os.fspath(path))))
        real(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", counting)
    return calls


def _fill_and_ack(s: QueueStore, n: int) -> None:
    for _ in range(n):
        s.append(1, b"", b"q", PROPS, BODY)
    s.sync()
    while (msgid := s.shift()) is not None:
        s.ack(msgid)
    s.sync()  # the acks written: the segments' ack files exist before they go


def _log_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(("msgs.", "acks.")))


def test_acked_segments_are_removed_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fully acked segments and their ack files are unlinked on the segment worker (an unlink
    on the loop waited up to 31 ms for the journal behind the group commit's fdatasync);
    ``removed()`` waits for them, and a restart finds only the write segment."""
    calls = _count_unlinks(monkeypatch)
    s = QueueStore(tmp_path / "q", segment_size=SMALL, persistent_only=True)
    for _ in range(3):
        s.append(1, b"", b"q", PROPS, BODY)
        while (msgid := s.shift()) is not None:
            s.ack(msgid)
        s.sync()
    _fill_and_ack(s, 200)
    s.removed()
    on_loop = [name for mine, name in calls if mine and name.startswith(("msgs.", "acks."))]
    assert not on_loop, on_loop
    gone = [name for mine, name in calls if not mine and name.startswith("msgs.")]
    assert len(gone) >= 5, calls
    assert len({name[5:] for name in _log_files(tmp_path / "q")}) == 1  # the write segment's
    s.close()
    again = QueueStore(tmp_path / "q", segment_size=SMALL, persistent_only=True)
    assert again.ready_count == 0
    again.close()


def test_close_and_delete_wait_for_pending_removals(tmp_path: Path) -> None:
    """A clean close leaves no acked segment behind, and a queue deleted and declared again
    under the same directory keeps its new segments (a late removal of the old queue's
    ``msgs.0000000001`` would take the new one's)."""
    s = QueueStore(tmp_path / "q", segment_size=SMALL, persistent_only=True)
    _fill_and_ack(s, 200)
    s.close()
    assert len({name[5:] for name in _log_files(tmp_path / "q")}) == 1  # the last segment's
    s = QueueStore(tmp_path / "d", segment_size=SMALL, persistent_only=True)
    _fill_and_ack(s, 200)
    s.delete()
    new = QueueStore(tmp_path / "d", segment_size=SMALL, persistent_only=True)
    ids = [new.append(1, b"", b"q", PROPS, BODY) for _ in range(40)]
    new.sync()
    new.close()
    again = QueueStore(tmp_path / "d", segment_size=SMALL, persistent_only=True)
    assert again.ready_count == len(ids)
    again.close()
