"""The Spark sink's AMQP path (``broker/spark/amqp_sink.py``) as a task runs it, without Spark.

A task's Arrow batches go through ``_Sink._publish`` (what Spark's writer calls) to a real broker:
a single node, a cluster leader and through a follower. Batches to one target are framed whole
(``amqp_frames.frame_batch``), others row by row; both must store every row in order with its
routing key and persistent properties, and a returned (unroutable) or nacked row must fail the
task. Small counts: the rates are measured by ``benchmarks/spark_sink.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pika
import pytest

from ._support import count_at, unique

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark.sql.datasource")

from broker.spark.amqp_sink import SinkError  # noqa: E402
from broker.spark.sink import _Sink  # noqa: E402

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes

ROWS = 1500


class _Schema:
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def fieldNames(self) -> list[str]:  # noqa: N802 - pyspark's StructType method
        return self.names


def _publish(url: str, batches: list[Any], **options: str) -> int:
    sink = _Sink({"uri": url, **options}, _Schema(batches[0].schema.names))
    return int(asyncio.run(sink._publish(iter(batches), "q", 0, 0)).rows)


def _drain(url: str, queue: str, n: int) -> list[tuple[bytes, str, int]]:
    """The first ``n`` messages of ``queue``: body, routing key, delivery mode."""
    out: list[tuple[bytes, str, int]] = []
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        for method, props, body in ch.consume(queue, inactivity_timeout=10):
            if method is None:
                break
            out.append((body, method.routing_key, props.delivery_mode))
            ch.basic_ack(method.delivery_tag)
            if len(out) == n:
                break
        ch.cancel()
    return out


def _declare(url: str, queue: str, **arguments: Any) -> None:
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        conn.channel().queue_declare(queue, durable=True, arguments=arguments or None)


def test_batches_to_a_queue_and_to_an_exchange_by_key(shared_broker: Any, cleanup: Any) -> None:
    url = shared_broker.url
    q = cleanup.queue()
    _declare(url, q)
    # two batches framed whole, then one with an empty and a multi-frame body (row by row)
    values = [b"v%d" % i for i in range(ROWS)]
    odd = [b"", b"x" * 300_000, b"end"]
    batches = [pa.record_batch([pa.array(values[:1000], pa.binary())], names=["value"]),
               pa.record_batch([pa.array(values[1000:], pa.binary())], names=["value"]),
               pa.record_batch([pa.array(odd, pa.binary())], names=["value"])]
    assert _publish(url, batches, topic=q, confirmWindow="256") == ROWS + 3
    got = _drain(url, q, ROWS + 3)
    assert [b for b, _rk, _dm in got] == values + odd
    assert {(rk, dm) for _b, rk, dm in got} == {(q, 2)}

    ex, even, odd_q = cleanup.exchange(), cleanup.queue(), cleanup.queue()
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.exchange_declare(ex, "direct", durable=True)
        for name, key in ((even, "even"), (odd_q, "odd")):
            ch.queue_declare(name, durable=True)
            ch.queue_bind(name, ex, key)
    keys = ["even" if i % 2 == 0 else "odd" for i in range(ROWS)]
    batch = pa.record_batch([pa.array(values, pa.binary()), pa.array(keys)], names=["value", "key"])
    assert _publish(url, [batch], topic=ex) == ROWS
    assert [b for b, _rk, _dm in _drain(url, odd_q, ROWS // 2)] == values[1::2]
    assert count_at(url, even) == ROWS // 2


def test_unroutable_and_nacked_rows_fail_the_task(shared_broker: Any, cleanup: Any) -> None:
    url = shared_broker.url
    batch = pa.record_batch([pa.array([b"r%d" % i for i in range(200)], pa.binary())], names=["value"])
    with pytest.raises(SinkError, match="Unroutable"):  # no such queue: returned, framed whole
        _publish(url, [batch], topic=unique("sink-missing"))
    capped = cleanup.queue()
    _declare(url, capped, **{"x-max-length": 50, "x-overflow": "reject-publish"})
    with pytest.raises(SinkError, match="nack"):
        _publish(url, [batch], topic=capped, confirmWindow="64")
    assert count_at(url, capped) == 50


def test_exactly_once_to_a_deduplicating_exchange(shared_broker: Any, cleanup: Any) -> None:
    """``exactlyOnce`` to an exchange declared with ``x-message-deduplication``: batches framed
    whole with each row's id in ``message_id`` and the deduplication header (``dedup_props``),
    a batch with an empty body row by row; the ids are ``<query>.<batch>.<task>.<row>`` in row
    order across batches, and the task run again (Spark's retry) adds nothing."""
    url = shared_broker.url
    ex, q = cleanup.exchange(), cleanup.queue()
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.exchange_declare(ex, "fanout", durable=True, arguments={
            "x-message-deduplication": True, "x-cache-size": 4 * ROWS})
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, ex)
    values = [b"e%d" % i for i in range(ROWS)] + [b"", b"tail"]
    batches = [pa.record_batch([pa.array(part, pa.binary())], names=["value"])
               for part in (values[:700], values[700:ROWS], values[ROWS:])]
    for _run in range(2):
        assert _publish(url, batches, topic=ex, exactlyOnce="true", confirmWindow="256") == ROWS + 2
    got: list[tuple[bytes, str, str]] = []
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        for method, props, body in ch.consume(q, inactivity_timeout=10):
            if method is None:
                break
            got.append((body, props.message_id, props.headers["x-deduplication-header"]))
            ch.basic_ack(method.delivery_tag)
        ch.cancel()
    ids = [f"q.0.0.{i}" for i in range(1, ROWS + 3)]
    assert got == list(zip(values, ids, ids, strict=True))
