#!/usr/bin/env python3
"""CPU per row of the Spark source's two network reads, as a task runs them, without Spark.

One private ``skred`` process; a stream filled with ``--rows`` messages of ``--size`` bytes over
the stream protocol (``_streamload.py``). Then, one after the other, the same range is read:

- ``raw records``: ``uri=http://...`` (``broker/spark/netread.py``): the management port's raw
  segment records, decoded column-wise (``segment_arrow``) into Arrow batches;
- ``amqp``: ``uri=amqp://...`` (``broker/spark/amqp.py``): a stream consumer over AMQP.

Each read builds the Arrow record batches a Spark task would hand over (``segment_batch`` /
``to_batch``, the source's schema with headers). Reported per row: the task's CPU (this
process, ``time.process_time``) and the broker's CPU (its process group's user+system time
from ``/proc``), and rows per wall second. CPU times hold up on a loaded machine, wall rates
do not: say how loaded it was when quoting them.

    python benchmarks/spark_netread.py --rows 500000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import _streamload  # noqa: E402

from tests.integration._support import SkredProcess  # noqa: E402


def _tree_cpu(pid: int) -> float:
    """User + system seconds of ``pid`` and every process in its group (the broker's workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pid:  # process group id
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _measure(label: str, rows: int, broker_pid: int, read: Callable[[], Iterator[Any]]) -> str:
    b0, t0, w0 = _tree_cpu(broker_pid), time.process_time(), time.perf_counter()
    got = sum(batch.num_rows for batch in read())
    wall = time.perf_counter() - w0
    task, broker = time.process_time() - t0, _tree_cpu(broker_pid) - b0
    assert got == rows, (label, got, rows)
    return (f"| {label} | {task / rows * 1e6:.2f} | {broker / rows * 1e6:.2f} | {rows / wall:,.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=20, help="body bytes per message")
    args = ap.parse_args(argv)
    from broker.spark import amqp, netread
    from broker.spark.rows import PropsDecoder, segment_batch, to_batch
    from tests.test_spark_segment_arrow import NAMES as names  # the source's schema, built without a JVM
    from tests.test_spark_segment_arrow import PA_SCHEMA as pa_schema

    n = args.rows
    with tempfile.TemporaryDirectory(prefix="skred-netread-bench-") as tmp:
        node = SkredProcess(Path(tmp) / "data")
        node.start()
        try:
            asyncio.run(_streamload.publish(node.stream_port, "bench", n, args.size, 500, 8, 600))
            assert node.proc is not None
            http = f"http://guest:guest@{node.host}:{node.mgmt_port}"

            def raw() -> Iterator[Any]:
                decoder = PropsDecoder()
                with netread.RecordsClient(http, "/") as c:
                    for seg in netread.read_columns(c, "bench", 0, n, 65536, netread.DEFAULT_MAX_BYTES,
                                                    None, None, lambda lo, hi: None):
                        yield segment_batch(seg, pa_schema, decoder, names, "bench", 0)

            def over_amqp() -> Iterator[Any]:
                decoder = PropsDecoder()
                for cols in amqp.read_columns(node.url, "bench", 0, n, 65536):
                    yield to_batch(cols, pa_schema, decoder, names, "bench", 0)

            sum(b.num_rows for b in raw())  # warm-up: imports, the broker's page cache
            print(f"| {n:,} rows of {args.size} B, one task | task CPU µs/row | broker CPU µs/row | rows/s |")
            print("| --- | --- | --- | --- |")
            for label, read in (("raw records (http)", raw), ("amqp consume", over_amqp),
                                ("raw records (http), again", raw)):
                print(_measure(label, n, node.proc.pid, read), flush=True)
        finally:
            node.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
