"""A capped stream's extent as the Spark source reads it over AMQP (``broker.spark.amqp.extent``),
on a single node, a cluster leader and through a follower: retention removes whole segments
from the front once a record is in a newer one, so the extent is (first retained, next) and
never (0, 0) for a written stream; a read from the first retained offset gets every record
up to the end."""

from __future__ import annotations

from typing import Any

import pika
import pytest

from ._support import Cleanup

pytest.importorskip("pyspark")

from broker.spark.amqp import extent, read_range  # noqa: E402

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes

N = 40


def test_extent_after_retention(shared_broker: Any, cleanup: Cleanup) -> None:
    url = shared_broker.url
    stream = cleanup.queue()
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.queue_declare(stream, durable=True, arguments={
            "x-queue-type": "stream", "x-stream-max-segment-size-bytes": 2048, "x-max-length-bytes": 1})
        ch.confirm_delivery()
        for i in range(N):
            ch.basic_publish("", stream, b"m%03d" % i * 100, pika.BasicProperties(delivery_mode=2))
    first, nxt = extent(url, stream, timeout=20)
    assert nxt == N and 0 < first < N, (first, nxt)
    got = [rec[0] for rec in read_range(url, stream, first, nxt, timeout=20)]
    assert got == list(range(first, N))
