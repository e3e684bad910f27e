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

from broker.spark.amqp import _PREFETCH, extent, read_columns, read_range  # noqa: E402
from broker.spark.rows import PropsDecoder  # noqa: E402

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


def test_read_columns_in_batches_past_the_prefetch_window(shared_broker: Any, cleanup: Cleanup) -> None:
    """The AMQP-mode reader (the link connection, rows straight into column lists, the stream
    headers cut out of the property bytes) over more records than one prefetch window, so its
    coalesced acks must keep the window moving: a sub-range comes back in batches of the
    requested size, every record's offset, routing key, body and properties as published."""
    url = shared_broker.url
    stream = cleanup.queue()
    n = _PREFETCH + 600
    kinds = [pika.BasicProperties(), pika.BasicProperties(content_type="text/plain", delivery_mode=2),
             pika.BasicProperties(headers={"i": 1, "nested": {"a": [1, "b"]}}, message_id="m")]
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
        for i in range(n):
            ch.basic_publish("", stream, b"b%d" % i, kinds[i % 3])
        ch.confirm_delivery()
        ch.basic_publish("", stream, b"last", pika.BasicProperties())  # confirmed: all before it are stored
    lo, hi = 100, n - 7
    batches = list(read_columns(url, stream, lo, hi, 1500, timeout=20))
    assert [len(b) for b in batches[:-1]] == [1500] * (len(batches) - 1)
    assert [o for b in batches for o in b.offsets] == list(range(lo, hi))
    decoder = PropsDecoder()
    for b in batches:
        props = list(b.uniq)
        for k, offset in enumerate(b.offsets):
            assert (b.keys[k], b.exchanges[k], b.bodies[k]) == (stream, "", b"b%d" % offset)
            fields, headers = decoder.decode(props[b.prop_idx[k]])
            want = kinds[offset % 3]
            assert (fields["content_type"], fields["message_id"]) == (want.content_type, want.message_id)
            assert dict(headers) == ({"i": "1", "nested": '{"a":[1,"b"]}'} if want.headers else {})
