"""The management statistics sampler (broker/http/rates.py) over real queues in a real vhost.

What it must not do with many queues: read them all between two turns of the event loop (every
AMQP connection would wait), or keep per-queue snapshots of queues that never change. What it
must still do: the rates the API shows, per queue and summed per vhost, and the node's
redelivered count, from the same pass.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from test_features_policy import _vhost

from broker.amqp.broker import Stats
from broker.http import rates
from broker.http.history import TIERS, History, Span, parse_spans, series
from broker.http.rates import RateSampler
from broker.model.vhost import VHost

# The promise: a pass never reads more than this many queues between two returns to the loop
# (about half a millisecond of work); today's chunk is rates.CHUNK.
MOST_BETWEEN_YIELDS = 500


class _Broker:
    """What the sampler reads of the broker: vhosts, node counters, connections."""

    def __init__(self, vhosts: dict[str, VHost]) -> None:
        self.vhosts = vhosts
        self.stats = Stats()
        self.connections: set[Any] = set()


class _Reads:
    """The test's seam: a queue's real store, counting how often its ready count is read."""

    count = 0

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def ready_count(self) -> int:
        _Reads.count += 1
        return int(self._inner.ready_count)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _queues(vh: VHost, n: int, prefix: str = "q") -> None:
    for i in range(n):
        vh.declare_queue(f"{prefix}{i}", owner=None)


def test_a_pass_gives_the_event_loop_back_between_chunks(tmp_path: Path) -> None:
    n = 4 * MOST_BETWEEN_YIELDS + 123
    vh = _vhost(tmp_path)
    _queues(vh, n)
    for q in vh.queues.values():
        q.store = _Reads(q.store)  # type: ignore[assignment]
    _Reads.count = 0
    most = 0
    turns = 0

    async def main() -> None:
        nonlocal most, turns
        loop = asyncio.get_running_loop()
        last = 0

        def tick() -> None:  # runs once per turn of the loop
            nonlocal last, most, turns
            most = max(most, _Reads.count - last)
            last = _Reads.count
            turns += 1
            loop.call_soon(tick)

        loop.call_soon(tick)
        await asyncio.sleep(0)
        sampler = RateSampler(_Broker({"/": vh}))  # type: ignore[arg-type]
        sampler.start()
        deadline = time.monotonic() + 60
        while _Reads.count < n and time.monotonic() < deadline:  # one whole pass
            await asyncio.sleep(0.01)
        await sampler.stop()
        tick()

    asyncio.run(main())
    assert _Reads.count >= n, "the sampler never read every queue"
    assert 0 < most <= MOST_BETWEEN_YIELDS, f"{most} queues read in one turn of the loop"
    assert turns > n // MOST_BETWEEN_YIELDS


class _Counted(History):
    """The test's seam: a history that counts how many were made."""

    made = 0

    def __init__(self, width: int) -> None:
        _Counted.made += 1
        super().__init__(width)


def test_a_pass_over_new_objects_bounds_each_step_in_objects_handled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 queues that all start counting at once: the pass that gives each a history must
    still hand the loop back after a chunk's work, a new history counting as ``NEW_COST``
    objects read (issue 31: that pass held the loop for 200 ms)."""
    chunk, n = 64, 300
    monkeypatch.setattr(rates, "History", _Counted)
    vh = _vhost(tmp_path)
    _queues(vh, n)
    for q in vh.queues.values():
        q.store = _Reads(q.store)  # type: ignore[assignment]
    clock = _Clock()
    sampler = RateSampler(_Broker({"/": vh}), clock=clock, chunk=chunk)  # type: ignore[arg-type]
    sampler.sample()
    for name in vh.queues:
        _publish(vh, name, 1)
    clock.t += rates.INTERVAL
    _Reads.count = _Counted.made = 0
    steps = []
    last = (0, 0)
    for _ in sampler.steps():
        steps.append((_Reads.count - last[0], _Counted.made - last[1]))
        last = (_Reads.count, _Counted.made)
    assert _Counted.made >= n  # every queue got its history in this pass
    cost = getattr(rates, "NEW_COST", 4)
    heaviest = max(reads + (cost - 1) * made for reads, made in steps)
    assert heaviest <= chunk, f"one step read {max(steps)} (queues, new histories)"


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _publish(vh: VHost, name: str, n: int) -> None:
    q = vh.queues[name]
    for i in range(n):
        q.publish(1, b"", name.encode(), b"\x00\x00", b"%d" % i, False)


def test_idle_queues_keep_nothing_and_busy_ones_have_rates(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    _queues(vh, 1000)
    clock = _Clock()
    sampler = RateSampler(_Broker({"/": vh}), clock=clock, chunk=64)  # type: ignore[arg-type]
    for _ in range(3):
        sampler.sample()
        clock.t += rates.INTERVAL
    # nothing kept per queue that never counted anything: no values, no rings
    kept = sampler._queues  # noqa: SLF001 - the mechanism under test
    assert (len(kept.last), len(kept.rings)) == (0, 0)

    _publish(vh, "q7", 10)
    sampler.sample()
    assert (len(kept.last), len(kept.rings)) == (1, 1)
    per_second = 10 / rates.INTERVAL
    assert sampler.queue_rates(vh.queues["q7"])["publish"] == pytest.approx(per_second)
    assert sampler.queue_rates(vh.queues["q7"])["ready"] == pytest.approx(per_second)
    assert sampler.queue_rates(vh.queues["q8"])["publish"] == 0
    totals = sampler.queue_totals_rates([vh])
    assert totals["publish"] == pytest.approx(per_second) and totals["ready"] == pytest.approx(per_second)

    # a message got, given back and got again: a redelivery, counted for the node in the same pass
    q7 = vh.queues["q7"]
    got = q7.get()
    assert got is not None
    q7.reject(got[0], requeue=True)
    again = q7.get()
    assert again is not None and again[5]
    clock.t += rates.INTERVAL
    sampler.sample()
    redelivered = rates.GLOBAL_FIELDS.index("redelivered")
    assert sampler.global_counters()[redelivered] == 1
    assert sampler.queue_rates(q7)["redeliver"] == pytest.approx(1 / rates.INTERVAL)
    assert sampler.queue_rates(q7)["publish"] == 0  # nothing published in this window

    # idle again for a window: its ring goes, its last values stay (the next change is a delta)
    clock.t += rates.INTERVAL
    sampler.sample()
    assert (len(kept.last), len(kept.rings)) == (1, 0)
    assert sampler.queue_totals_rates([vh])["publish"] == 0

    # deleted: forgotten by the next pass, the node's redelivered count does not go back
    vh.delete_queue("q7", owner=None)
    clock.t += rates.INTERVAL
    sampler.sample()
    assert (len(kept.last), len(kept.rings)) == (0, 0)
    assert sampler.global_counters()[redelivered] == 1
    assert all(r >= 0 for r in sampler.queue_totals_rates([vh]).values())


def test_a_queue_declared_between_passes_counts_from_zero(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    clock = _Clock()
    sampler = RateSampler(_Broker({"/": vh}), clock=clock)  # type: ignore[arg-type]
    sampler.sample()
    vh.declare_queue("new", owner=None)
    _publish(vh, "new", 5)
    clock.t += rates.INTERVAL
    sampler.sample()  # its first pass already has a rate: it was empty at the previous one
    assert sampler.queue_rates(vh.queues["new"])["publish"] == pytest.approx(5 / rates.INTERVAL)
    assert sampler.queue_totals_rates([vh])["publish"] == pytest.approx(5 / rates.INTERVAL)


# ---------------------------------------------------------------------------- history
def test_history_answers_each_range_from_a_ring_of_fixed_size() -> None:
    h = History(2)
    t0 = 1_000_000.0
    # two days of 5-second passes of a counter that grows by one a second, and a flat gauge
    for k in range(2 * 86400 // 5 + 1):
        h.add(t0 + 5 * k, (5 * k, 7))
    sizes = [len(t.times) for t in h.tiers]
    assert sizes == [n for _, n in TIERS]  # grown to its slots, never past them
    assert sum(sizes) == 284
    now = t0 + 2 * 86400
    for age, incr in ((60, 5), (600, 5), (3600, 60), (8 * 3600, 600), (86400, 1800)):
        span = Span(age, incr)
        rows = series(h, None, span, now, 0.0)
        times = span.points(now)
        assert len(rows) == len(times) == age // incr + 1
        # each point is the counter's value at that time, within one slot of the ring it came from
        slot = h.tier_for(age, incr).incr
        assert h.tier_for(age, incr).incr <= incr
        assert rows[0] == (2 * 86400, 7)  # the newest point is the value now
        for (counter, gauge), t in zip(rows[1:], times[1:], strict=True):
            assert gauge == 7
            assert t - t0 - slot <= counter <= t - t0, (age, incr, t, counter)


def test_a_queue_that_counts_gets_a_history_idle_ones_do_not(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rates, "MAX_HISTORIES", 2)
    vh = _vhost(tmp_path)
    _queues(vh, 5)
    clock = _Clock()
    sampler = RateSampler(_Broker({"/": vh}), clock=clock)  # type: ignore[arg-type]
    sampler.sample()
    for _ in range(12):  # a minute: q0 takes 2 messages a pass, q1..q3 one each at the end
        clock.t += rates.INTERVAL
        _publish(vh, "q0", 2)
        sampler.sample()
    for name in ("q1", "q2", "q3"):
        _publish(vh, name, 1)
    clock.t += rates.INTERVAL
    sampler.sample()
    q0 = vh.queues["q0"]
    h = sampler.queue_history(q0)
    assert h is not None
    assert sampler.queue_history(vh.queues["q4"]) is None  # never counted anything
    # the cap: only the first two queues to count something have a history
    assert sum(sampler.queue_history(q) is not None for q in vh.queues.values()) == 2
    publish = rates.QUEUE_FIELDS.index("publish")
    span = Span(60, 5)
    wall = time.time()
    rows = series(h, rates.queue_values(q0), span, wall, sampler.wall_offset())
    counts = [row[publish] for row in rows]
    assert counts[0] == 24 and counts == sorted(counts, reverse=True) and counts[-1] <= 2
    # a day without a change gives the place back: q4 now counts and gets one
    for _ in range(2):
        clock.t += rates.MAX_AGE
        sampler.sample()
    _publish(vh, "q4", 1)
    clock.t += rates.INTERVAL
    sampler.sample()
    assert sampler.queue_history(vh.queues["q4"]) is not None
    # the vhost's and the broker's histories hold the sums
    vrows = series(sampler.vhost_history(vh), None, span, wall, sampler.wall_offset())
    assert vrows[0][len(rates.VHOST_FIELDS) + publish] == 28


@pytest.mark.parametrize("query", [{"lengths_age": "60"}, {"lengths_age": "x", "lengths_incr": "5"},
                                   {"msg_rates_age": "60", "msg_rates_incr": "0"},
                                   {"msg_rates_age": "5", "msg_rates_incr": "60"},
                                   {"node_stats_age": "172800", "node_stats_incr": "1800"},
                                   {"data_rates_age": "86400", "data_rates_incr": "1"}])
def test_a_bad_range_is_refused(query: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        parse_spans(query)
    assert parse_spans({"lengths_age": "600", "lengths_incr": "5"}) == {"lengths": Span(600, 5)}
