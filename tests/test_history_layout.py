"""The history's memory layout (issue 31): one allocation per object, answers unchanged.

``ANSWERS`` is the digest of every answer below as the list-of-rings history (before the
single-array layout) gave them, on the same samples: the layout must not change one value."""

from __future__ import annotations

import hashlib
import math
import random

from broker.http.history import TIERS, History, Span, series

# sha256 of the repr of every answer of ``_answers``, computed on the history before the change
ANSWERS = "ef6f8e7a8b2af066fd4e8dca8b520133c27b2b26b7eba8736ca3fb68af5abd51"


def _history(width: int, seed: int, passes: int, t0: float) -> History:
    """A history fed like the sampler feeds it: passes ~5 s apart with jitter, some in the same
    slot, some gaps (the node was busy), counters that grow and gauges that move."""
    rnd = random.Random(seed)
    h = History(width)
    t = t0
    values = [0.0] * width
    for _ in range(passes):
        t += rnd.choice((5.0, 5.0, 5.0, 4.9, 5.1, 0.7, 13.0, 61.0, 700.0))
        for i in range(width):
            values[i] = values[i] + rnd.randrange(0, 50) if i % 2 == 0 else float(rnd.randrange(0, 1000))
        h.add(t, tuple(values))
    return h


def _answers() -> list[object]:
    out: list[object] = []
    spans = [Span(60, 5), Span(600, 5), Span(600, 60), Span(3600, 60), Span(8 * 3600, 600),
             Span(86400, 1800), Span(86400, 600), Span(7, 1), Span(300, 7)]
    for width, seed, passes in ((9, 1, 40), (2, 2, 900), (9, 3, 3000), (4, 4, 1), (2, 5, 20000)):
        t0 = 1_700_000_000.0 + seed
        h = _history(width, seed, passes, t0)
        now = h.tiers[0].at(math.inf) and h.tiers[0].times[h.tiers[0].head] or t0
        for span in spans:
            for offset in (0.0, 3.3):
                out.append(series(h, None, span, now + offset, offset))
                out.append(series(h, tuple(range(width)), span, now + offset + 2.0, offset))
        out.append([t.oldest() for t in h.tiers])
        out.append([t.at(now - 100.0) for t in h.tiers])
    out.append(series(None, (1, 2), Span(60, 5), 1000.0, 0.0))
    out.append(series(History(3), None, Span(60, 5), 1000.0, 0.0))
    return out


def test_range_answers_are_the_same_as_before_the_layout_change() -> None:
    got = hashlib.sha256(repr(_answers()).encode()).hexdigest()
    assert got == ANSWERS


def test_one_object_s_history_is_one_large_allocation() -> None:
    """Small Python objects land in pymalloc's arenas, which a few survivors keep from being
    returned; one buffer over 512 bytes goes to the C allocator, which the node's trim reaches."""
    for width in (1, 2, 9, 18):
        h = History(width)
        assert len(h.data) * h.data.itemsize > 512
        assert h.nbytes() <= (3 * len(TIERS) + sum(n for _, n in TIERS) * (width + 1)) * 8
        # nothing else the object holds is allocated per object (its ring views are made on demand)
        # (``shape`` is a layout tuple shared by every history of that shape)
        assert set(History.__slots__) == {"data", "width", "changed", "shape"}


def test_a_new_object_s_history_is_small_until_its_samples_arrive() -> None:
    """A history's rings grow as samples arrive (issue 31: 1,000 queues and 2,000 channels made
    3,000 histories of the longest size at once, 68 MB, for objects that lived a minute). Born
    with the sampler's two first samples it holds under a KB; a day later its rings are full."""
    full = (3 * len(TIERS) + sum(n for _, n in TIERS) * (9 + 1)) * 8
    h = History(9)
    h.add(1000.0, (0.0,) * 9)
    h.add(1005.0, (1.0,) * 9)
    assert h.nbytes() <= 1024, h.nbytes()
    for k in range(2, 121):  # ten minutes of passes: the fine ring grows, the coarse ones hardly
        h.add(1000.0 + 5 * k, (float(k),) * 9)
    assert h.nbytes() < full * 0.6, h.nbytes()  # the fine ring full (9.8 KB), the others small
    for k in range(121, 86400 // 5 * 2):
        h.add(1000.0 + 5 * k, (float(k),) * 9)
    assert h.nbytes() == full
    assert [len(t.times) for t in h.tiers] == [n for _, n in TIERS]
