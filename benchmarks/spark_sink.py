#!/usr/bin/env python3
"""The Spark sink's task body without Spark: rows/s of one task for each ``confirmWindow``.

Each window is measured twice: at least once (AMQP over aiormq, a frame per row) and with
``exactlyOnce`` to the stream (the stream protocol: a window of rows framed by hand and written
with one call, ``broker/spark/stream_publish.py``).

One private ``skred`` process on free ports and a temp data dir; for each window, ``--rows``
rows (~10-byte values) are published by the sink's own task code (``broker.spark.sink``) to a
fresh stream, with confirms, and the wall seconds and the client's CPU seconds are printed.
Spark's per-job cost (a JVM, Python workers) is left out, so this isolates the publishing.
The windows run one after the other in one run: quote their ratio, and the machine's load.

    python benchmarks/spark_sink.py --rows 20000 --windows 100,1000
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

from broker.spark.sink import _Sink  # noqa: E402
from tests.integration._support import SkredProcess  # noqa: E402


class _Row:
    def __init__(self, value: bytes) -> None:
        self.value = value

    def asDict(self) -> dict[str, Any]:  # noqa: N802 - pyspark's Row method
        return {"value": self.value}


class _Schema:
    def fieldNames(self) -> list[str]:  # noqa: N802 - pyspark's StructType method
        return ["value"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--windows", default="1,1000")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="skred-sink-bench-") as tmp:
        broker = SkredProcess(Path(tmp) / "data")
        broker.start()
        try:
            print(f"| {args.rows:,} rows, one task | rows/s | client CPU µs/row |\n| --- | --- | --- |")
            for window in args.windows.split(","):
                for exactly in ("false", "true"):
                    stream = f"bench-{window}-{exactly}"
                    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
                    conn.channel().queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
                    conn.close()
                    sink = _Sink({"uri": broker.url, "topic": stream, "confirmWindow": window,
                                  "exactlyOnce": exactly, "streamPort": str(broker.stream_port)}, _Schema())
                    rows = (_Row(b"value-%d" % i) for i in range(args.rows))
                    t0, c0 = time.perf_counter(), time.process_time()
                    out = asyncio.run(sink._publish(rows, "bench", 0, 0))
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    how = "exactlyOnce, stream protocol" if exactly == "true" else "AMQP (aiormq)"
                    print(f"| confirmWindow {window}, {how} | {out.rows / wall:,.0f} "
                          f"| {cpu / out.rows * 1e6:,.0f} |")
        finally:
            broker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
