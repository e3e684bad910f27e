"""Group commit: one fsync serves every confirm pending at that moment.

Theory of operation
-------------------
Anything that wrote persistent data (a queue store, the definitions log)
registers itself with ``mark_dirty``; anything that must not be acknowledged
before that data is on disk registers a callback with ``after_sync``. The
first callback schedules a sync on the next loop turn, so every publish in
the current read batch is covered. The sync takes the dirty set, fsyncs each
member in a worker thread (fsync releases the GIL; the event loop keeps
serving) and then runs the callbacks registered before it started, in
order. Callbacks registered while a sync runs wait for the next one, which
starts as soon as the current one ends. With ``enabled=False`` (``sync =
false``) callbacks run on the next loop turn without any fsync.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

log = logging.getLogger(__name__)


class Syncable(Protocol):
    def sync(self) -> None: ...


class Syncer:
    def __init__(self, loop: asyncio.AbstractEventLoop, enabled: bool) -> None:
        self.loop = loop
        self.enabled = enabled
        self._dirty: set[Syncable] = set()
        self._callbacks: list[Callable[[bool], None]] = []
        self._running = False
        self._scheduled = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skred-fsync")
        self.syncs = 0

    def mark_dirty(self, obj: Syncable) -> None:
        self._dirty.add(obj)

    def discard(self, obj: Syncable) -> None:
        self._dirty.discard(obj)

    def after_sync(self, callback: Callable[[bool], None]) -> None:
        self._callbacks.append(callback)
        if not self._running and not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._start)

    def _start(self) -> None:
        self._scheduled = False
        if self._running or not self._callbacks:
            return
        callbacks, self._callbacks = self._callbacks, []
        if not self.enabled:
            self._dirty.clear()
            self._run(callbacks, True)
            return
        dirty, self._dirty = list(self._dirty), set()
        self._running = True
        fut = self.loop.run_in_executor(self._executor, _sync_all, dirty)
        fut.add_done_callback(lambda f: self._done(f, callbacks))

    def _done(self, fut: asyncio.Future[bool], callbacks: list[Callable[[bool], None]]) -> None:
        self._running = False
        self.syncs += 1
        ok = not fut.cancelled() and fut.exception() is None and bool(fut.result())
        self._run(callbacks, ok)
        if self._callbacks and not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._start)

    @staticmethod
    def _run(callbacks: list[Callable[[bool], None]], ok: bool) -> None:
        for cb in callbacks:
            try:
                cb(ok)
            except Exception:
                log.exception("sync callback failed")

    def sync_now(self) -> None:
        """Synchronously fsync everything dirty (shutdown)."""
        dirty, self._dirty = list(self._dirty), set()
        _sync_all(dirty)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def _sync_all(dirty: list[Syncable]) -> bool:
    ok = True
    for obj in dirty:
        try:
            obj.sync()
        except Exception:
            log.exception("fsync failed for %r", obj)
            ok = False
    return ok
