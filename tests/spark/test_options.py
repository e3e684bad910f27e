"""Kafka's source options on the ``skred`` format (data dir mode): each one honoured, and an
unknown option refused instead of ignored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands

from broker.store.paths import queue_dir, vhost_dir, write_name
from broker.store.stream_store import StreamStore

T0 = 1_700_000_000_000
N = 120


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("skred-options")
    nested = bytes(commands.Basic.Properties(
        headers={"tags": ["a", 1], "meta": {"k": "v", "n": 2}, "plain": 7}).marshal())
    for name in ("orders", "orders-eu", "audit"):
        d = queue_dir(vhost_dir(root, "/"), name)
        store = StreamStore(d, segment_size=1024)
        write_name(d / ".queue", name)
        for i in range(N):
            store.append(T0 + i * 1000, b"", name.encode(), nested, b"%s-%d" % (name.encode(), i))
        store.close()
    return root


def _load(spark: Any, root: Path, **opts: str) -> Any:
    r = spark.read.format("skred").option("data_dir", str(root)).option("pushdown", "false")
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_unknown_option_refused(spark: Any, root: Path) -> None:
    with pytest.raises(Exception, match="unknown option.*startingoffsett"):
        _load(spark, root, subscribe="orders", startingOffsett="earliest").count()
    with pytest.raises(Exception, match="exactly one of"):
        _load(spark, root, subscribe="orders", assign='{"audit": [0]}').count()


def test_subscribe_pattern_assign(spark: Any, root: Path) -> None:
    df = _load(spark, root, subscribe="orders,audit")
    got = {(r.topic, r.partition): r["count"] for r in df.groupBy("topic", "partition").count().collect()}
    assert got == {("orders", 0): N, ("audit", 0): N}
    pat = _load(spark, root, subscribePattern="orders.*")
    assert sorted(r.topic for r in pat.select("topic").distinct().collect()) == ["orders", "orders-eu"]
    assert _load(spark, root, assign=json.dumps({"audit": [0]})).count() == N
    with pytest.raises(Exception, match="only partition 0"):
        _load(spark, root, assign=json.dumps({"audit": [3]})).count()


def test_offsets_and_timestamps(spark: Any, root: Path) -> None:
    spec = json.dumps({"orders": {"0": 10}, "audit": {"0": -2}})
    end = json.dumps({"orders": {"0": 15}, "audit": {"0": 3}})
    rows = _load(spark, root, subscribe="orders,audit", startingOffsets=spec, endingOffsets=end).collect()
    assert sorted((r.topic, r.offset) for r in rows) == \
        [("audit", 0), ("audit", 1), ("audit", 2)] + [("orders", o) for o in range(10, 15)]
    ts = _load(spark, root, subscribe="orders", startingTimestamp=str(T0 + 100_000),
               endingTimestamp=str(T0 + 105_000))
    assert sorted(r.offset for r in ts.select("offset").collect()) == list(range(100, 105))
    by = _load(spark, root, subscribe="orders",
               startingOffsetsByTimestamp=json.dumps({"orders": {"0": T0 + 117_000}}))
    assert sorted(r.offset for r in by.select("offset").collect()) == [117, 118, 119]


def test_split_by_min_partitions_and_max_records(spark: Any, root: Path) -> None:
    one = _load(spark, root, subscribe="audit", startingOffsets=json.dumps({"audit": {"0": 100}}))
    base = one.rdd.getNumPartitions()
    split = _load(spark, root, subscribe="audit", startingOffsets=json.dumps({"audit": {"0": 100}}),
                  maxRecordsPerPartition="3")
    assert split.rdd.getNumPartitions() >= 7 > base
    assert sorted(r.offset for r in split.select("offset").collect()) == list(range(100, N))
    mp = _load(spark, root, subscribe="audit", minPartitions="40")
    assert mp.rdd.getNumPartitions() >= 40
    assert mp.count() == N


def test_schema_headers_json(spark: Any, root: Path) -> None:
    plain = _load(spark, root, subscribe="orders")
    assert plain.columns[:7] == ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType"]
    assert "headers" not in plain.columns
    row = _load(spark, root, subscribe="orders", includeHeaders="true").where("offset = 5").first()
    assert row.key == "orders" and row.value == b"orders-5" and row.timestampType == 1
    assert json.loads(row.headers["tags"]) == ["a", 1]
    assert json.loads(row.headers["meta"]) == {"k": "v", "n": 2}
    assert row.headers["plain"] == "7"


def test_fail_on_data_loss(spark: Any, tmp_path: Path) -> None:
    d = queue_dir(vhost_dir(tmp_path, "/"), "short")
    store = StreamStore(d, segment_size=512)
    for i in range(60):
        store.append(T0 + i, b"", b"k", b"\x00\x00", b"x%d" % i)
    while store.first_offset < 20:
        store._delete_oldest()  # what retention does: whole segments from the front
    first = store.first_offset
    store.close()
    start = json.dumps({"short": {"0": 0}})
    with pytest.raises(Exception, match="removed by retention"):
        _load(spark, tmp_path, subscribe="short", startingOffsets=start).count()
    got = _load(spark, tmp_path, subscribe="short", startingOffsets=start, failOnDataLoss="false")
    assert sorted(r.offset for r in got.select("offset").collect()) == list(range(first, 60))


# Offsets per trigger for the availableNow test: 2 * N = 240 offsets in at least three batches
# (each micro-batch is seconds of a loaded machine: three show the limit as well as five did).
PER_TRIGGER = 80


def test_rate_limits_available_now(spark: Any, root: Path, tmp_path: Path) -> None:
    q = (spark.readStream.format("skred").option("data_dir", str(root)).option("subscribe", "orders,audit")
         .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", str(PER_TRIGGER)).load()
         .select("topic", "offset").writeStream.format("parquet").option("path", str(tmp_path / "out"))
         .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sum(sizes) == 2 * N and max(sizes) <= PER_TRIGGER and len(sizes) >= -(-2 * N // PER_TRIGGER), sizes
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    assert sorted((r.topic, r.offset) for r in rows) == \
        sorted([("audit", o) for o in range(N)] + [("orders", o) for o in range(N)])
