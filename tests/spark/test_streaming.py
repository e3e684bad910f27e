"""Structured Streaming from the ``skred`` source: checkpoint restart, exactly once."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from broker.store.paths import queue_dir, vhost_dir
from broker.store.stream_store import StreamStore


def _append(store: StreamStore, start: int, n: int) -> None:
    for i in range(start, start + n):
        store.append(1_700_000_000_000 + i, b"", b"rk.%d" % (i % 3), b"\x00\x00", b"%d" % i)


def _end(progress: dict[str, Any]) -> int:
    end = progress["sources"][0]["endOffset"]
    return int((json.loads(end) if isinstance(end, str) else end)["live"]["0"])  # Kafka's shape


def test_stream_restart_from_checkpoint_exactly_once(spark: Any, tmp_path: Path) -> None:
    root = tmp_path / "data"
    store = StreamStore(queue_dir(vhost_dir(root, "/"), "live"), segment_size=2048)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def start_query(trigger: dict[str, Any]) -> Any:
        df = (spark.readStream.format("skred").option("data_dir", str(root)).option("queue", "live")
              .option("startingOffsets", "earliest").option("maxRecordsPerTrigger", "70").load())
        return (df.select("offset", "value").writeStream.format("parquet").option("path", str(out))
                .option("checkpointLocation", str(ckpt)).trigger(**trigger).start())

    def processed() -> list[int]:
        if not any(out.glob("*.parquet")):
            return []
        return sorted(int(r.value) for r in spark.read.parquet(str(out)).collect())

    try:
        _append(store, 0, 150)
        q = start_query({"availableNow": True})
        assert q.awaitTermination(90)
        first = processed()
        assert first == list(range(150))

        _append(store, 150, 60)  # arrives while the query is stopped
        q = start_query({"processingTime": "200 milliseconds"})
        writer = threading.Thread(target=_append, args=(store, 210, 90))  # ... and while it runs
        try:
            writer.start()
            writer.join(30)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                progress = q.lastProgress
                if progress and _end(progress) == 300 and not q.status["isDataAvailable"]:
                    break
                q.awaitTermination(0.2)  # bounded poll of the running query
            else:
                raise AssertionError(f"query did not catch up: {q.lastProgress}")
        finally:
            q.stop()
        rows = spark.read.parquet(str(out)).collect()  # one read for both checks
        got = sorted(int(r.value) for r in rows)
        assert got == list(range(300)), (len(got), len(set(got)))
        # Offsets in the output equal the bodies: every message once, in its place.
        assert sorted(r.offset for r in rows) == list(range(300))
    finally:
        store.close()
