"""The syncer's dedicated fsync thread (``broker/syncer.py`` ``_FsyncThread``): jobs run in the
order handed over, on one thread; a job handed over from inside the running one (the next group
commit starts while the thread is still returning from the last one's report) waits its turn;
``idle`` waits for the job in progress; ``stop`` runs what was handed over first. No sockets,
no disk."""

from __future__ import annotations

import threading
import weakref

import pytest

from broker.syncer import _FsyncThread

DEADLINE = 30.0  # seconds: a bound on every wait, never a sleep


def test_jobs_run_in_order_on_one_thread_and_may_hand_over_the_next() -> None:
    t = _FsyncThread("skred-fsync-test")
    ran: list[tuple[int, str]] = []
    done = threading.Event()

    def job(i: int) -> None:
        ran.append((i, threading.current_thread().name))
        if i == 0:
            t.run(lambda: job(2))  # handed over while job 0 still runs: after job 1
        if i == 2:
            done.set()

    t.run(lambda: job(0))
    t.run(lambda: job(1))
    assert done.wait(DEADLINE)
    t.stop()
    assert ran == [(0, "skred-fsync-test"), (1, "skred-fsync-test"), (2, "skred-fsync-test")]


def test_idle_waits_for_the_job_in_progress() -> None:
    t = _FsyncThread("skred-fsync-test")
    started, release = threading.Event(), threading.Event()
    t.run(lambda: (started.set(), release.wait(DEADLINE)))
    assert started.wait(DEADLINE)
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (t.idle(), returned.set()))
    waiter.start()
    assert not returned.wait(0.2)  # still inside the job (a bound, not a synchronisation)
    release.set()
    assert returned.wait(DEADLINE)
    waiter.join(DEADLINE)
    t.stop()


def test_stop_runs_what_was_handed_over_then_refuses() -> None:
    t = _FsyncThread("skred-fsync-test")
    gate = threading.Event()
    ran: list[int] = []
    t.run(lambda: (gate.wait(DEADLINE), ran.append(1)))
    t.run(lambda: ran.append(2))
    gate.set()
    t.stop()
    assert ran == [1, 2]
    with pytest.raises(RuntimeError):
        t.run(lambda: None)


def test_a_finished_job_keeps_nothing_alive_until_the_next() -> None:
    """A commit's job closes over its dirty objects (stores of queues that may be deleted
    meanwhile): once it ran, the thread must not hold it while it waits for the next job."""
    t = _FsyncThread("skred-fsync-test")

    class Store:
        pass

    store = Store()
    gone = threading.Event()
    ref = weakref.ref(store, lambda _r: gone.set())
    ran = threading.Event()
    t.run(lambda held=store: ran.set() if held else None)
    del store
    assert ran.wait(DEADLINE)
    try:
        assert gone.wait(DEADLINE), f"the finished job still holds {ref()!r}"
    finally:
        t.stop()
