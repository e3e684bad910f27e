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

