"""The per-source table of bursts (broker/bursts.py) that the login throttle and the replication
port's gate share, with a fake clock."""

from __future__ import annotations

from dataclasses import dataclass

from broker.bursts import Bursts


@dataclass
class Entry:
    last: float
    hits: int = 1


class Recorder(Bursts[Entry]):
    def __init__(self, *, quiet: float = 10.0, max_sources: int = 100) -> None:
        super().__init__(quiet=quiet, max_sources=max_sources)
        self.summaries: list[tuple[str, int]] = []

    def ended(self, source: str, entry: Entry) -> None:
        self.summaries.append((source, entry.hits))

    def hit(self, source: str, now: float) -> Entry:
        entry = self.current(source, now)
        if entry is None:
            return self.start(source, Entry(now), now)
        entry.hits += 1
        entry.last = now
        return entry


def test_activity_keeps_a_burst_going_and_quiet_ends_it_once() -> None:
    t = Recorder(quiet=10.0)
    for now in (0.0, 9.0, 18.0, 27.0):  # each hit within `quiet` of the last one
        t.hit("10.0.0.1", now)
    assert t.summaries == [] and t.sources() == 1
    assert t.current("10.0.0.1", 37.0) is not None  # exactly `quiet` later: not yet over
    assert t.current("10.0.0.1", 37.5) is None
    assert t.summaries == [("10.0.0.1", 4)] and t.sources() == 0
    assert t.hit("10.0.0.1", 38.0).hits == 1  # a new burst starts from nothing
    assert t.summaries == [("10.0.0.1", 4)]


def test_sweep_ends_only_the_quiet_sources() -> None:
    t = Recorder(quiet=10.0)
    t.hit("a", 0.0)
    t.hit("b", 6.0)
    t.hit("c", 12.0)
    t.sweep(15.5)
    assert t.summaries == [("a", 1)] and t.sources() == 2
    t.sweep(15.5)  # each burst is summed up once
    assert t.summaries == [("a", 1)]


def test_a_full_table_ends_the_quiet_ones_first_then_the_oldest() -> None:
    t = Recorder(quiet=10.0, max_sources=3)
    t.hit("quiet", 1.0)
    t.hit("old", 5.0)
    t.hit("busy", 13.0)
    t.hit("old", 14.0)  # still active, but now the oldest entry in the table
    t.hit("new", 14.5)  # full: "quiet" (silent 13.5 s) goes, nothing else
    assert t.summaries == [("quiet", 1)] and t.sources() == 3
    t.hit("newer", 15.0)  # full, none quiet: the oldest entry, "old", goes
    assert t.summaries == [("quiet", 1), ("old", 2)]
    assert t.current("busy", 15.0) is not None and t.sources() == 3


def test_a_flood_of_sources_stays_bounded_and_every_burst_is_summed_up() -> None:
    t = Recorder(quiet=60.0, max_sources=50)
    for i in range(1000):
        t.hit(f"10.0.{i // 256}.{i % 256}", 1.0)
    assert t.sources() == 50
    t.sweep(100.0)
    assert t.sources() == 0 and len(t.summaries) == 1000
