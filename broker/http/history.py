"""Rate and length history for the management API's ``?lengths_age=&lengths_incr=`` queries.

Theory of operation: the statistics sampler (``rates.py``) already visits every object each
``INTERVAL`` (5 s). For an object that has counted something it also records its values in a
``History``: four rings, one per resolution, each growing to its slots as samples arrive, the
finer ones for the short ranges and the coarser ones for the long (RabbitMQ's retention policy,
shaped to the UI's range picker):

=========  ======  =====  ======================
ring       incr    slots  covers
=========  ======  =====  ======================
fine       5 s     122    last minute, 10 min
minute     60 s    62     last hour
ten min    600 s   50     last 8 hours
half hour  1800 s  50     last day
=========  ======  =====  ======================

A ring keeps the newest values seen in each of its slots (a pass landing in the same slot
overwrites it; a range of ``age / incr`` steps reads ``age / incr + 2`` slots, the oldest for
the value at the first point), all four in one ``array('d')``: the memory of one object is one
allocation, under a KB when it is made (2 slots a ring), doubling a ring when it fills, at most
``(284 x (fields + 1) + 12) x 8`` bytes: 22.8 KB for a queue or a channel (9 fields), 6.9 KB for
an exchange or a connection (2), reached after a day (the fine ring fills in 10 minutes). A
queue or channel busy for a minute holds 1.9 KB: 1,000 queues and 2,000 channels, 5.6 MB, not
68 (issue 31). At most ``MAX_HISTORIES`` objects of a kind have one (those that changed since
the node's first pass, first come; one unchanged for a day gives its place back; the cap bounds
a node with 100k busy queues to 45 MB of queue history); the others, like idle objects, answer
flat samples at their current values.

A query names an age and an increment (RabbitMQ's ``{range}_age`` and ``{range}_incr``, in
seconds). The answer is ``age / incr + 1`` points on wall-clock times aligned to the increment,
newest first, each the value the object had then (the newest kept at or before it), read from
the finest ring that covers the age at that increment. ``samples`` are what RabbitMQ returns:
counter values for message rates (the client takes differences), gauge values for lengths.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

TIERS = ((5.0, 122), (60.0, 62), (600.0, 50), (1800.0, 50))  # (seconds per slot, slots)
MAX_HISTORIES = 2000  # objects of one kind (queues, exchanges, connections) with a history
MAX_POINTS = 1000  # samples one query may ask for (age / incr + 1)
MAX_AGE = 86400  # a day: what the coarsest ring keeps
# RabbitMQ's range names: message lengths, message rates, byte rates, node gauges
RANGES = ("lengths", "msg_rates", "data_rates", "node_stats")

Values = Sequence[float]


class Tier:
    """A view of one resolution of a ``History``: a ring of ``n`` slots (as many as it has grown
    to, at most the tier's) of ``width`` values inside the history's array (made on demand; it
    holds nothing of its own)."""

    __slots__ = ("data", "incr", "n", "width", "at_head", "at_times", "at_values")

    def __init__(self, history: History, k: int) -> None:
        self.data = history.data
        self.width = history.width
        # the slot written last, then how many are kept; where the times start; the values
        self.at_head, self.at_times, self.n = history.layout()[k]
        self.incr = TIERS[k][0]
        self.at_values = self.at_times + self.n

    @property
    def head(self) -> int:
        return int(self.data[self.at_head])

    @property
    def count(self) -> int:
        return int(self.data[self.at_head + 1])

    @property
    def times(self) -> array[float]:
        return self.data[self.at_times:self.at_times + self.n]

    def oldest(self) -> float:
        return self.data[self.at_times + (self.head - self.count + 1) % self.n]

    def at(self, t: float) -> tuple[float, ...] | None:
        """The newest values kept at or before ``t``; None if ``t`` is before the oldest."""
        data, n, head, times = self.data, self.n, self.head, self.at_times
        for k in range(self.count):
            i = (head - k) % n
            if data[times + i] <= t:
                v = self.at_values + i * self.width
                return tuple(data[v:v + self.width])
        return None


HEADER = 3 * len(TIERS)  # per ring: its head, its count, its slots so far
FIRST_SLOTS = 2  # a ring's slots when its history is made (the sampler adds two samples at once)
LEAST = 65  # doubles an array holds at least: over 512 bytes, the C allocator's, not pymalloc's

Layout = tuple[tuple[int, int, int], ...]
_LAYOUTS: dict[tuple[int, tuple[int, ...]], Layout] = {}


def _layout(width: int, slots: tuple[int, ...]) -> Layout:
    """Per ring of a history of ``width`` values whose rings have ``slots``: where its head and
    count are, where its times start (its values follow them), its slots. Worked out once per
    shape: the sampler adds to thousands of histories a pass, and the shapes are few (a ring
    doubles from ``FIRST_SLOTS`` to its tier's)."""
    got = _LAYOUTS.get((width, slots))
    if got is None:
        rows, at = [], HEADER
        for k, n in enumerate(slots):
            rows.append((3 * k, at, n))
            at += n * (width + 1)
        got = _LAYOUTS[(width, slots)] = tuple(rows)
    return got


class History:
    """One object's values over the last day, at the resolutions of ``TIERS``.

    Everything is in one ``array('d')``: the heads, counts and slots of the rings, then each
    ring's times and values. A ring starts with ``FIRST_SLOTS`` and doubles (up to its tier's)
    when a sample needs a slot it lacks and it is full; it has not wrapped yet then, so growing
    is copying it in order into a larger array. An object that lived a minute holds under a KB;
    one busy for a day 22.8 KB (a queue or a channel). One allocation per object, over 512
    bytes, goes to the C allocator, which the node's trim returns once the object is gone; the
    many small objects a list of rings made landed in pymalloc's arenas, interleaved with
    long-lived objects that kept them pinned (issue 31)."""

    __slots__ = ("data", "width", "changed", "shape")

    def __init__(self, width: int) -> None:
        self.width = width
        self.shape = _layout(width, (FIRST_SLOTS,) * len(TIERS))  # shared by every such history
        _, end, last = self.shape[-1]
        self.data = array("d", (0.0,)) * max(end + last * (width + 1), LEAST)
        for k, (_, _, n) in enumerate(self.shape):
            self.data[3 * k + 2] = n
        self.changed = 0.0  # when the values last changed (the sampler's clock)

    def layout(self) -> Layout:
        """Where each ring is in ``data`` (a tuple shared by every history of this shape)."""
        return self.shape

    @property
    def tiers(self) -> list[Tier]:
        return [Tier(self, k) for k in range(len(TIERS))]

    def nbytes(self) -> int:
        return self.data.itemsize * len(self.data)

    def add(self, t: float, values: Values) -> None:
        """``values`` at ``t`` into every ring: a ring whose newest slot ``t`` falls in
        overwrites it (the newest values win), else it takes the next slot (growing first if
        it is full and has not reached its tier's slots)."""
        width = self.width
        row = array("d", values)
        floor = math.floor
        layout = self.shape
        for k, (incr, most) in enumerate(TIERS):
            data = self.data
            at_head, at_times, n = layout[k]
            head = int(data[at_head])
            count = int(data[at_head + 1])
            if count and floor(data[at_times + head] / incr) == floor(t / incr):
                at = head
            else:
                if count == n < most:
                    layout = self._grow(layout, k, min(2 * n, most))
                    data = self.data
                    at_head, at_times, n = layout[k]
                at = (head + 1) % n if count else 0
                data[at_head] = at
                data[at_head + 1] = min(count + 1, n)
            data[at_times + at] = t
            v = at_times + n + at * width
            data[v:v + width] = row

    def _grow(self, layout: Layout, k: int, slots: int) -> Layout:
        """Ring ``k`` to ``slots`` slots: a new array, every ring copied to its new place (ring
        ``k`` is full and unwrapped: its times and values keep their slots)."""
        width, old = self.width, self.data
        shape = [n for _, _, n in layout]
        shape[k] = slots
        grown = _layout(width, tuple(shape))
        _, end, last = grown[-1]
        data = array("d", (0.0,)) * max(end + last * (width + 1), LEAST)
        data[0:HEADER] = old[0:HEADER]
        data[3 * k + 2] = slots
        for (_, was, n), (_, now, m) in zip(layout, grown, strict=True):
            data[now:now + n] = old[was:was + n]  # times
            data[now + m:now + m + n * width] = old[was + n:was + n + n * width]  # values
        self.data, self.shape = data, grown
        return grown

    def tier_for(self, age: float, incr: float) -> Tier:
        """The finest ring whose slots are no longer than ``incr`` and that reaches ``age`` back."""
        for k, (tier_incr, n) in enumerate(TIERS):
            if tier_incr <= incr and tier_incr * (n - 2) >= age:
                return Tier(self, k)
        return Tier(self, len(TIERS) - 1)


@dataclass(frozen=True)
class Span:
    """A query's range: ``age`` seconds back, one point every ``incr`` seconds."""

    age: int
    incr: int

    def points(self, now_wall: float) -> list[float]:
        """Wall-clock times of the answer, aligned to ``incr``, newest first."""
        top = math.floor(now_wall / self.incr) * self.incr
        return [top - k * self.incr for k in range(self.age // self.incr + 1)]


def parse_spans(query: Mapping[str, str]) -> dict[str, Span]:
    """``{range}_age``/``{range}_incr`` pairs of a query string; ValueError names a bad one."""
    spans: dict[str, Span] = {}
    for name in RANGES:
        age_s, incr_s = query.get(f"{name}_age"), query.get(f"{name}_incr")
        if age_s is None and incr_s is None:
            continue
        try:
            age, incr = int(age_s or ""), int(incr_s or "")
        except ValueError:
            raise ValueError(f"{name}_age and {name}_incr must both be whole seconds") from None
        if not (1 <= incr <= age <= MAX_AGE) or age // incr + 1 > MAX_POINTS:
            raise ValueError(f"{name}_age must be at most {MAX_AGE} s, {name}_incr between 1 and the age, "
                             f"and at most {MAX_POINTS} points")
        spans[name] = Span(age, incr)
    return spans


def series(history: History | None, current: Values | None, span: Span, now_wall: float,
           wall_offset: float) -> list[tuple[float, ...]]:
    """The object's values at each of ``span``'s points (newest first). ``wall_offset`` turns
    the sampler's clock into wall-clock time; before the history began, its oldest values;
    without a history, ``current`` throughout (None: the newest the history kept)."""
    times = span.points(now_wall)
    tier = history.tier_for(span.age, span.incr) if history is not None else None
    if current is None:
        current = tier.at(math.inf) if tier is not None and tier.count else None
        if current is None:
            return []
    flat = tuple(float(v) for v in current)
    if tier is None or not tier.count:
        return [flat] * len(times)
    out: list[tuple[float, ...]] = []
    first = tier.at(tier.oldest())
    for k, t in enumerate(times):
        got = flat if k == 0 else tier.at(t - wall_offset)
        out.append(got if got is not None else first or flat)
    return out


def details(points: list[float], times: list[float], counter: bool) -> dict[str, object]:
    """What RabbitMQ adds to a ``*_details`` object for a range: ``samples`` (newest first, ms
    timestamps) and the averages over it (of the value for a length, of the rate for a counter)."""
    samples = [{"sample": round(v) if float(v).is_integer() else v, "timestamp": int(t * 1000)}
               for v, t in zip(points, times, strict=True)]
    span = max(times[0] - times[-1], 1e-9) if len(times) > 1 else 0.0
    out: dict[str, object] = {"samples": samples}
    if counter:
        out["avg_rate"] = round((points[0] - points[-1]) / span, 2) if span else 0.0
    else:
        out["avg"] = round(sum(points) / len(points), 2)
        out["avg_rate"] = round((points[0] - points[-1]) / span, 2) if span else 0.0
    return out


def decorate(target: dict[str, object], keys: Mapping[str, tuple[int, ...]],
             rows: list[tuple[float, ...]], times: list[float], counter: bool) -> None:
    """Add samples to ``target[key + "_details"]`` for each ``key``: the sum of the fields at
    the given indices (one field, or ready + unacked for ``messages``)."""
    for key, idx in keys.items():
        points = [sum(row[i] for i in idx) for row in rows]
        box = target.setdefault(f"{key}_details", {})
        if isinstance(box, dict):
            box.update(details(points, times, counter))
