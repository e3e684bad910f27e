"""Filter pushdown ``auto`` (the default): prunes when the session allows it, reads correctly
(pruning by the offset options only) when ``spark.sql.python.filterPushdown.enabled`` is off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.store.paths import queue_dir, vhost_dir
from broker.store.stream_store import StreamStore

T0 = 1_700_000_000_000
N = 300
CONF = "spark.sql.python.filterPushdown.enabled"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("skred-pushdown")
    store = StreamStore(queue_dir(vhost_dir(root, "/"), "events"), segment_size=1024)
    for i in range(N):
        store.append(T0 + i * 1000, b"x", b"rk", b"\x00\x00", b"body-%d" % i)
    store.close()
    return root


@pytest.fixture
def pushdown_off(spark: Any) -> Iterator[None]:
    old = spark.conf.get(CONF, None)
    spark.conf.unset(CONF)  # Spark's default: off
    try:
        yield
    finally:
        if old is not None:
            spark.conf.set(CONF, old)


def _load(spark: Any, root: Path, **opts: str) -> Any:
    r = spark.read.format("skred").option("data_dir", str(root)).option("queue", "events")
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def _offsets(df: Any) -> list[int]:
    return sorted(r.offset for r in df.select("offset").collect())


def test_auto_pushdown_prunes_when_session_allows(spark: Any, root: Path) -> None:
    assert spark.conf.get(CONF) == "true"  # the shared session turns it on
    df = _load(spark, root)  # no pushdown option: auto
    total = df.rdd.getNumPartitions()
    assert total > 8
    narrow = df.where("offset >= 100 AND offset < 110")
    assert _offsets(narrow) == list(range(100, 110))
    assert narrow.rdd.getNumPartitions() <= 2 < total  # segments pruned by the pushed filter


def test_auto_without_session_setting_reads_correctly(spark: Any, root: Path, pushdown_off: None) -> None:
    df = _load(spark, root)
    total = df.rdd.getNumPartitions()
    narrow = df.where("offset >= 100 AND offset < 110")
    assert _offsets(narrow) == list(range(100, 110))  # no DATA_SOURCE_PUSHDOWN_DISABLED error
    assert narrow.rdd.getNumPartitions() == total  # nothing pushed: every segment is read
    # the offset options still prune
    opt = _load(spark, root, startingOffset="100", endingOffset="110")
    assert _offsets(opt) == list(range(100, 110))
    assert opt.rdd.getNumPartitions() <= 2 < total
    # forcing pushdown without the session setting is Spark's error, not a wrong answer
    with pytest.raises(Exception, match="PUSHDOWN"):
        _load(spark, root, pushdown="true").where("offset < 5").collect()


def test_pushdown_false_and_bad_option(spark: Any, root: Path) -> None:
    df = _load(spark, root, pushdown="false")
    total = df.rdd.getNumPartitions()
    narrow = df.where("offset >= 100 AND offset < 110")
    assert _offsets(narrow) == list(range(100, 110))
    assert narrow.rdd.getNumPartitions() == total
    with pytest.raises(Exception, match="pushdown"):
        _load(spark, root, pushdown="maybe").collect()
