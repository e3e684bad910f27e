"""Queue deletes and recovered queues cost the event loop no file removal or creation (issue 31:
1,000 queue deletes stalled every connection for 105-272 ms, an ``rmtree`` and the trims of the
retired segments on the loop; a queue recovered after a restart made its next segment on its first
message). A delete renames the directory to a tombstone on the loop (one metadata operation) and
the segment worker removes the tombstone; a recovered durable queue's next segment is made ahead
on the worker. Real files, no sockets; the file calls are counted by thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _file_calls import count_file_calls, worker_idle

from broker.store import segment_log
from broker.store.paths import TOMBSTONE_SUFFIX
from broker.store.priority_store import PriorityStore
from broker.store.queue_store import QueueStore

PROPS = b"\x10\x00\x02"  # delivery-mode 2
BODY = b"m" * 300
QUEUES = 100
ROOT = Path(__file__).resolve().parents[1]
_REMOVES = ("unlink", "rmdir", "ftruncate", "truncate", "posix_fallocate", "rmtree", "open(O_CREAT)")


def _used_queues(root: Path, n: int) -> list[QueueStore]:
    """``n`` durable queues that each took messages, had some acked and are synced: a write
    segment, a retired segment waiting for its trim, an ack file and a meta each."""
    stores = []
    for i in range(n):
        s = QueueStore(root / f"q{i}", segment_size=64 * 1024, persistent_only=True)
        for _ in range(250):  # past the first segment: a roll, a retired segment
            s.append(1, b"", b"q", PROPS, BODY)
        for _ in range(3):
            msgid = s.shift()
            assert msgid is not None
            s.ack(msgid)
        stores.append(s)
    return stores


def test_deleting_durable_queues_removes_no_file_on_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stores = _used_queues(tmp_path, QUEUES)
    for s in stores[::2]:
        s.sync()  # half synced (nothing retired waits), half not (a trim would be due)
    worker_idle()
    calls = count_file_calls(monkeypatch, removals=True)
    for s in stores:
        s.delete()
    on_loop = [name for mine, name in calls if mine]
    removing = [name for name in on_loop if name in _REMOVES]
    assert not removing, f"{len(removing)} file calls on the loop thread: {sorted(set(removing))}"
    assert on_loop.count("rename") <= QUEUES, on_loop.count("rename")
    worker_idle()
    assert list(tmp_path.iterdir()) == [], "a tombstone or a queue directory was left behind"


def test_a_queue_declared_again_keeps_its_files_when_the_old_jobs_run_late(tmp_path: Path) -> None:
    """The old queue's removals are still queued on the (busy) worker when it is deleted and the
    same name is declared again, takes a message in the same segment number and syncs it: the
    delete does not wait for the worker, and the old jobs, when they run, touch none of the new
    queue's files."""
    d = tmp_path / "q"
    gate = threading.Event()
    s = QueueStore(d, segment_size=64 * 1024, persistent_only=True)
    worker_idle()
    segment_log._spare_worker().submit(gate.wait, 10)
    try:
        for _ in range(250):
            s.append(1, b"", b"q", PROPS, BODY)  # rolls past msgs.1 (its spare job queued)
        while (msgid := s.shift()) is not None:
            s.ack(msgid)
        s.sync()
        for _ in range(250):
            s.append(1, b"", b"q", PROPS, BODY)  # rolls again: acked msgs.1 queued for removal
        started = time.monotonic()
        s.delete()
        waited = time.monotonic() - started
        again = QueueStore(d, segment_size=64 * 1024, persistent_only=True)
        for i in range(250):  # the new queue's msgs.1 and msgs.2, created on the loop
            again.append(1, b"", b"q", PROPS, b"new %d" % i)
        again.sync()
    finally:
        gate.set()
    assert waited < 2, f"the delete waited {waited:.1f} s for the worker"
    worker_idle()
    again.close()
    kept = QueueStore(d, segment_size=64 * 1024, persistent_only=True)
    got = []
    while (msgid := kept.shift()) is not None:
        got.append(kept.read(msgid)[4])
    assert got == [b"new %d" % i for i in range(250)]
    kept.close()
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


def test_a_priority_queue_goes_in_one_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = QueueStore(tmp_path / "p", persistent_only=True)
    ps = PriorityStore(base, 5)
    for level in (0, 3, 5):
        ps._open(level).append(1, b"", b"q", PROPS, BODY)
    ps.sync()
    worker_idle()
    calls = count_file_calls(monkeypatch, removals=True)
    ps.delete()
    on_loop = [name for mine, name in calls if mine]
    assert on_loop == ["rename"], on_loop
    worker_idle()
    assert list(tmp_path.iterdir()) == []


_CRASHER = """
import sys, threading
from broker.store import segment_log
from broker.store.queue_store import QueueStore
d = sys.argv[1]
s = QueueStore(d, persistent_only=True)
s.append(1, b"", b"q", b"\\x10\\x00\\x02", b"old")
s.sync()
segment_log._spare_worker().submit(lambda: None).result(30)
segment_log._spare_worker().submit(threading.Event().wait, 60)  # the tombstone stays
s.delete()
again = QueueStore(d, persistent_only=True)
again.append(1, b"", b"q", b"\\x10\\x00\\x02", b"new")
again.sync()  # what a confirm waits for
print("confirmed", flush=True)
threading.Event().wait(60)
"""


def test_delete_declare_again_confirm_kill_9(tmp_path: Path) -> None:
    """kill -9 with the old queue's tombstone not removed yet: after the restart the confirmed
    message of the queue declared again is there (and only it), and the boot's sweep removes the
    tombstone and nothing else."""
    d = tmp_path / "q"
    proc = subprocess.Popen([sys.executable, "-c", _CRASHER, str(d)], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == b"confirmed\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    tombs = [p.name for p in tmp_path.iterdir() if p.name.endswith(TOMBSTONE_SUFFIX)]
    assert len(tombs) == 1, sorted(p.name for p in tmp_path.iterdir())
    segment_log.remove_tombstones_later(tmp_path)
    worker_idle()
    assert [p.name for p in tmp_path.iterdir()] == ["q"]
    s = QueueStore(d, persistent_only=True)
    got = s.shift()
    assert got is not None and s.read(got)[4] == b"new" and s.shift() is None
    s.close()


def test_recovered_queues_make_their_next_segment_off_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue reopened after a restart (clean or not) appends to a fresh segment: it is made
    ahead on the worker, as a new queue's first one; one made ahead and left unused by a clean
    shutdown is taken as it is, not removed and made again."""
    stores = [QueueStore(tmp_path / f"q{i}", persistent_only=True) for i in range(QUEUES)]
    for s in stores:
        s.append(1, b"", b"q", PROPS, b"before")
        s.sync()
        s.close()
    stores = [QueueStore(tmp_path / f"q{i}", persistent_only=True) for i in range(QUEUES)]
    worker_idle()
    calls = count_file_calls(monkeypatch, removals=True)
    for s in stores:
        s.append(1, b"", b"q", PROPS, b"after")
    on_loop = [name for mine, name in calls if mine]
    assert not on_loop, f"{len(on_loop)} file calls on the loop thread: {sorted(set(on_loop))}"
    for s in stores:
        s.sync()
        s.close()
    files = segment_log.SegmentFiles()
    for s in (QueueStore(tmp_path / f"i{i}", persistent_only=True, files=files) for i in range(3)):
        worker_idle()  # made ahead at the declare, never used, left by a clean shutdown
        files.shutting_down = True
        s.close()
    for i in range(3):
        calls.clear()
        s = QueueStore(tmp_path / f"i{i}", persistent_only=True)
        worker_idle()
        assert not calls, calls  # neither removed at the recovery nor made again
        assert s._first == segment_log._FIRST_READY
        assert [p.name for p in (tmp_path / f"i{i}").iterdir() if p.name.startswith("msgs.")] \
            == ["msgs.0000000001"]
        s.close()
    for i in range(QUEUES):
        s = QueueStore(tmp_path / f"q{i}", persistent_only=True)
        got = []
        while (msgid := s.shift()) is not None:
            got.append(s.read(msgid)[4])
        assert got == [b"before", b"after"], (i, got)
        s.close()


def test_closing_a_recovered_queue_while_its_next_segment_is_queued(tmp_path: Path) -> None:
    """A recovered queue's next-segment job is queued behind a busy worker; the queue's recovered
    segments are all acked (their removals queued behind that job) and it closes: the close must
    not hold the store's lock while it waits for the removals, which the job needs first."""
    s = QueueStore(tmp_path / "q", segment_size=64 * 1024, persistent_only=True)
    for _ in range(400):
        s.append(1, b"", b"q", PROPS, BODY)
    s.sync()
    s.close()
    gate = threading.Event()
    segment_log._spare_worker().submit(gate.wait, 30)
    try:
        again = QueueStore(tmp_path / "q", segment_size=64 * 1024, persistent_only=True)
        while (msgid := again.shift()) is not None:
            again.ack(msgid)
        again.sync()
        closing = threading.Thread(target=again.close, daemon=True)
        closing.start()
        closing.join(0.3)
    finally:
        gate.set()
    closing.join(20)
    assert not closing.is_alive(), "the close and the worker wait for each other"


def test_deleting_a_vhost_removes_no_file_on_the_loop_and_a_vhost_made_again_keeps_its_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's vhost delete (``Mgmt.delete_vhost``) renames the vhost's directory to a
    tombstone and the worker removes it (before: an ``rmtree`` on the loop of the whole vhost,
    its queues' tombstones too); a vhost of the same name created at once keeps its own files."""
    from types import SimpleNamespace

    from broker.auth.parameters import GlobalParameters
    from broker.auth.vhosts import VHostStore
    from broker.http.state import Mgmt
    from broker.model.vhost import VHost
    from broker.store.sink import NullSink

    data = tmp_path / "data"
    data.mkdir()

    def make(name: str) -> VHost:
        return VHost(name, data, segment_size=64 * 1024, sink=NullSink(), schedule=lambda cb: cb(),
                     mark_dirty=lambda _obj: None, transient_root=tmp_path / "transient")

    vh = make("v")
    for i in range(10):
        q, _ = vh.declare_queue(f"q{i}", durable=True, owner=None)
        for _ in range(50):
            q.store.append(1, b"", b"q", PROPS, BODY)
    vh.declare_exchange("dx", "x-delayed-message", durable=True, arguments={"x-delayed-type": "direct"})
    broker = SimpleNamespace(vhosts={"v": vh}, connections=[],
                             syncer=SimpleNamespace(discard=lambda _s: None),
                             users=SimpleNamespace(clear_vhost=lambda _n: None))
    names = VHostStore(data / "vhosts.json", NullSink())
    names.add("v")
    mgmt = Mgmt(broker, names, make, data, tmp_path / "transient",  # type: ignore[arg-type]
                GlobalParameters(data / "parameters.json", NullSink()))
    worker_idle()
    calls = count_file_calls(monkeypatch, removals=True)
    mgmt.delete_vhost("v")
    removed = sorted({c for mine, c in calls if mine} & {"unlink", "rmdir", "rmtree", "ftruncate"})
    assert not removed, f"the vhost delete removed files on the loop: {removed}"
    again = mgmt.create_vhost("v")  # at once: the old files' removal may not have run yet
    q, _ = again.declare_queue("q0", durable=True, owner=None)
    q.store.append(1, b"", b"q", PROPS, b"new")
    q.store.sync()
    worker_idle()
    monkeypatch.undo()
    again.close()
    back = make("v")
    assert set(back.queues) == {"q0"} and back.queues["q0"].message_count == 1
    worker_idle()
    assert not [p.name for p in data.iterdir() if p.name.endswith(TOMBSTONE_SUFFIX)]
    back.close()
