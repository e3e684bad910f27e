"""The message size histogram (broker/amqp/sizes.py): RabbitMQ's buckets, a bound's own size in
its bucket, and the run path counting exactly as body-by-body observation does."""

from __future__ import annotations

import random
from bisect import bisect_left

from broker.amqp.sizes import BOUNDS, MessageSizes, bucket


def test_bounds_belong_to_their_bucket() -> None:
    h = MessageSizes()
    for size in (0, 100, 101, 1_000, 1_001, 100_000_000, 100_000_001):  # table and bisect alike
        h.observe(size)
    assert h.counts == [2, 2, 1, 0, 0, 0, 0, 1, 1]
    assert h.total == sum((0, 100, 101, 1_000, 1_001, 100_000_000, 100_000_001))
    cumulative = h.cumulative()
    assert [b for b, _ in cumulative] == [*BOUNDS, float("inf")]
    assert cumulative[-1][1] == 7 and cumulative[0][1] == 2


def test_runs_count_as_one_by_one() -> None:
    """Differential: a run (one bucket or spanning several, whole or a slice) against observe()."""
    rng = random.Random(7)
    for _ in range(300):
        bodies = [b"x" * rng.choice((0, 5, 99, 100, 101, 999, 1_000, 1_001, 20_000))
                  for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:  # often one size: the single-bucket path
            bodies = [bodies[0]] * len(bodies) if bodies else bodies
        lo = rng.randint(0, len(bodies))
        hi = rng.randint(lo, len(bodies))
        run, each = MessageSizes(), MessageSizes()
        run.observe_run(bodies, lo, hi)
        for body in bodies[lo:hi]:
            each.observe(len(body))
        assert (run.counts, run.total) == (each.counts, each.total)
        if len({len(b) for b in bodies[lo:hi]}) == 1:  # the codec's ``same``: one body length
            one = MessageSizes()
            one.observe_run(bodies, lo, hi, same=True)
            assert (one.counts, one.total) == (each.counts, each.total)
        whole = MessageSizes()
        whole.observe_run([memoryview(b) for b in bodies])
        assert sum(whole.counts) == len(bodies)


def test_table_agrees_with_the_bounds() -> None:
    for size in [*range(0, 20_000, 7), 16_383, 16_384, 16_385]:
        assert bucket(size) == bisect_left(BOUNDS, size), size
