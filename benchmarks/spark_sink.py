#!/usr/bin/env python3
"""The Spark sink's task body without Spark: rows/s of one task for each ``confirmWindow``.

Each window is measured twice: at least once (AMQP over aiormq, a frame per row) and with
``exactlyOnce`` to the stream (the stream protocol: a window of rows framed by hand and written
with one call, ``broker/spark/stream_publish.py``).

One private ``skred`` process on free ports and a temp data dir; for each window, ``--rows``
rows (~10-byte values, Arrow batches of 10,000) are published by the sink's own task code
(``broker.spark.sink``) to a fresh stream, with confirms, and rows/s, the client's and the
broker's CPU per row are printed.
Spark's per-job cost (a JVM, Python workers) is left out, so this isolates the publishing.
The windows run one after the other in one run: quote their ratio, and the machine's load.

    python benchmarks/spark_sink.py --rows 20000 --windows 100,1000 [--amqp-rows 5000]
"""

from __future__ import annotations

import argparse
import asyncio
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--windows", default="1,1000")
    ap.add_argument("--amqp-rows", type=int, default=None,
                    help="rows for the AMQP path (default: --rows; 0 skips it)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="skred-sink-bench-") as tmp:
        broker = SkredProcess(Path(tmp) / "data")
        broker.start()
        try:
            amqp_rows = args.rows if args.amqp_rows is None else args.amqp_rows
            print(f"| one task (rows: stream path {args.rows:,}, AMQP {amqp_rows:,}) | rows/s "
                  "| client CPU µs/row | broker CPU µs/row |\n| --- | --- | --- | --- |")
            for window in args.windows.split(","):
                for exactly in ("false", "true"):
                    n = args.rows if exactly == "true" or args.amqp_rows is None else args.amqp_rows
                    if not n:
                        continue
                    stream = f"bench-{window}-{exactly}"
                    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
                    conn.channel().queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
                    conn.close()
                    sink = _Sink({"uri": broker.url, "topic": stream, "confirmWindow": window,
                                  "exactlyOnce": exactly, "streamPort": str(broker.stream_port)}, _Schema())
                    rows = _batches(n)
                    assert broker.pid is not None
                    t0, c0, b0 = time.perf_counter(), time.process_time(), cpu_seconds(broker.pid)
                    out = asyncio.run(sink._publish(iter(rows), "bench", 0, 0))
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    bcpu = cpu_seconds(broker.pid) - b0
                    how = "exactlyOnce, stream protocol" if exactly == "true" else "AMQP (links)"
                    print(f"| confirmWindow {window}, {how} | {out.rows / wall:,.0f} "
                          f"| {cpu / out.rows * 1e6:,.1f} | {bcpu / out.rows * 1e6:,.1f} |")
        finally:
            broker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
