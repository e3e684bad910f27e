"""Stream retention by policy (set, changed, removed, at boot) and the idle age timer."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.model.policy import PolicySet
from broker.model.stream import StreamQueue, effective_retention
from broker.model.vhost import VHost
from broker.store.sink import NullSink
from broker.store.stream_store import Retention

SEG = 256  # bytes per segment: a few records each, so retention has segments to drop


class Timers:
    """A fake ``call_later``: records timers; tests fire them by hand."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, Callable[[], None], list[bool]]] = []

    def __call__(self, delay: float, cb: Callable[[], None]) -> Any:
        cancelled = [False]
        self.pending.append((delay, cb, cancelled))

        class Handle:
            def cancel(self) -> None:
                cancelled[0] = True

        return Handle()

    def live(self) -> list[tuple[float, Callable[[], None]]]:
        return [(d, cb) for d, cb, c in self.pending if not c[0]]

    def fire_all(self) -> None:
        live = self.live()
        self.pending.clear()
        for _d, cb in live:
            cb()


def _vhost(tmp: Path, timers: Timers | None = None) -> VHost:
    return VHost("/", tmp / "data", segment_size=64 * 1024, sink=NullSink(),
                 schedule=lambda cb: None, mark_dirty=lambda _obj: None,
                 transient_root=tmp / "transient", call_later=timers)


def _stream(vh: VHost, name: str, **args: Any) -> StreamQueue:
    q, _ = vh.declare_queue(name, durable=True, owner=None,
                            arguments={"x-queue-type": "stream",
                                       "x-stream-max-segment-size-bytes": SEG, **args})
    assert isinstance(q, StreamQueue)
    return q


def _pub(q: StreamQueue, n: int, ts: int | None = None) -> None:
    for i in range(n):
        q.publish(ts if ts is not None else int(time.time() * 1000), b"", q.name.encode(), b"\x00\x00",
                  b"m%04d" % i, True)


def _within(q: StreamQueue, limit: int) -> bool:
    """At most ``limit`` messages in the closed segments (the write segment is never removed and
    retention runs when it fills), and some history is gone."""
    infos = q.stream.segment_infos()
    return q.message_count - infos[-1][3] <= limit and q.stream.first_offset > 0


def test_effective_retention_stricter_wins() -> None:
    args = Retention(max_length=50, max_bytes=None, max_age_ms=3_600_000)
    eff = effective_retention(args, {"max-length": 100, "max-length-bytes": 1000, "max-age": "1m"},
                              {"max-length-bytes": 500})
    assert eff == Retention(50, 500, 60_000)
    assert effective_retention(args, None, None) == args
    assert effective_retention(Retention(), {"max-length": 7, "message-ttl": 5}, None) == Retention(7)
    # malformed values in a stored policy are ignored, never raised at apply time
    assert effective_retention(Retention(), {"max-length": "x", "max-age": "soon"}, None) == Retention()


def test_policy_set_changed_removed(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    q = _stream(vh, "ev")
    other = _stream(vh, "keep")
    _pub(q, 200)
    _pub(other, 200)
    assert q.message_count == 200
    vh.set_policy("cap", "^ev$", {"max-length": 20}, apply_to="streams")
    assert 0 < q.message_count <= 20  # whole segments: at most the limit, never zero
    assert q.stream.first_offset > 0
    assert other.message_count == 200  # pattern does not match
    # a stricter argument still wins over a looser policy
    strict = _stream(vh, "ev-strict", **{"x-max-length": 5})
    vh.set_policy("cap", "^ev", {"max-length": 50}, apply_to="streams")  # changed
    _pub(strict, 100)
    assert _within(strict, 5)
    _pub(q, 100)
    assert _within(q, 50) and q.message_count > 20
    assert vh.delete_policy("cap")  # removed: back to the (absent) argument limits
    _pub(q, 100)
    assert q.message_count > 100
    _pub(strict, 100)
    assert _within(strict, 5)  # its own argument still applies


def test_policy_apply_to_and_validation(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    q = _stream(vh, "ev")
    _pub(q, 100)
    vh.set_policy("classic-only", ".*", {"max-length": 1}, apply_to="classic_queues")
    assert q.message_count == 100
    vh.set_policy("queues", ".*", {"max-length-bytes": 2 * SEG}, apply_to="queues")
    assert q.stream.size_bytes <= 2 * SEG
    with pytest.raises(ValueError, match="max-age"):
        vh.set_policy("bad", ".*", {"max-age": "7 days"})
    with pytest.raises(ValueError, match="max-age"):
        vh.set_policy("bad", ".*", {"max-age": 7})


def test_policy_applies_at_boot(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    q = _stream(vh, "ev")
    _pub(q, 200)
    vh.close()
    # The policy reaches the disk while the stream is closed (as if set on a stopped node).
    ps = PolicySet(vh.dir / "policies.json", NullSink())
    from broker.model.policy import make_policy
    ps.policies["cap"] = make_policy("cap", "^ev$", {"max-length": 30}, apply_to="streams")
    ps.save()
    vh2 = _vhost(tmp_path)
    q2 = vh2.queues["ev"]
    assert isinstance(q2, StreamQueue)
    assert 0 < q2.message_count <= 30
    assert q2.stream.next_offset == 200
    vh2.close()


def test_idle_stream_age_timer(tmp_path: Path) -> None:
    timers = Timers()
    vh = _vhost(tmp_path, timers)
    q = _stream(vh, "ev", **{"x-max-age": "10s"})
    assert [d for d, _ in timers.live()] == [60.0]  # nothing removable yet: check again in 60 s
    old = int(time.time() * 1000) - 3_600_000
    _pub(q, 100, ts=old)  # an hour old: expired, but nothing runs retention while idle...
    count = q.message_count
    assert count == 100
    timers.fire_all()  # ...until the timer fires
    assert q.message_count < count
    assert len(q.stream.segment_infos()) == 1  # only the write segment is kept
    assert [d for d, _ in timers.live()] == [60.0]  # re-armed
    # The publish that closes a segment re-aims the timer at that segment's expiry (~10 s).
    _pub(q, 60)
    (delay, _cb), = timers.live()
    assert 5.0 < delay <= 10.1
    q.apply_policies(None, None)  # recomputing keeps one timer, same target
    (delay2, _cb), = timers.live()
    assert 5.0 < delay2 <= delay
    # Removing the age limit (no argument, no policy) stops the timer.
    q2 = _stream(vh, "ev2")

    def timers_of(queue: StreamQueue) -> list[float]:
        return [d for d, cb in timers.live() if getattr(cb, "__self__", None) is queue]

    assert timers_of(q2) == []
    vh.set_policy("age", "^ev2$", {"max-age": "1h"})
    assert timers_of(q2) == [60.0]
    vh.delete_policy("age")
    assert timers_of(q2) == []
    assert len(timers_of(q)) == 1
    vh.delete_queue("ev", owner=None)
    assert timers_of(q) == []
