"""A new queue's first segment is made off the event loop (issue 31, cold queues: the first
message into each of 1,000 new queues created 1,000 segment files on the loop, an open, a
truncate and an allocation each, every one a journal transaction that waited behind the group
commit's fdatasync). Real files, no sockets; the file calls are counted by thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _file_calls import count_file_calls, worker_idle

from broker.store import segment_log
from broker.store.queue_store import QueueStore

PROPS = b"\x10\x00\x02"  # delivery-mode 2
BODY = b"m" * 300
QUEUES = 100
ROOT = Path(__file__).resolve().parents[1]


def test_first_message_into_new_queues_creates_no_file_on_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stores = [QueueStore(tmp_path / f"q{i}", persistent_only=True) for i in range(QUEUES)]
    worker_idle()  # the declares' first segments are ready (a client's round trips allow it)
    calls = count_file_calls(monkeypatch)
    ids = [s.append(1, b"", b"q", PROPS, BODY) for s in stores]
    on_loop = [name for mine, name in calls if mine]
    assert not on_loop, f"{len(on_loop)} file calls on the loop thread: {sorted(set(on_loop))}"
    for s in stores:
        s.sync()  # what a confirm waits for
        s.close()
    for i, msgid in enumerate(ids):
        again = QueueStore(tmp_path / f"q{i}", persistent_only=True)
        got = again.shift()
        assert got == msgid and again.read(got)[4] == BODY
        again.close()


def test_a_first_append_before_the_worker_creates_the_segment_itself(tmp_path: Path) -> None:
    """The worker busy elsewhere: the append does not wait for it, and the worker's job, when
    it runs, leaves nothing behind."""
    gate = threading.Event()
    segment_log._spare_worker().submit(gate.wait, 30)
    try:
        s = QueueStore(tmp_path / "q", persistent_only=True)
        msgid = s.append(1, b"", b"q", PROPS, BODY)
    finally:
        gate.set()
    worker_idle()
    assert sorted(p.name for p in (tmp_path / "q").iterdir() if p.name.startswith("msgs.")) \
        == ["msgs.0000000001"]
    s.append(1, b"", b"q", PROPS, BODY)
    s.sync()
    s.close()
    again = QueueStore(tmp_path / "q", persistent_only=True)
    assert again.ready_count == 2 and again.shift() == msgid
    again.close()


def test_a_large_first_record_and_a_delete_before_any(tmp_path: Path) -> None:
    """A first record larger than the made segment's allocation (or than a segment) is still
    stored; a queue deleted before its first message leaves no directory behind."""
    big = QueueStore(tmp_path / "big", segment_size=64 * 1024, persistent_only=True)
    small = QueueStore(tmp_path / "small", segment_size=64 * 1024, persistent_only=True)
    gone = QueueStore(tmp_path / "gone", persistent_only=True)
    worker_idle()
    bodies = [b"x" * 100_000, b"y" * 10_000]
    for s, body in zip((big, small), bodies, strict=True):
        s.append(1, b"", b"q", PROPS, body)
        s.sync()
        s.close()
    gone.delete()
    worker_idle()
    assert not (tmp_path / "gone").exists()
    for name, body in zip(("big", "small"), bodies, strict=True):
        again = QueueStore(tmp_path / name, segment_size=64 * 1024, persistent_only=True)
        got = again.shift()
        assert got is not None and again.read(got)[4] == body
        again.close()


_CRASHER = """
import os, sys
from broker.store.queue_store import QueueStore
root = sys.argv[1]
stores = []
for i in range(int(sys.argv[2])):
    s = QueueStore(os.path.join(root, "q%d" % i), persistent_only=True)
    stores.append(s)
    if i % 2:  # every other queue gets a message, synced as a confirm would
        s.append(1, b"", b"q", b"\\x10\\x00\\x02", b"kept %d" % i)
        s.sync()
        print(i, flush=True)
"""


@pytest.mark.parametrize("kill_after", [5, 40])
def test_kill_9_while_first_segments_are_made(tmp_path: Path, kill_after: int) -> None:
    """kill -9 while the worker makes first segments (some made, some half made, some
    adopted): every store recovers, every synced message is there, every store takes appends."""
    proc = subprocess.Popen([sys.executable, "-c", _CRASHER, str(tmp_path), "120"],
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    synced = []
    for _ in range(kill_after):
        line = proc.stdout.readline()
        if not line:
            break
        synced.append(int(line))
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    for d in sorted(tmp_path.iterdir()):
        s = QueueStore(d, persistent_only=True)
        i = int(d.name[1:])
        if i in synced:
            got = s.shift()
            assert got is not None and s.read(got)[4] == b"kept %d" % i
        s.append(1, b"", b"q", PROPS, BODY)
        s.sync()
        s.close()


def test_a_transient_store_makes_no_segment_ahead(tmp_path: Path) -> None:
    """A transient queue's messages to a waiting autoack consumer never reach the store (the
    direct hand-over), so no segment is made for it ahead: it would cost a creation and an
    unlink at its delete for nothing (measured: workload 7's cold cell, 1,000 unlinks on the loop)."""
    s = QueueStore(tmp_path / "t")
    worker_idle()
    assert list((tmp_path / "t").iterdir()) == []
    s.delete()


def test_a_queue_that_fills_its_small_first_segment_rolls_to_a_full_one(tmp_path: Path) -> None:
    s = QueueStore(tmp_path / "q", persistent_only=True)
    worker_idle()
    bodies = [bytes([i % 251]) * 1000 for i in range(200)]  # ~200 KiB: past the first segment
    for body in bodies:
        s.append(1, b"", b"q", PROPS, body)
    s.sync()
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "q").iterdir() if p.name.startswith("msgs.")}
    assert sizes["msgs.0000000001"] <= segment_log.FIRST_SIZE < sizes["msgs.0000000002"], sizes
    s.close()
    again = QueueStore(tmp_path / "q", persistent_only=True)
    got = []
    while (msgid := again.shift()) is not None:
        got.append(again.read(msgid)[4])
    assert got == bodies
    again.close()


def test_a_close_waiting_for_the_worker_behind_a_stale_first_segment_job(tmp_path: Path) -> None:
    """The job making a first segment is still queued when the store took another way, filled
    segments, had them acked (removal jobs queued behind it) and closes: the close waits for
    the removals under the store's lock, so the stale job must not need that lock."""
    gate = threading.Event()
    segment_log._spare_worker().submit(gate.wait, 30)
    try:
        s = QueueStore(tmp_path / "q", segment_size=64 * 1024, persistent_only=True)
        for _ in range(3):
            for _ in range(40):
                s.append(1, b"", b"q", PROPS, BODY * 7)
            while (msgid := s.shift()) is not None:
                s.ack(msgid)
            s.sync()
        closing = threading.Thread(target=s.close, daemon=True)
        closing.start()
        closing.join(0.3)  # the close now waits for the worker, holding the store's lock
    finally:
        gate.set()
    closing.join(30)
    assert not closing.is_alive(), "the close and the worker wait for each other"


def test_a_first_run_larger_than_the_segment_made_ahead(tmp_path: Path) -> None:
    """A run of records goes into one segment: one larger than the first segment made ahead
    extends it to the usual size."""
    s = QueueStore(tmp_path / "q", persistent_only=True)
    worker_idle()
    bodies = [bytes([i % 251]) * 500 for i in range(300)]  # ~160 KiB in one run
    s.append_run(1, b"\x00\x01q", [PROPS] * len(bodies), bodies, True)
    s.sync()
    assert (tmp_path / "q" / "msgs.0000000001").stat().st_size > segment_log.FIRST_SIZE
    s.close()
    again = QueueStore(tmp_path / "q", persistent_only=True)
    got = []
    while (msgid := again.shift()) is not None:
        got.append(again.read(msgid)[4])
    assert got == bodies
    again.close()
