#!/usr/bin/env python3
"""Rows per second through the ``skred`` Spark format, side by side in one run.

One private ``skred`` process on free ports and a temp data dir, one ``local[2]`` SparkSession:

- ``write``: ``df.write.format("skred")`` of ``--rows`` rows (~10-byte values) to a stream, with
  publisher confirms (the sink), then the same with ``exactlyOnce=true`` to a deduplicating
  exchange bound to a stream and to that stream over the stream protocol;
- ``read dir``: a batch count and a full-row scan (sum of value lengths) of the stream from the
  data dir (Arrow batches from the segment files);
- ``read http``: the same over the network as raw segment records from the management port
  (``uri=http://...``, ``minPartitions=2``);
- ``read amqp``: the same over the network by consuming over AMQP (``uri=amqp://...``).

Each figure is rows / wall seconds of one Spark action, after one warm-up action (for the sink,
a 1,000-row write, which starts the Python workers of a write); the JVM and
the broker share the machine, so say how loaded it was when quoting them. A write also shows
the CPU per row of Spark's side (this process's tree: the JVM and its Python workers) and of
the broker, the steadier figures on a loaded machine.

    python benchmarks/spark.py --rows 200000
    python benchmarks/spark.py --rows 20000 --sink-only --confirm-window 1   # one row per round trip
    python benchmarks/spark.py --rows 5000000 --read-only   # data-dir and http reads only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from stream import cpu_seconds  # noqa: E402 - benchmarks/stream.py: a process tree's CPU

from tests.integration._support import SkredProcess  # noqa: E402


def timed(what: str, rows: int, action: Callable[[], Any],
          broker_pid: int | None = None) -> tuple[str, str]:
    """rows/s of ``action``; with ``broker_pid``, also the CPU per row of Spark's side (this
    process's tree: the JVM and its Python workers) and of the broker, over the action."""
    c0 = (cpu_seconds(os.getpid()), cpu_seconds(broker_pid)) if broker_pid else (0.0, 0.0)
    t0 = time.perf_counter()
    action()
    seconds = time.perf_counter() - t0
    figure = f"{rows / seconds:,.0f}"
    if broker_pid:
        total, broker = cpu_seconds(os.getpid()) - c0[0], cpu_seconds(broker_pid) - c0[1]
        figure += f" | {(total - broker) / rows * 1e6:.1f} | {broker / rows * 1e6:.1f}"
    return what, figure


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--sink-only", action="store_true", help="measure the sink only, not the reads")
    ap.add_argument("--read-only", action="store_true",
                    help="fill the stream with one untimed write; measure the data-dir and http reads only")
    ap.add_argument("--confirm-window", type=int, default=0,
                    help="the sink's confirmWindow (default: the sink's own)")
    args = ap.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from broker.spark import register

    with tempfile.TemporaryDirectory(prefix="skred-spark-bench-") as tmp:
        broker = SkredProcess(Path(tmp) / "data")
        broker.start()
        spark = (SparkSession.builder.master("local[2]").appName("skred-bench")
                 .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        try:
            conn = pika.BlockingConnection(pika.URLParameters(broker.url))
            ch = conn.channel()
            for name in ("bench", "bench-eo", "bench-warm"):
                ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream"})
            ch.exchange_declare("bench-eo.in", "fanout", durable=True, arguments={
                "x-message-deduplication": True, "x-cache-size": args.rows + 1})
            ch.queue_bind("bench-eo", "bench-eo.in")
            conn.close()
            n = args.rows
            rows = spark.range(n).select(F.concat(F.lit("value-"), F.col("id").cast("string"))
                                         .cast("binary").alias("value")).repartition(2).cache()
            rows.count()
            sink = rows.write.format("skred").mode("append").option("uri", broker.url)
            if args.confirm_window:
                sink = sink.option("confirmWindow", str(args.confirm_window))
            # warm-up: the first write starts Spark's Python workers for the writer, its tasks
            # and the commit (seconds each on a loaded machine), which would be charged to it
            rows.limit(1000).write.format("skred").mode("append").option("uri", broker.url) \
                .option("topic", "bench-warm").save()
            if args.read_only:
                sink.option("topic", "bench").save()
            pid = broker.pid
            results = [] if args.read_only else [
                timed("sink, confirms", n, lambda: sink.option("topic", "bench").save(), pid),
                timed("sink, exactlyOnce (deduplicating exchange)", n,
                      lambda: sink.option("topic", "bench-eo.in").option("exactlyOnce", "true").save(), pid),
                timed("sink, exactlyOnce (stream protocol)", n, lambda: sink.option("topic", "bench-eo")
                      .option("exactlyOnce", "true").option("streamPort", str(broker.stream_port)).save(),
                      pid),
            ]

            http = f"http://guest:guest@{broker.host}:{broker.mgmt_port}"

            def load(**opts: str) -> Any:
                r = spark.read.format("skred").option("subscribe", "bench")
                for k, v in opts.items():
                    r = r.option(k, v)
                return r.load()

            def scan(df: Any) -> Any:
                return df.select(F.sum(F.length("value"))).collect()

            reads = () if args.sink_only else (("data dir", {"data_dir": str(broker.data_dir)}),
                                               ("http", {"uri": http, "minPartitions": "2"}),
                                               ("amqp", {"uri": broker.url, "minPartitions": "2"}))
            reads = reads[:2] if args.read_only else reads
            for label, opts in reads:
                load(**opts).count()  # warm-up
                results.append(timed(f"read {label}, count", n, lambda o=opts: load(**o).count()))
                results.append(timed(f"read {label}, scan", n, lambda o=opts: scan(load(**o))))
            print(f"| {n:,} rows, local[2] | rows/s | Spark CPU µs/row (JVM, Python workers) "
                  "| broker CPU µs/row |\n| --- | --- | --- | --- |")
            for what, figure in results:
                print(f"| {what} | {figure} |" + ("" if "|" in figure else " | |"))
        finally:
            spark.stop()
            broker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
