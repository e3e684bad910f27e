"""The syncer's durability window (issue 14, item 1), no sockets: a real event loop and
recording Syncables. Everything marked dirty gets a full sync within the window, also when
a confirm-only group commit took it out of the dirty set first; many dirty objects are
made durable with one bulk sync."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from broker.syncer import BULK_SYNC_MIN, Syncer


class Rec:
    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []

    def sync(self, full: bool = False, fsync: bool = True) -> None:
        self.calls.append((full, fsync))


async def _until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)  # poll interval, bounded by the deadline


def test_confirm_sync_then_window_sync() -> None:
    async def main() -> None:
        s = Syncer(asyncio.get_running_loop(), True, window=0.2)
        a = Rec()
        s.mark_dirty(a)
        done: list[bool] = []
        s.after_sync(done.append)  # a confirm: group commit, not full
        await _until(lambda: done)
        assert a.calls[0] == (False, True)
        await _until(lambda: any(full for full, _ in a.calls))  # the window covers it again
        assert a.calls[-1] == (True, True)
        s.shutdown()

    asyncio.run(main())


def test_many_dirty_objects_share_one_bulk_sync() -> None:
    bulk: list[int] = []

    async def main() -> None:
        s = Syncer(asyncio.get_running_loop(), True, window=0.1, bulk_sync=lambda: bulk.append(1))
        objs = [Rec() for _ in range(BULK_SYNC_MIN + 1)]
        for o in objs:
            s.mark_dirty(o)
        await _until(lambda: bool(bulk))
        assert all(o.calls == [(True, False)] for o in objs)  # written, fsynced by the bulk sync
        s.shutdown()

    asyncio.run(main())


def test_synchronous_window_syncs_on_the_next_turn() -> None:
    async def main() -> None:
        s = Syncer(asyncio.get_running_loop(), True, window=0)
        assert s.synchronous
        a = Rec()
        s.mark_dirty(a)
        await _until(lambda: bool(a.calls), timeout=2)
        assert a.calls == [(True, True)]
        s.shutdown()

    asyncio.run(main())
