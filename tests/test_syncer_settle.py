"""The window's full sync never delays a confirm (issue 31: the synchronous publisher's p99), no
sockets: a real event loop, a real ``Syncer`` and a real queue store on real files.

A full sync fsyncs what confirms need (the segment) and then the settlement files (acks,
delivered mark, delivery counts), a journal commit each. A confirm requested while those ran
waited for all of them and then for its own commit: on a busy disk one slow call every half
window. The settlement files now get their fsyncs on a thread of their own, after the commit's
waiters were answered, so a confirm waits only for the data it depends on. A real fsync of a
small file is too quick to hold still, so the settlement's fdatasync is made slow here through
the store's own seam (``segment_log.datasync_path``, as ``test_group_commit_faults.py`` does
for an error): it blocks until the test lets it go, which makes the order of events, not a
timing, the thing asserted. The ack must still reach the disk in the same window, and a
synchronous window (``ack_sync_interval = 0``) still answers only after it.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands
from test_syncer_window import _until

from broker import properties
from broker.store import segment_log
from broker.store.priority_store import PriorityStore
from broker.store.queue_store import QueueStore
from broker.store.segment import ack_name
from broker.syncer import Syncer

PERSISTENT = struct.pack(">HB", 0x1000, 2)
# A priority store's messages at level 3 live in a store of their own, in a subdirectory.
PRIORITY_3 = properties.encode(commands.Basic.Properties(delivery_mode=2, priority=3))
Store = QueueStore | PriorityStore
HOLD = 10.0  # seconds a held fdatasync waits at most for the test to let it go


class SlowAckFsync:
    """``datasync_path`` whose fdatasync of an ack file blocks until ``release`` (or HOLD)."""

    def __init__(self, fail: bool = False) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.done: list[Path] = []
        self.fail = fail
        self._real = segment_log.datasync_path

    def __call__(self, path: Path) -> None:
        if path.name == ack_name(1):
            self.started.set()
            self.release.wait(HOLD)
            if self.fail:
                self.fail = False
                raise OSError(5, "injected EIO")
        self._real(path)
        self.done.append(path)


async def _thread_event(ev: threading.Event, timeout: float = 5.0) -> None:
    assert await asyncio.to_thread(ev.wait, timeout), "timed out"


async def _confirm(s: Syncer, store: Store) -> asyncio.Future[bool]:
    store.append(0, b"", b"k", PRIORITY_3 if isinstance(store, PriorityStore) else PERSISTENT, b"m")
    s.mark_dirty(store)
    fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    s.after_sync(fut.set_result, [store])
    return fut


async def _ack_then_hold_full_sync(s: Syncer, store: Store, slow: SlowAckFsync) -> None:
    """A confirmed message, delivered and acked: the window's full sync starts and blocks in
    the ack file's fdatasync."""
    assert await asyncio.wait_for(await _confirm(s, store), 5)
    got = store.next_delivery(False)
    assert got is not None
    store.ack(got[0])
    s.mark_dirty(store)  # what a settlement does (the store's notify)
    await _thread_event(slow.started)


Body = Callable[[Syncer, Store, SlowAckFsync], Coroutine[Any, Any, None]]


def _run(tmp: Path, monkeypatch: pytest.MonkeyPatch, window: float, body: Body,
         fail: bool = False, priority: bool = False) -> None:
    """``body`` on a real syncer and store, the ack file's fsync held; let go at the end."""
    slow = SlowAckFsync(fail)
    monkeypatch.setattr(segment_log, "datasync_path", slow)

    async def main() -> None:
        s = Syncer(asyncio.get_running_loop(), True, window=window)
        store: Store = QueueStore(tmp / "q", notify=s.mark_dirty)
        if priority:
            store = PriorityStore(store, max_priority=5)
        try:
            await _ack_then_hold_full_sync(s, store, slow)
            await body(s, store, slow)
        finally:
            slow.release.set()
        await _until(lambda: any(p.name == ack_name(1) for p in slow.done))  # in the same window
        assert all((p.parent != tmp / "q") == priority for p in slow.done if p.name == ack_name(1))
        assert await asyncio.wait_for(await _confirm(s, store), 5)
        store.close()
        s.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("priority", [False, True], ids=["queue", "priority-queue"])
def test_confirm_during_full_sync_is_not_delayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 priority: bool) -> None:
    async def body(s: Syncer, store: Store, slow: SlowAckFsync) -> None:
        fut = await _confirm(s, store)  # requested while the settlement's fsync runs
        done, _ = await asyncio.wait([fut], timeout=3)
        assert done, "the confirm waited for the window's settlement fsync"
        assert fut.result() is True
        assert not any(p.name == ack_name(1) for p in slow.done), "answered before the ack file's fsync"

    _run(tmp_path, monkeypatch, 0.2, body, priority=priority)


def test_failed_settlement_fsync_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody waited on it: the store is dirty again and a later commit fsyncs the file."""
    async def body(s: Syncer, store: Store, slow: SlowAckFsync) -> None:
        slow.release.set()
        await _until(lambda: s.failures >= 1)

    _run(tmp_path, monkeypatch, 0.2, body, fail=True)


def test_synchronous_window_answers_after_the_settlement(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``ack_sync_interval = 0`` promises settlements fsynced by the group commit: a waiter in
    a full commit is answered only after the ack file's fsync."""
    async def body(s: Syncer, store: Store, slow: SlowAckFsync) -> None:
        fut = await _confirm(s, store)
        done, _ = await asyncio.wait([fut], timeout=0.3)
        assert not done, "a synchronous window answered before the settlement was durable"
        slow.release.set()
        assert await asyncio.wait_for(fut, 5)

    _run(tmp_path, monkeypatch, 0, body)
