"""Fault injection into the group commit (issue 26, item 1), no sockets: a real event loop,
a real ``Syncer`` and real queue stores on real files.

A store that fails to push its state to the replication sink (``flush``) or to sync fails
only the waiters that depend on it (a confirm becomes a basic.nack), never another store's;
the syncer is not wedged and the next commit succeeds. The faults are real where the file
system can make them (a directory where a store's ack file must go: ``IsADirectoryError``);
an fsync error, which a healthy disk never returns, comes from this test's own seam
(``monkeypatch`` of the store's ``datasync``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import struct
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from broker.store import segment_log
from broker.store.queue_store import QueueStore
from broker.store.segment import ack_name
from broker.syncer import Syncable, Syncer

PERSISTENT = struct.pack(">HB", 0x1000, 2)


def _run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 20))


async def _commit(s: Syncer, deps: list[Syncable] | None) -> bool:
    """One waiter for the next group commit; its ``ok``."""
    fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    s.after_sync(fut.set_result, deps)
    return await asyncio.wait_for(fut, 5)


class Replicas:
    """The leader's ISR barrier with every follower in sync: resolved at once."""

    def __init__(self) -> None:
        self.barriers = 0

    def __call__(self, dirty: list[Syncable]) -> asyncio.Future[None]:
        self.barriers += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def _store(tmp: Path, name: str, s: Syncer) -> QueueStore:
    return QueueStore(tmp / name, notify=s.mark_dirty)


def _publish(store: QueueStore, s: Syncer, body: bytes = b"m") -> None:
    store.append(0, b"", b"k", PERSISTENT, body)
    s.mark_dirty(store)  # what the queue does for a persistent message


def _take_and_ack(store: QueueStore) -> None:
    got = store.next_delivery(False)
    assert got is not None
    store.ack(got[0])


def _block_ack_file(store: QueueStore) -> Path:
    """A directory where the store's first ack file must go: writing its acks fails."""
    path = store.directory / ack_name(1)
    path.mkdir()
    return path


@pytest.mark.parametrize("replicated", [False, True], ids=["single", "leader"])
def test_failing_store_fails_only_its_own_waiters(tmp_path: Path, replicated: bool) -> None:
    async def main() -> None:
        replicas = Replicas() if replicated else None
        s = Syncer(asyncio.get_running_loop(), True, replicated=replicas, window=30)
        bad, good = _store(tmp_path, "bad", s), _store(tmp_path, "good", s)
        _publish(bad, s)
        _publish(good, s)
        assert await _commit(s, [bad, good])
        _take_and_ack(bad)  # buffered: written by the next commit
        blocked = _block_ack_file(bad)
        for _ in range(3):  # the failing store stays in every commit until it recovers
            _publish(bad, s)
            _publish(good, s)
            loop = asyncio.get_running_loop()
            futs = [loop.create_future() for _ in range(3)]
            s.after_sync(futs[0].set_result, [bad])
            s.after_sync(futs[1].set_result, [good])
            s.after_sync(futs[2].set_result, None)  # depends on everything
            assert await asyncio.gather(*futs) == [False, True, False]
        blocked.rmdir()
        _publish(bad, s)
        assert await _commit(s, [bad]), "the next commit after the fault must succeed"
        assert await _commit(s, None)
        assert (bad.directory / ack_name(1)).is_file(), "the buffered ack was written at last"
        if replicas is not None:
            assert replicas.barriers >= 6
        bad.close()
        good.close()
        s.shutdown()

    _run(main)


def test_deleted_store_in_the_dirty_set_fails_nobody(tmp_path: Path) -> None:
    """The instance: ack, delete within the window, then commits on a leader."""
    async def main() -> None:
        s = Syncer(asyncio.get_running_loop(), True, replicated=Replicas(), window=30)
        gone, other = _store(tmp_path, "gone", s), _store(tmp_path, "other", s)
        _publish(gone, s)
        assert await _commit(s, [gone])
        _take_and_ack(gone)  # the ack is buffered, the store dirty
        gone.delete()
        gone.flush()  # a deleted store has nothing to push (it raised FileNotFoundError)
        for _ in range(3):
            _publish(other, s)
            assert await _commit(s, [other])
            assert await _commit(s, None)
        other.close()
        s.shutdown()

    _run(main)


def test_fsync_error_nacks_its_waiters_and_is_retried(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync that fails once: that commit's waiters on the store fail; the store keeps its
    data due, so the next commit fsyncs it again (and then succeeds)."""
    fail = {"left": 0}
    synced: list[int] = []
    real = segment_log.datasync

    def datasync(fd: int) -> None:
        if fail["left"]:
            fail["left"] -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(segment_log, "datasync", datasync)

    async def main() -> None:
        s = Syncer(asyncio.get_running_loop(), True, window=30)
        a, b = _store(tmp_path, "a", s), _store(tmp_path, "b", s)
        _publish(a, s)
        assert await _commit(s, [a])
        _publish(a, s)
        fail["left"] = 1
        assert not await _commit(s, [a])
        del synced[:]
        _publish(b, s)  # a is not written to again: the retry alone must fsync its segment
        assert await _commit(s, [a, b])
        assert len(synced) == 2, "the failed store's segment was fsynced again"
        a.close()
        b.close()
        s.shutdown()

    _run(main)


def test_waiter_registered_during_a_failing_commit_fails_too(tmp_path: Path) -> None:
    """A waiter that joined while a commit that failed for its store was running may have
    written before that commit took the store (a channel whose previous confirm was in
    flight registers late): it fails with it; one registered afterwards succeeds."""
    async def main() -> None:
        s = Syncer(asyncio.get_running_loop(), True, window=30)
        bad = _store(tmp_path, "bad", s)
        _publish(bad, s)
        assert await _commit(s, [bad])
        _take_and_ack(bad)
        blocked = _block_ack_file(bad)
        loop = asyncio.get_running_loop()
        first: asyncio.Future[bool] = loop.create_future()
        late: asyncio.Future[bool] = loop.create_future()
        s.after_sync(first.set_result, [bad])  # starts the commit at once
        s.after_sync(late.set_result, [bad])  # waits for the next one
        assert not await first
        blocked.rmdir()
        assert not await late
        assert await _commit(s, [bad])
        bad.close()
        s.shutdown()

    _run(main)


def test_a_barrier_that_cannot_be_taken_fails_that_commit_only(tmp_path: Path) -> None:
    async def main() -> None:
        broken = {"on": True}
        replicas = Replicas()

        def replicated(dirty: list[Syncable]) -> asyncio.Future[None]:
            if broken["on"]:
                raise RuntimeError("no barrier")
            return replicas(dirty)

        s = Syncer(asyncio.get_running_loop(), True, replicated=replicated, window=30)
        a = _store(tmp_path, "a", s)
        _publish(a, s)
        assert not await _commit(s, [a])  # nothing raised into after_sync's caller
        broken["on"] = False
        _publish(a, s)
        assert await _commit(s, [a])
        a.close()
        s.shutdown()

    _run(main)


def test_priority_store_waiter_fails_with_its_level(tmp_path: Path) -> None:
    """A confirm depends on the queue's store; a priority queue's level store syncs on its
    own (its settlements mark it dirty): its failure fails the queue's confirms."""
    from broker.store.priority_store import PriorityStore

    async def main() -> None:
        s = Syncer(asyncio.get_running_loop(), True, window=30)
        base = _store(tmp_path, "prio", s)
        store = PriorityStore(base, 5)
        level = store._open(3)
        level.append(0, b"", b"k", PERSISTENT, b"m")
        s.mark_dirty(store)
        assert await _commit(s, [store])
        _take_and_ack(level)  # marks the level store dirty (notify)
        (level.directory / ack_name(1)).mkdir()
        assert not await _commit(s, [store])
        (level.directory / ack_name(1)).rmdir()
        assert await _commit(s, [store])
        store.close()
        s.shutdown()

    _run(main)


def test_synchronous_settlement_that_cannot_be_written_is_left_to_the_commit(tmp_path: Path) -> None:
    """With ``ack_sync_interval = 0`` an ack is written at once; if that write fails the ack
    is done all the same (no error for the client that sent it) and stays buffered: the
    group commit tries it again, refuses the waiters on that store while it fails, and
    writes it once it can."""
    async def main() -> None:
        s = Syncer(asyncio.get_running_loop(), True, window=0)
        store = QueueStore(tmp_path / "sync", notify=s.mark_dirty, write_through=True)
        _publish(store, s)
        assert await _commit(s, [store])
        blocked = _block_ack_file(store)
        _take_and_ack(store)  # raised IsADirectoryError into the acking session
        assert not await _commit(s, [store])
        blocked.rmdir()
        # With a window of 0 the failed store's retry (a full sync) may already run, from
        # before the rmdir: a waiter that joins meanwhile fails with it. The one after it
        # waits for a commit that started after the fault ended.
        await _commit(s, [store])
        assert await _commit(s, [store])
        assert (store.directory / ack_name(1)).stat().st_size > 0, "the ack was written"
        assert store.ready_count == 0
        store.close()
        s.shutdown()

    _run(main)
