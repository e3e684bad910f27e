"""Issue 31, the synchronous publisher into a backlog: the group commit's worker thread makes
only the calls of the fsync itself. Every call the worker makes that blocks releases the GIL,
and getting it back from an event loop busy delivering a backlog costs up to a switch
interval (the loop never waits in epoll meanwhile): a confirm waited for one such hand-off
per call. Writing a queue's buffered acks and its delivered mark before the fsync took six
calls of the worker (open, write, close, twice) on top of the fsync's three; the loop thread
now writes them when the commit starts. Counted with ``threading.setprofile`` (every call
into the ``posix`` module from the worker thread but ``fspath``, which does not block): counts, not time."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from broker.store.queue_store import QueueStore
from broker.syncer import Syncer

PERSISTENT = b"\x10\x00\x02"  # basic properties: delivery-mode 2


def test_a_confirm_commit_makes_only_the_fsync_calls_in_the_worker(tmp_path: Path) -> None:
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__module__", "") == "posix" and arg.__name__ != "fspath" \
                and threading.current_thread().name.startswith("skred-fsync"):
            calls.append(arg.__name__)

    async def main() -> None:
        store = QueueStore(tmp_path / "q")
        syncer = Syncer(asyncio.get_running_loop(), True, window=60.0)
        try:
            for i in range(10):  # a backlog, durable
                store.append(1000, b"", b"q", PERSISTENT, b"backlog-%d" % i)
            first = store.shift()
            assert first is not None
            store.ack(first)  # the segment's ack file exists from here on (steady state)
            syncer.mark_dirty(store)
            done: list[bool] = []
            syncer.after_sync(done.append)
            while not done:
                await asyncio.sleep(0.005)
            for _ in range(4):  # a consumer takes and acks part of it: acks and the mark move
                msgid = store.shift()
                assert msgid is not None
                store.ack(msgid)
            store.append(1000, b"", b"q", PERSISTENT, b"sync-publish")  # waits for its confirm
            syncer.mark_dirty(store)
            calls.clear()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            syncer.after_sync(done.append)
            while len(done) < 2 and loop.time() < deadline:
                await asyncio.sleep(0.005)
            assert done == [True, True]
            # main: open, write, close (acks), open, pwrite, close (the mark), dup, fdatasync, close
            assert sorted(calls) == ["close", "dup", "fdatasync"], " ".join(calls)
            ack_files = list((tmp_path / "q").rglob("*ack*"))
            assert ack_files and any(f.stat().st_size for f in ack_files), ack_files  # kill -9 keeps them
        finally:
            syncer.shutdown()
            store.close()

    threading.setprofile(profile)
    try:
        asyncio.run(main())
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
