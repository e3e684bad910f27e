"""Batch reads of the ``skred`` source from a data dir: equality, pruning, filters."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands

from broker.store.paths import queue_dir, vhost_dir
from broker.store.stream_store import StreamStore

T0 = 1_700_000_000_000  # ms


def _props(i: int) -> bytes:
    headers = {"i": i, "kind": "even" if i % 2 == 0 else "odd"}
    p = commands.Basic.Properties(content_type="application/json", delivery_mode=2, headers=headers,
                                  message_id=f"m{i}" if i % 3 == 0 else None)
    return bytes(p.marshal())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("skred-data")
    store = StreamStore(queue_dir(vhost_dir(root, "/"), "events"), segment_size=4096)
    published = []
    for i in range(500):
        body = b"body-%d" % i * (1 + i % 5)
        off = store.append(T0 + i * 1000, b"amq.topic", b"rk.%d" % (i % 4), _props(i), body)
        published.append({"offset": off, "ts": T0 + i * 1000, "rk": f"rk.{i % 4}", "body": body, "i": i})
    store.close()
    return root, published


def _load(spark: Any, root: Path, **opts: str) -> Any:
    r = (spark.read.format("skred").option("data_dir", str(root)).option("vhost", "/")
         .option("queue", "events").option("pushdown", "true").option("includeHeaders", "true"))
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_batch_equals_published(spark: Any, data_dir: tuple[Path, list[dict[str, Any]]]) -> None:
    root, published = data_dir
    df = _load(spark, root)
    assert df.rdd.getNumPartitions() > 5  # one partition per segment
    # Unordered: a scan's order is offset order (partitions are segments in log order), which the
    # row-by-row comparison below checks too; no orderBy (a shuffle stage) and no second scan.
    rows = df.collect()
    assert len(rows) == len(published)
    for row, pub in zip(rows, published, strict=True):
        assert row.offset == pub["offset"]
        assert row.value == pub["body"]
        assert row.key == pub["rk"] and row.exchange == "amq.topic"
        assert row.headers == {"i": str(pub["i"]), "kind": "even" if pub["i"] % 2 == 0 else "odd"}
        assert row.properties.content_type == "application/json"
        assert row.properties.delivery_mode == 2
        assert row.properties.message_id == (f"m{pub['i']}" if pub["i"] % 3 == 0 else None)
        ts = row.timestamp.replace(tzinfo=datetime.UTC) if row.timestamp.tzinfo is None else row.timestamp
        assert int(ts.timestamp() * 1000) == pub["ts"]
    assert [pub["offset"] for pub in published] == list(range(500))


def test_offset_filters_prune_segments(spark: Any, data_dir: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = data_dir
    df = _load(spark, root)
    got = [r.offset for r in df.where("offset >= 100 AND offset < 120").select("offset").collect()]
    assert got == list(range(100, 120))
    assert df.where("offset = 499").count() == 1
    assert df.where("offset > 1000").count() == 0
    # Pruning: the pushed-down filter leaves only the segments holding those offsets.
    from pyspark.sql.datasource import GreaterThanOrEqual, LessThan

    from broker.spark.source import SkredDataSource, SkredPushdownReader

    src = SkredDataSource({"data_dir": str(root), "queue": "events", "pushdown": "true"})
    reader = src.reader(df.schema)
    assert isinstance(reader, SkredPushdownReader)
    all_parts = len(reader.partitions())
    kept = list(reader.pushFilters([GreaterThanOrEqual(("offset",), 100), LessThan(("offset",), 120)]))
    assert len(kept) == 2  # still evaluated by Spark: pruning never changes results
    pruned = reader.partitions()
    assert 1 <= len(pruned) <= 2 < all_parts
    assert all(p.start >= 100 or p.stop > 100 for p in pruned)
    # Options work without filter pushdown too.
    opt = _load(spark, root, startingOffset="490", endingOffset="495", pushdown="false")
    assert [r.offset for r in opt.select("offset").collect()] == [490, 491, 492, 493, 494]


def test_timestamp_filters(spark: Any, data_dir: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = data_dir
    df = _load(spark, root)
    lo = datetime.datetime.fromtimestamp((T0 + 200_000) / 1000, datetime.UTC)
    hi = datetime.datetime.fromtimestamp((T0 + 209_000) / 1000, datetime.UTC)
    from pyspark.sql import functions as F

    got = [r.offset for r in df.where((F.col("timestamp") >= F.lit(lo)) & (F.col("timestamp") <= F.lit(hi)))
           .select("offset").collect()]
    assert got == list(range(200, 210))
    later = df.where(F.col("timestamp") > F.lit(hi)).count()
    assert later == 500 - 210


def test_routing_key_counts_example(spark: Any, data_dir: tuple[Path, list[dict[str, Any]]]) -> None:
    import importlib.util
    import sys

    root, published = data_dir
    path = Path(__file__).resolve().parents[2] / "examples" / "spark_routing_key_counts.py"
    spec = importlib.util.spec_from_file_location("spark_routing_key_counts", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["spark_routing_key_counts"] = mod
    spec.loader.exec_module(mod)
    df = _load(spark, root)
    rows = mod.routing_key_counts(df).collect()
    assert sum(r["messages"] for r in rows) == len(published)
    # one message per second -> 60 per minute, spread over 4 routing keys
    first_minute = {r["routing_key"]: r["messages"] for r in rows if r["minute"] == rows[0]["minute"]}
    assert sum(first_minute.values()) <= 60
