"""The ``skred`` source in AMQP mode (``option("uri", ...)``) against a real broker process.

The module starts one ``python -m broker`` on free loopback ports (``SkredProcess``, stopped by its
process group at teardown), publishes with pika, and checks that AMQP-mode rows equal both what was
published and what data-dir mode reads from the same (running) broker's files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from integration._support import SkredProcess, count_at, queue_count  # free ports per xdist worker

pika = pytest.importorskip("pika")

REPO = Path(__file__).resolve().parents[2]
N = 1000


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    node = SkredProcess(tmp_path_factory.mktemp("skred-amqp") / "data")
    try:
        node.start()
        yield node
    finally:
        node.close()


@pytest.fixture(scope="module")
def broker(node: SkredProcess) -> tuple[str, Path]:
    return node.url, node.data_dir


@pytest.fixture(scope="module")
def published(broker: tuple[str, Path]) -> list[dict[str, Any]]:
    url, _data = broker
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.queue_declare("events", durable=True, arguments={
            "x-queue-type": "stream", "x-stream-max-segment-size-bytes": 16384})
        ch.confirm_delivery()
        out = []
        for i in range(N):
            body = b"amqp-%d" % i * (1 + i % 3)
            headers = {"i": i, "kind": "even" if i % 2 == 0 else "odd"}
            ch.basic_publish("", "events", body, pika.BasicProperties(
                content_type="text/plain", delivery_mode=2, headers=headers,
                message_id=f"m{i}" if i % 5 == 0 else None))
            out.append({"body": body, "i": i})
        return out
    finally:
        conn.close()


def _amqp(spark: Any, url: str, **opts: str) -> Any:
    r = (spark.read.format("skred").option("uri", url).option("queue", "events")
         .option("timeout", "20").option("includeHeaders", "true"))
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_amqp_mode_equals_published(spark: Any, broker: tuple[str, Path],
                                    published: list[dict[str, Any]]) -> None:
    url, data = broker
    df = _amqp(spark, url, numPartitions="3")
    assert df.rdd.getNumPartitions() == 3
    # Sorted here, not by orderBy: a Spark sort is a shuffle stage (more Python workers and
    # tasks) for a thousand rows, seconds of a loaded machine that prove nothing more.
    rows = sorted(df.collect(), key=lambda r: r.offset)
    assert [r.offset for r in rows] == list(range(N))
    for row, pub in zip(rows, published, strict=True):
        i = pub["i"]
        assert row.value == pub["body"]
        assert row.exchange == "" and row.key == "events"
        assert row.headers == {"i": str(i), "kind": "even" if i % 2 == 0 else "odd"}
        assert row.properties.content_type == "text/plain"
        assert row.properties.delivery_mode == 2
        assert row.properties.message_id == (f"m{i}" if i % 5 == 0 else None)
    # Data-dir mode over the running broker's files gives the same rows.
    files = sorted(spark.read.format("skred").option("data_dir", str(data)).option("queue", "events")
                   .option("includeHeaders", "true").load().collect(), key=lambda r: r.offset)
    assert [(r.offset, r.value, r.headers, r.timestamp) for r in files] == \
        [(r.offset, r.value, r.headers, r.timestamp) for r in rows]


def test_amqp_mode_offset_bounds(spark: Any, broker: tuple[str, Path],
                                 published: list[dict[str, Any]]) -> None:
    url, _data = broker
    df = _amqp(spark, url, startingOffset="990", endingOffset="995")
    got = sorted(df.collect(), key=lambda r: r.offset)
    assert [r.offset for r in got] == [990, 991, 992, 993, 994]
    assert [r.value for r in got] == [published[i]["body"] for i in range(990, 995)]
    assert _amqp(spark, url).where("offset >= 500").count() == N - 500


def test_network_read_of_raw_records(spark: Any, node: SkredProcess,
                                     published: list[dict[str, Any]]) -> None:
    """``uri=http://...``: the management port's raw records, decoded like segment files, in two
    Spark partitions over a few rows (cheap on purpose: the rows equal the other paths' over
    mixed records in tests/integration/test_stream_records.py, without Spark)."""
    http = f"http://guest:guest@{node.host}:{node.mgmt_port}"
    df = (spark.read.format("skred").option("uri", http).option("queue", "events")
          .option("includeHeaders", "true").option("numPartitions", "2")
          .option("startingOffsets", '{"events": {"0": 7}}')
          .option("endingOffsets", '{"events": {"0": 19}}').load())
    assert df.rdd.getNumPartitions() == 2
    rows = sorted(df.collect(), key=lambda r: r.offset)  # no orderBy: no shuffle stage
    assert [r.offset for r in rows] == list(range(7, 19))
    for row, pub in zip(rows, published[7:19], strict=True):
        i = pub["i"]
        assert (row.value, row.key, row.exchange) == (pub["body"], "events", "")
        assert row.headers == {"i": str(i), "kind": "even" if i % 2 == 0 else "odd"}
        assert row.properties.message_id == (f"m{i}" if i % 5 == 0 else None)


# ------------------------------------------------------------------ the sink
SINK_N = 300


def _rows(spark: Any, target: str, late: str) -> Any:
    """SINK_N rows in 2 partitions for ``target``; row 60 of partition 1 names ``late``, a target
    that does not exist on the first run, so that task fails mid-batch after 60 confirmed rows
    (and Spark's retry succeeds once the test has made it)."""

    def gen(index: int, it: Any) -> Any:
        for n, i in enumerate(it):
            yield (b"row-%d" % i, f"k{i % 3}", late if index == 1 and n == 60 else target)

    rdd = spark.sparkContext.parallelize(range(SINK_N), 2).mapPartitionsWithIndex(gen)
    return spark.createDataFrame(rdd, "value binary, key string, topic string")


@pytest.mark.parametrize("exactly_once", [False, True])
def test_sink_task_killed_mid_batch(spark: Any, broker: tuple[str, Path], exactly_once: bool) -> None:
    """A task fails after 60 confirmed rows; the job is run again with the same query id (what
    Spark's retry does): at least once adds the confirmed rows twice, exactly once adds nothing."""
    url, _data = broker
    stream = f"sunk-{exactly_once}".lower()
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
        target = stream
        if exactly_once:
            target = stream + ".dedup"
            ch.exchange_declare(target, "fanout", durable=True, arguments={
                "x-message-deduplication": True, "x-cache-size": 10_000})
            ch.queue_bind(stream, target)
    finally:
        conn.close()

    late = stream + ".late"

    def write() -> None:
        (_rows(spark, target, late).write.format("skred").mode("append").option("uri", url)
         .option("exactlyOnce", str(exactly_once).lower()).option("queryId", "job-1").save())

    with pytest.raises(Exception, match="x-message-deduplication" if exactly_once else "Unroutable"):
        write()
    partial = count_at(url, stream)
    assert 60 <= partial < SINK_N  # some rows were confirmed before the task died
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.exchange_declare(late, "fanout", durable=True, arguments={
            "x-message-deduplication": True, "x-cache-size": 100} if exactly_once else {})
        ch.queue_bind(stream, late)
    finally:
        conn.close()
    write()  # Spark's retry of the failed job, same query id
    got = count_at(url, stream)
    if exactly_once:
        assert got == SINK_N  # the re-run added only what was missing
        rows = spark.read.format("skred").option("uri", url).option("subscribe", stream).load()
        assert sorted(r.value for r in rows.collect()) == sorted(b"row-%d" % i for i in range(SINK_N))
    else:
        assert got == SINK_N + partial  # at least once: the retried rows are there twice


def test_sink_refuses_bad_input(spark: Any, broker: tuple[str, Path]) -> None:
    url, _data = broker
    df = spark.createDataFrame([(b"x", 1)], "value binary, offset long")
    with pytest.raises(Exception, match="unknown column"):
        df.write.format("skred").mode("append").option("uri", url).option("topic", "events").save()
    ok = spark.createDataFrame([(b"x",)], "value binary")
    with pytest.raises(Exception, match="unknown option"):
        ok.write.format("skred").mode("append").option("uri", url).option("topic", "events") \
            .option("acks", "all").save()
    with pytest.raises(Exception, match="x-message-deduplication"):
        ok.write.format("skred").mode("append").option("uri", url).option("topic", "events") \
            .option("exactlyOnce", "true").save()


def test_sink_fails_the_task_on_a_nack_within_the_window(spark: Any, broker: tuple[str, Path]) -> None:
    """A queue that rejects publishes past 50 messages nacks rows in the middle of the confirm
    window: the write fails naming the nack, and only the 50 accepted rows are there."""
    url, _data = broker
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_declare("sink-nack", durable=True, arguments={
            "x-max-length": 50, "x-overflow": "reject-publish"})
    finally:
        conn.close()
    df = spark.range(200).selectExpr("cast(cast(id as string) as binary) as value").coalesce(1)
    with pytest.raises(Exception, match="nack"):
        (df.write.format("skred").mode("append").option("uri", url).option("topic", "sink-nack")
         .option("confirmWindow", "64").save())
    assert count_at(url, "sink-nack") == 50
    with pytest.raises(Exception, match="confirmWindow"):
        (df.write.format("skred").mode("append").option("uri", url).option("topic", "sink-nack")
         .option("confirmWindow", "0").save())


def _driver(url: str, ckpt: Path, target: str, log: Path) -> subprocess.Popen[bytes]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("stream_driver.py")), url, str(ckpt),
             "in-a,in-b", target], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=path), start_new_session=True)


@pytest.mark.chaos  # one more Spark driver (a JVM): minutes on a loaded machine
@pytest.mark.timeout(900, func_only=True)
def test_streaming_restart_after_driver_sigkill_exactly_once(spark: Any, broker: tuple[str, Path],
                                                             tmp_path: Path) -> None:
    """Stream -> stream through Spark; the driver (its own JVM) is killed with SIGKILL mid-query
    and the query restarted from its checkpoint in another JVM (this session's), to the end of
    the input at once: the target holds every source offset exactly once."""
    from stream_driver import writer  # pyspark: imported once the session is there

    url, _data = broker
    per = 400
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for name in ("in-a", "in-b"):
            ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream"})
            for i in range(per):
                ch.basic_publish("", name, b"%d" % i)
        ch.queue_declare("out", durable=True, arguments={"x-queue-type": "stream"})
        ch.exchange_declare("out.dedup", "fanout", durable=True, arguments={
            "x-message-deduplication": True, "x-cache-size": 10_000})
        ch.queue_bind("out", "out.dedup")
    finally:
        conn.close()
    ckpt, log = tmp_path / "ckpt", tmp_path / "driver.log"
    proc = _driver(url, ckpt, "out.dedup", log)
    # One connection polls (a connection per poll cost CPU the starting driver JVM and its Python
    # workers need: Spark gives a Python worker a fixed 10 s to connect back).
    poller = pika.BlockingConnection(pika.URLParameters(url))
    try:
        deadline = time.monotonic() + 400
        while not 0 < (queue_count(poller, "out") or 0) < 2 * per:
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, "no micro-batch landed:\n" + log.read_text(errors="replace")
            time.sleep(0.1)  # bounded poll for the first micro-batch
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        poller.close()
    mid = count_at(url, "out")
    assert mid < 2 * per
    # The restart replays the batch the kill cut short (its offsets are in the checkpoint), then
    # reads the rest in one batch (no maxOffsetsPerTrigger): every offset once all the same.
    query = writer(spark, url, str(ckpt), "in-a,in-b", "out.dedup", None).trigger(availableNow=True).start()
    try:
        assert query.awaitTermination(400), "the restarted query did not finish"
        assert query.exception() is None, query.exception()
    finally:
        query.stop()
    assert count_at(url, "out") == 2 * per
    got = _read_all(url, "out", 2 * per)
    expected = [f"{s}:{o}".encode() for s in ("in-a", "in-b") for o in range(per)]
    assert sorted(got) == sorted(expected)  # every offset once: count and checksum
    assert sum(int(v.split(b":")[1]) for v in got) == 2 * sum(range(per))


def _read_all(url: str, queue: str, n: int) -> list[bytes]:
    from broker.spark import amqp
    return [rec[5] for rec in amqp.read_range(url, queue, 0, n, 30)]
