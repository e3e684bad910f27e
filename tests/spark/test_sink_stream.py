"""The sink's exactly-once mode into a stream: deduplicated by the stream protocol, durably.

Rows for a stream go over the stream protocol as a named publisher with deterministic
publishing ids (``broker/spark/stream_publish.py``); the stream keeps the publisher's highest
stored id in order with its log. A task fails mid-batch (one row names a stream that does not
exist yet), the broker is killed with SIGKILL and restarted, and the job run again with the same
query id (what Spark's retry does) adds exactly the missing rows: the rows the failed task
stored before the kill are confirmed and dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from integration._support import SkredProcess, count_at

pika = pytest.importorskip("pika")

ROWS = 300


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[SkredProcess]:
    b = SkredProcess(tmp_path / "data", [])
    try:
        b.start()
        yield b
    finally:
        b.close()


def _declare(url: str, *streams: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        for s in streams:
            conn.channel().queue_declare(s, durable=True, arguments={"x-queue-type": "stream"})
    finally:
        conn.close()


def test_exactly_once_into_a_stream_survives_a_failed_task_and_kill9(spark: Any,
                                                                     own_broker: SkredProcess) -> None:
    b = own_broker
    stream, late = "sunk-stream", "sunk-stream-late"
    _declare(b.url, stream)

    def gen(index: int, it: Any) -> Any:
        for n, i in enumerate(it):
            yield (b"row-%d" % i, late if index == 1 and n == 60 else stream)

    def write() -> None:
        rdd = spark.sparkContext.parallelize(range(ROWS), 2).mapPartitionsWithIndex(gen)
        (spark.createDataFrame(rdd, "value binary, topic string").write.format("skred").mode("append")
         .option("uri", b.url).option("streamPort", str(b.stream_port)).option("exactlyOnce", "true")
         .option("queryId", "job-7").option("confirmWindow", "16").save())

    with pytest.raises(Exception, match="exactlyOnce needs 'sunk-stream-late' to be a stream"):
        write()
    partial = count_at(b.url, stream)
    assert 40 <= partial < ROWS - 1  # the failed task stored some of its rows first
    b.kill9()
    b.start()
    _declare(b.url, late)
    write()  # Spark's retry of the failed job, same query id: only the missing rows are added
    assert (count_at(b.url, stream), count_at(b.url, late)) == (ROWS - 1, 1)
    assert sorted(_bodies(b.url, stream, ROWS - 1)) == sorted(b"row-%d" % i for i in range(ROWS) if i != 210)


def _bodies(url: str, stream: str, n: int) -> list[bytes]:
    """The first ``n`` bodies of ``stream``, read over AMQP from its first offset."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=n)
        out: list[bytes] = []
        for _m, _p, body in ch.consume(stream, arguments={"x-stream-offset": "first"}, inactivity_timeout=10):
            assert body is not None, f"{len(out)} of {n} messages within 10 s"
            out.append(body)
            if len(out) == n:
                break
        return out
    finally:
        conn.close()


def test_exactly_once_arrow_batches_into_a_stream(spark: Any, own_broker: SkredProcess) -> None:
    """With the ``topic`` option naming a stream, each task's Arrow batches are framed whole
    (``broker/spark/arrow_frames.py``; several batches per task here): every row lands once, in
    order within its task, a re-run of the job adds nothing, and a non-empty ``headers`` map
    is refused before anything is sent."""
    b = own_broker
    stream = "arrow-sunk"
    _declare(b.url, stream)
    n = 2000
    df = spark.range(n, numPartitions=2).selectExpr(
        "cast(concat('r-', cast(id as string)) as binary) as value",
        "case when id % 7 = 0 then map() else cast(null as map<string,string>) end as headers")

    def write(frame: Any) -> None:
        (frame.write.format("skred").mode("append").option("uri", b.url)
         .option("streamPort", str(b.stream_port)).option("topic", stream)
         .option("exactlyOnce", "true").option("queryId", "arrow-1").save())

    conf = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "300")
    try:
        write(df)
        write(df)  # Spark's retry of the whole job, same query id: nothing added
        assert count_at(b.url, stream) == n
        bodies = _bodies(b.url, stream, n)
        assert sorted(bodies) == sorted(b"r-%d" % i for i in range(n))
        per_task = [[int(x[2:]) for x in bodies if (int(x[2:]) < n // 2) == first] for first in (True, False)]
        assert all(ids == sorted(ids) for ids in per_task)  # each task's rows in order
        with_headers = df.selectExpr("value", "map('k', 'v') as headers")
        with pytest.raises(Exception, match="carries no headers"):
            write(with_headers)
        assert count_at(b.url, stream) == n
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", conf)
