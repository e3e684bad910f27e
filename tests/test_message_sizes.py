"""The message size histogram (broker/amqp/sizes.py): RabbitMQ's buckets, a bound's own size in
its bucket, and the run path counting exactly as body-by-body observation does."""

from __future__ import annotations

import random

from broker.amqp.sizes import BOUNDS, MessageSizes


def test_bounds_belong_to_their_bucket() -> None:
    h = MessageSizes()
    for size in (0, 100, 101, 1_000, 1_001, 100_000_000, 100_000_001):
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
        whole = MessageSizes()
        whole.observe_run([memoryview(b) for b in bodies])
        assert sum(whole.counts) == len(bodies)
