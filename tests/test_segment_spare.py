"""The next segment is prepared off the event loop (issue 13: roll-over blocked every
connection for 0.1-20 ms): once the write segment is half allocated a worker thread creates
``next-segment.tmp``, and the roll renames it instead of creating a file. Real files, no sockets."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from broker.store import segment_log
from broker.store.queue_store import QueueStore
from broker.store.segment import segment_name

PROPS = b"\x10\x00\x02"  # delivery-mode 2
SEGMENT = 256 * 1024


def _wait_for(path: Path, deadline: float = 30.0) -> int:
    """The inode of ``path`` once the worker created it (polled, bounded)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            return os.stat(path).st_ino
        except FileNotFoundError:
            time.sleep(0.01)
    raise AssertionError(f"{path.name} was never prepared")


def _fill(s: QueueStore, until: int, body: bytes) -> int:
    n = 0
    while s._next_num <= until:  # appends until segment number ``until`` is the write segment
        s.append(1, b"", b"q", PROPS, body)
        n += 1
    return n


def test_a_roll_takes_the_segment_prepared_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[str] = []
    orig = segment_log.create_mapped

    def counting(path: Path, *args: object) -> object:
        created.append(path.name)
        return orig(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(segment_log, "create_mapped", counting)
    # The path where the first append creates the first segment: without this, whether the
    # segment worker made it ahead (a small one, test_segment_first.py) is a race.
    monkeypatch.setattr(QueueStore, "_prepare_first", lambda self: None)
    s = QueueStore(tmp_path / "q", segment_size=SEGMENT, persistent_only=True)
    body = b"b" * 1000
    n = _fill(s, 1, body)  # the first segment is created on the spot
    while s._walloc * 2 < s._wlimit:
        s.append(1, b"", b"q", PROPS, body)
        n += 1
    spare = tmp_path / "q" / segment_log.SPARE_NAME
    ino = _wait_for(spare)
    n += _fill(s, 2, body)
    assert os.stat(tmp_path / "q" / segment_name(2)).st_ino == ino
    # only the first segment and the spare were created; the loop's roll just renamed it
    assert created == [segment_name(1), segment_log.SPARE_NAME]
    s.close()
    assert not spare.exists()  # closing drops a spare prepared meanwhile
    s = QueueStore(tmp_path / "q", segment_size=SEGMENT, persistent_only=True)
    got = 0
    while s.next_delivery(True) is not None:
        got += 1
    assert got == n
    s.close()
    assert not spare.exists()


def test_a_spare_left_by_a_crash_is_ignored_and_replaced(tmp_path: Path) -> None:
    d = tmp_path / "q"
    d.mkdir()
    (d / segment_log.SPARE_NAME).write_bytes(b"\x00" * 4096)  # as a crash would leave one
    s = QueueStore(d, segment_size=SEGMENT, persistent_only=True)
    assert s.ready_count == 0
    n = 0
    while s._next_num <= 3:
        s.append(1, b"", b"q", PROPS, b"%08d" % n + b"x" * 992)
        n += 1
        if s._spare is not None:
            s._spare.result(timeout=30)  # deterministic: the spare is ready before the roll
    s.close()
    s = QueueStore(d, segment_size=SEGMENT, persistent_only=True)
    bodies = []
    while (m := s.next_delivery(True)) is not None:
        bodies.append(m[3][:8])
    assert bodies == [b"%08d" % i for i in range(n)]
    s.close()
