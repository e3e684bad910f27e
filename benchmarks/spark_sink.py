#!/usr/bin/env python3
"""The Spark sink's task body without Spark: rows/s of one task for each ``confirmWindow``.

Each window is measured on the sink's three paths: at least once over AMQP (``amqp_sink.py``:
the link layer's connection, a whole Arrow batch framed at once, confirms counted by tag),
``exactlyOnce`` to the stream (the stream protocol, ``stream_publish.py``) and ``exactlyOnce``
to a deduplicating fanout exchange bound to it (AMQP, each row's id in its properties). The peer in the
same run is what the AMQP path was before: a general client library (aiormq) publishing one
row at a time with confirms, ``confirmWindow`` rows in flight (``--aiormq-rows``, few: it
runs at a few hundred rows/s).

One private ``skred`` process on free ports and a temp data dir; for each window, ``--rows``
rows (~12-byte values, Arrow batches of 10,000) are published to a fresh stream, with
confirms, and rows/s, the client's and the broker's CPU per row are printed. CPU per row is
what to compare on a loaded machine: a quiet core each for task and broker allows
1 / max(client, broker) rows/s.
Spark's per-job cost (a JVM, Python workers) is left out, so this isolates the publishing.

    python benchmarks/spark_sink.py --rows 400000 --windows 20000 --aiormq-rows 3000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pika

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from stream import cpu_seconds  # noqa: E402 - benchmarks/stream.py: a process tree's CPU

from broker.spark.sink import _Sink  # noqa: E402
from tests.integration._support import SkredProcess  # noqa: E402

BATCH = 10_000  # rows per Arrow batch: Spark's spark.sql.execution.arrow.maxRecordsPerBatch


def _batches(n: int) -> list[Any]:
    """``n`` rows as Spark hands them to a task: Arrow batches (built before the clock starts,
    as Spark builds them in the JVM)."""
    import pyarrow as pa

    return [pa.record_batch([pa.array([b"value-%d" % i for i in range(lo, min(lo + BATCH, n))],
                                      pa.binary())], names=["value"])
            for lo in range(0, n, BATCH)]


class _Schema:
    def fieldNames(self) -> list[str]:  # noqa: N802 - pyspark's StructType method
        return ["value"]


def _declare(url: str, stream: str, dedup: bool = False) -> None:
    """A stream; with ``dedup``, also ``<stream>.in``, a deduplicating fanout exchange to it."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
    if dedup:
        ch.exchange_declare(stream + ".in", "fanout", durable=True, arguments={
            "x-message-deduplication": True, "x-cache-size": 1_000_000})
        ch.queue_bind(stream, stream + ".in")
    conn.close()


def _row(what: str, rows: int, wall: float, cpu: float, bcpu: float) -> None:
    print(f"| {what} | {rows / wall:,.0f} | {cpu / rows * 1e6:,.1f} | {bcpu / rows * 1e6:,.1f} |")


async def _aiormq(url: str, stream: str, batches: list[Any], window: int) -> None:
    """The AMQP path as it was: a publish per row with confirms, ``window`` in flight."""
    import aiormq
    from pamqp.commands import Basic

    conn = await aiormq.connect(url)
    ch = await conn.channel(publisher_confirms=True)
    props = Basic.Properties(delivery_mode=2)
    inflight: collections.deque[Any] = collections.deque()
    for batch in batches:
        for value in batch.column("value").to_pylist():
            if len(inflight) >= window:
                await inflight.popleft()
            publish = ch.basic_publish(value, routing_key=stream, properties=props)
            inflight.append(asyncio.ensure_future(publish))
    for fut in inflight:
        await fut
    await conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--windows", default="1,1000")
    ap.add_argument("--amqp-rows", type=int, default=None,
                    help="rows for the AMQP path (default: --rows; 0 skips it)")
    ap.add_argument("--aiormq-rows", type=int, default=2000,
                    help="rows for the peer: aiormq, a row at a time (0 skips it)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="skred-sink-bench-") as tmp:
        broker = SkredProcess(Path(tmp) / "data")
        broker.start()
        try:
            amqp_rows = args.rows if args.amqp_rows is None else args.amqp_rows
            print(f"| one task (rows: stream path {args.rows:,}, AMQP {amqp_rows:,}) | rows/s "
                  "| client CPU µs/row | broker CPU µs/row |\n| --- | --- | --- | --- |")
            for window in args.windows.split(","):
                for exactly in ("false", "true", "exchange"):
                    n = args.rows if exactly == "true" or args.amqp_rows is None else args.amqp_rows
                    if not n:
                        continue
                    stream = f"bench-{window}-{exactly}"
                    _declare(broker.url, stream, dedup=exactly == "exchange")
                    topic = stream + ".in" if exactly == "exchange" else stream
                    sink = _Sink({"uri": broker.url, "topic": topic,
                                  "confirmWindow": window, "exactlyOnce": str(exactly != "false").lower(),
                                  "streamPort": str(broker.stream_port)}, _Schema())
                    rows = _batches(n)
                    assert broker.pid is not None
                    t0, c0, b0 = time.perf_counter(), time.process_time(), cpu_seconds(broker.pid)
                    out = asyncio.run(sink._publish(iter(rows), "bench", 0, 0))
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    bcpu = cpu_seconds(broker.pid) - b0
                    how = {"false": "AMQP (links)", "true": "exactlyOnce, stream protocol",
                           "exchange": "exactlyOnce, deduplicating exchange (AMQP)"}[exactly]
                    _row(f"confirmWindow {window}, {how}", out.rows, wall, cpu, bcpu)
                if args.aiormq_rows:
                    stream = f"bench-{window}-aiormq"
                    _declare(broker.url, stream)
                    rows = _batches(args.aiormq_rows)
                    t0, c0, b0 = time.perf_counter(), time.process_time(), cpu_seconds(broker.pid)
                    asyncio.run(_aiormq(broker.url, stream, rows, int(window)))
                    _row(f"confirmWindow {window}, peer: aiormq, a row at a time", args.aiormq_rows,
                         time.perf_counter() - t0, time.process_time() - c0, cpu_seconds(broker.pid) - b0)
        finally:
            broker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
