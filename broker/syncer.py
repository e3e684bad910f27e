"""Group commit: one fsync serves every confirm pending at that moment.

Theory of operation
-------------------
Anything that wrote persistent data (a queue store, the definitions log)
registers itself with ``mark_dirty``; anything that must not be acknowledged
before that data is on disk registers a callback with ``after_sync``. The
first callback starts a sync at once (it comes after a read batch, so that
whole batch is covered). The sync takes the dirty set, fsyncs each member in
a worker thread (fsync releases the GIL; the event loop keeps serving) and
then runs the callbacks registered before it started, in order; the worker
hands the result straight to the loop (``call_soon_threadsafe``). The worker is
one dedicated thread (``_FsyncThread``) blocked in C on a simple queue: a
commit costs one C call on the loop (no future, work item or executor
bookkeeping), and the thread goes straight from its wait to the fsync. Every loop
turn between a publish and its confirm costs a synchronous publisher a whole
turn of everybody else's work (milliseconds on a busy loop), so the path has
no turn it does not need. Callbacks registered while a sync runs wait for the
next one, which starts as soon as the current one ends. With ``enabled=False`` (``sync =
false``) callbacks run on the next loop turn without any fsync.

In a cluster, ``replicated`` (set by the node to the leader's ISR barrier) is
called with the dirty set when a sync starts (on the loop thread, so it may
push pending state to the replication sink first); it returns a future that resolves once every
in-sync follower acked the bytes written so far. Callbacks then run only
after both the local fsync and that future, and the next sync waits for them,
so confirms stay in order. ``sync_started`` (monotonic time of the running
fsync, else None) lets a watchdog notice a stalled disk.

The window. Acks, rejects, purges and the delivered mark of a queue are not
covered by any confirm, so ``mark_dirty`` also arms a timer: at most
``window`` seconds after something turned dirty, a *full* sync runs (with or
without callbacks waiting), which makes those durable too (``sync(full=True)``).
The timer fires at half the window so the fsync itself fits inside it. A
window of 0 means synchronous: the full sync starts on the next loop turn.
Objects a confirm-only sync took out of the dirty set stay due for the next
full sync (``_full_pending``). A full sync of more than ``BULK_SYNC_MIN``
objects writes each one's buffers and then makes a single ``bulk_sync``.

Settling, off the confirm path (issue 31). A full sync used to fsync each store's settlement
files (a queue's ack files, delivered mark, delivery counts: a journal commit each) inside the
group commit, and a confirm requested meanwhile waited for all of them and then for its own
commit: measured, 1.3 % of a synchronous publisher's confirms registered during a full sync,
waiting 3x the median (9.1 against 3.2 ms), every half window. Now an object that has a
``settle`` method is synced in a full commit like in a confirm-only one (``sync(full=False)``:
segment data, retired segments, the directory; its settlement files *written*), the commit's
waiters are answered, and the settlement files' fsyncs (``settle()``) run on a second thread
(``_settler``) while the next commits proceed. The durability argument: a confirm's promise is
that the message's bytes are on disk, and those are fsynced by ``sync`` before any waiter of
the commit is answered, exactly as in a confirm-only commit; the settlement files' contents
were written (in the page cache: a kill -9 loses none of it) before the waiters ran, and
nothing any client was answered depends on their fsync while the window is on (an ack has no
answer; a tx.commit never waited for one). Their power-loss promise is the window's, and their
fsync now starts right after the commit that the window timer started at half the window,
instead of inside it. A settle that fails leaves its files due for the next sync of any kind
and marks its object dirty again (counted in ``failures``). A synchronous window (``window <=
0``: purge-ok and tx.commit-ok promise settlements fsynced) and a bulk sync (one syncfs covers
every file at once) keep the settlement inside the commit. ``sync_now`` waits for both threads.

Failure is per object. A waiter names what it waits for (``after_sync(cb, deps)``: the
stores a channel's confirmed publishes reached, the definitions log of a declare; None:
everything). An object whose push to the replication sink (``flush``) or whose sync raises
fails the waiters that depend on it (``cb(False)``: a basic.nack, an error for tx.commit)
and no other; each push and sync is caught on its own, so every other object of the same
group commit is still pushed and synced and the dirty set is always taken, and the failed
object is marked dirty again so the next commit retries it. Waiters registered while that
commit ran may have written to the failed object before it started (a channel whose
previous confirm was in flight registers late), so they fail with it too; a waiter
registered after it ended starts clean: the next commit succeeds. A closed or deleted
store has nothing left to sync or push (its ``sync`` and ``flush`` return at once), so a
queue deleted while its acks were buffered cannot fail anyone. A failed ``bulk_sync`` (the
syncfs that stands for every object's fsync) fails every object of its commit; a barrier
that cannot be taken fails the whole commit. Nothing here raises into ``after_sync``'s
caller: an error answered to a client must mean that its own operation failed, never that
someone else's store did.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from typing import Protocol

log = logging.getLogger(__name__)


class Syncable(Protocol):
    def sync(self, full: bool = False, fsync: bool = True) -> None: ...


FAILURE_LOG_EVERY = 10.0  # seconds: a store that keeps failing is retried by every commit


class _Throttled:
    """Logs a failure with its traceback at most once per ``FAILURE_LOG_EVERY``; the ones in
    between are counted and the count goes with the next line (the loop and the worker
    thread both report here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0.0
        self._skipped = 0

    def exception(self, what: str, obj: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._skipped += 1
                return
            self._next = now + FAILURE_LOG_EVERY
            skipped, self._skipped = self._skipped, 0
        more = f" ({skipped} more failures since the last report)" if skipped else ""
        log.exception("%s %r failed; its waiters are refused and it is retried%s", what, obj, more)


# What a waiter depends on: these objects (a priority store stands for its ``parts`` too),
# or None for everything.
Deps = Collection[Syncable] | None


class _Waiter:
    """A callback waiting for a group commit, what it depends on, and the objects that failed
    in a commit that ended while it waited (``tainted``)."""

    __slots__ = ("callback", "deps", "tainted")

    def __init__(self, callback: Callable[[bool], None], deps: Deps) -> None:
        self.callback = callback
        self.deps = deps
        self.tainted: set[Syncable] | None = None

    def ok(self, failed: set[Syncable]) -> bool:
        bad = failed if self.tainted is None else failed | self.tainted
        if not bad:
            return True
        if self.deps is None:
            return False
        return not any(d is f or f in getattr(d, "parts", ()) for d in self.deps for f in bad)

# More dirty objects than this in one sync: each writes what it buffers without fsyncing,
# then one ``bulk_sync`` (syncfs of the data dir) makes all of it durable at once. An fsync
# costs a journal commit (~5 ms measured on a loaded VM): 3,000 dirty queues took 25 s to
# stop one by one.
BULK_SYNC_MIN = 8


class _FsyncThread:
    """The syncer's worker: one dedicated thread that blocks in C on a ``queue.SimpleQueue``
    (a lock used as a semaphore), so handing it a commit is one C call on the loop and it
    wakes straight into the job, with none of an executor's futures and work items, nor a
    Python-level ``threading.Condition`` wait (measured: ``benchmarks/latency_handoff.py``).
    The syncer has one commit in flight, but hands over the next while the thread may still
    be returning from the last one's report, so jobs queue in order. ``idle`` waits until
    every job handed over has ended; ``stop`` ends the thread after them."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def run(self, job: Callable[[], None]) -> None:
        if self._stopped:
            raise RuntimeError("the fsync thread has stopped")
        self._jobs.put(job)

    def idle(self) -> None:
        if self._stopped:
            self._thread.join()
            return
        done = threading.Event()
        self._jobs.put(done.set)
        done.wait()

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _main(self) -> None:
        get = self._jobs.get
        while (job := get()) is not None:
            try:
                job()
            except Exception:  # pragma: no cover - the job reports its own failures
                log.exception("fsync job failed")
            # A finished job's closure holds its commit's dirty objects (stores of queues that
            # may be deleted meanwhile): not kept alive until the next commit arrives.
            del job


class Syncer:
    def __init__(self, loop: asyncio.AbstractEventLoop, enabled: bool,
                 replicated: Callable[[list[Syncable]], asyncio.Future[None]] | None = None,
                 window: float = 1.0, bulk_sync: Callable[[], None] | None = None) -> None:
        self.loop = loop
        self.bulk_sync = bulk_sync
        self.enabled = enabled
        self.window = window
        self._window_timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._full_due = False
        # Synced for confirms only since their last full sync: the next full sync covers
        # them again (their settlements were written, not fsynced).
        self._full_pending: set[Syncable] = set()
        self.replicated = replicated
        self.sync_started: float | None = None
        self._dirty: set[Syncable] = set()
        self._callbacks: list[_Waiter] = []
        self._running = False
        self._scheduled = False
        self._worker = _FsyncThread("skred-fsync")
        self._settler = _FsyncThread("skred-fsync-settle")  # see "Settling" in the module doc
        # False: a full commit fsyncs the settlement files before answering its waiters, as
        # before issue 31 (the control of ``benchmarks/latency_settle.py``).
        self.settle_apart = True
        self.syncs = 0
        self.failures = 0  # objects that failed a push or a sync (each time)
        self._errors = _Throttled()

    @property
    def synchronous(self) -> bool:
        """Settlements are written at once and fsynced by the next group commit."""
        return self.window <= 0

    def mark_dirty(self, obj: Syncable) -> None:
        self._dirty.add(obj)
        if self._window_timer is None and not self._full_due:
            if self.window <= 0:
                self._window_timer = self.loop.call_soon(self._window_due)
            else:
                self._window_timer = self.loop.call_later(self.window / 2, self._window_due)

    def _window_due(self) -> None:
        self._window_timer = None
        self._full_due = True
        if not self._running and not self._scheduled:
            self._start()

    def discard(self, obj: Syncable) -> None:
        self._dirty.discard(obj)
        self._full_pending.discard(obj)

    def after_sync(self, callback: Callable[[bool], None], deps: Deps = None) -> None:
        """Call ``callback(ok)`` once everything written so far is durable (and replicated);
        ``ok`` is False if one of ``deps`` (None: any object) failed to get there."""
        self._callbacks.append(_Waiter(callback, deps))
        if not self._running and not self._scheduled:
            if self.enabled:
                self._start()
            else:  # nothing to wait for: the callbacks run on the next turn, never inside this call
                self._scheduled = True
                self.loop.call_soon(self._start)

    def _start(self) -> None:
        self._scheduled = False
        if self._running or not (self._callbacks or self._full_due):
            return
        full, self._full_due = self._full_due, False
        waiters, self._callbacks = self._callbacks, []
        failed: set[Syncable] = set()
        barrier = self._replicate(failed) if self.replicated is not None else None
        if not self.enabled and not full:
            self._full_pending |= self._dirty  # no fsync for confirms; the window still runs
            self._dirty.clear()
            self._running = True
            if barrier is None:
                self._finish(waiters, failed)
            else:
                barrier.add_done_callback(lambda b: self._finish(waiters, failed, b))
            return
        if full:
            self._dirty |= self._full_pending
            self._full_pending = set()
        else:
            self._full_pending |= self._dirty
        dirty, self._dirty = list(self._dirty), set()
        self._running = True
        self.sync_started = time.monotonic()
        self._worker.run(lambda: self._sync_then_report(dirty, full, waiters, barrier, failed))

    def _replicate(self, failed: set[Syncable]) -> asyncio.Future[None] | None:
        """Push each dirty object's pending state to the replication sink (``flush``; one that
        raises joins ``failed``), then take the ISR barrier. A barrier that cannot be taken
        fails the whole commit: a future that never resolves would wedge it."""
        assert self.replicated is not None
        dirty = list(self._dirty)
        for obj in dirty:
            flush = getattr(obj, "flush", None)
            if flush is None:
                continue
            try:
                flush()
            except Exception:
                self._errors.exception("pushing to the replicas", obj)
                failed.add(obj)
        try:
            return self.replicated(dirty)
        except Exception:
            log.exception("replication barrier failed")
            fut: asyncio.Future[None] = self.loop.create_future()
            fut.set_exception(RuntimeError("no replication barrier"))
            return fut

    def _sync_then_report(self, dirty: list[Syncable], full: bool, waiters: list[_Waiter],
                          barrier: asyncio.Future[None] | None, failed: set[Syncable]) -> None:
        """On the worker thread: sync, then hand the result to the loop (one turn)."""
        settle: list[tuple[Syncable, Callable[[], None]]] = []
        try:
            synced = _sync_all(dirty, full, self.bulk_sync, self._errors,
                               settle if full and self.window > 0 and self.settle_apart else None)
        except Exception:  # pragma: no cover - _sync_all catches per object
            log.exception("sync failed")
            synced = set(dirty)
        try:
            self.loop.call_soon_threadsafe(self._done, waiters, barrier, failed | synced)
        except RuntimeError:  # the loop is closed: shutting down, nobody waits any more
            pass
        if settle:  # after the report: no waiter of this commit or the next waits for it
            self._settler.run(lambda: self._settle_all(settle))

    def _settle_all(self, objs: list[tuple[Syncable, Callable[[], None]]]) -> None:
        """On the settling thread: fsync each object's settlement files (module doc)."""
        failed: list[Syncable] = []
        for obj, settle in objs:
            try:
                settle()
            except Exception:
                self._errors.exception("settling", obj)
                failed.append(obj)
        if failed:
            try:
                self.loop.call_soon_threadsafe(self._settle_failed, failed)
            except RuntimeError:  # the loop is closed: sync_now covers what is left
                pass

    def _settle_failed(self, objs: list[Syncable]) -> None:
        self.failures += len(objs)
        for obj in objs:
            self.mark_dirty(obj)  # its files stay due (``settle``): the next commit retries

    def _done(self, waiters: list[_Waiter], barrier: asyncio.Future[None] | None,
              failed: set[Syncable]) -> None:
        self.sync_started = None
        self.syncs += 1
        if barrier is not None and not barrier.done():
            barrier.add_done_callback(lambda b: self._finish(waiters, failed, b))
            return
        self._finish(waiters, failed, barrier)

    def _finish(self, waiters: list[_Waiter], failed: set[Syncable],
                barrier: asyncio.Future[None] | None = None) -> None:
        whole = barrier is not None and (barrier.cancelled() or barrier.exception() is not None)
        before = len(self._callbacks)
        # Still running while the callbacks run: a waiter one of them registers (a channel's
        # next confirm) joins the pending ones, is tainted with them, and starts the next
        # commit right after this loop.
        for w in waiters:
            try:
                w.callback(not whole and w.ok(failed))
            except Exception:
                log.exception("sync callback failed")
        self._running = False
        if failed:
            self.failures += len(failed)
            for w in self._callbacks:  # registered while this commit ran: see the module doc
                w.tainted = failed if w.tainted is None else w.tainted | failed
            for obj in failed:
                self.mark_dirty(obj)  # the next commit retries it
        if self.enabled and len(self._callbacks) > before:
            self._start()  # no loop turn a synchronous publisher would wait for
        elif (self._callbacks or self._full_due) and not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._start)

    def sync_now(self) -> None:
        """Synchronously fsync everything dirty (shutdown), after the background sync
        in progress: its dirty set is not ours, and closing its stores meanwhile would
        fsync them one by one."""
        self._worker.idle()  # waits for the running sync
        self._settler.idle()  # and for the settling it handed over
        dirty, self._dirty = list(self._dirty | self._full_pending), set()
        self._full_pending = set()
        _sync_all(dirty, True, self.bulk_sync, self._errors)

    def shutdown(self) -> None:
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        self._worker.stop()
        self._settler.stop()


def _sync_all(dirty: list[Syncable], full: bool, bulk_sync: Callable[[], None] | None,
              errors: _Throttled,
              settle: list[tuple[Syncable, Callable[[], None]]] | None = None) -> set[Syncable]:
    """Sync every object; the ones that failed (all of them if the one ``bulk_sync`` did).
    With ``settle`` (a full commit, window on) an object that can settle later is synced as
    for a confirm and, if that succeeded, appended to it (module doc, "Settling")."""
    failed: set[Syncable] = set()
    bulk = bulk_sync is not None and len(dirty) > BULK_SYNC_MIN
    for obj in dirty:
        try:
            if settle is not None and not bulk and (later := getattr(obj, "settle", None)):
                obj.sync(False, True)
                settle.append((obj, later))
                continue
            obj.sync(full, not bulk)
        except Exception:
            errors.exception("syncing", obj)
            failed.add(obj)
    if bulk:
        assert bulk_sync is not None
        try:
            bulk_sync()
        except Exception:
            errors.exception("syncfs for", dirty[0] if len(dirty) == 1 else f"{len(dirty)} objects")
            return set(dirty)
    return failed
