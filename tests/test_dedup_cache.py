"""The durable deduplication cache (broker/model/dedup_cache.py) against the memory one: the
same answers while it runs, the same entries after its store is reopened (cleanly, or as a
kill -9 leaves it), its disk bounded by its size, and a forgotten key gone for good. Real
stores in tmp_path, no sockets."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from _file_calls import worker_idle
from pamqp import commands

from broker import properties
from broker.model.dedup_cache import DedupCache, DurableDedupCache, dedup_cache
from broker.store.queue_store import QueueStore

SEGMENT = 4096  # small segments, so eviction must delete some


def _open(d: Path, size: int, ttl: int | None = None) -> DurableDedupCache:
    return DurableDedupCache(size, ttl, QueueStore(d, segment_size=SEGMENT))


def _killed(cache: DurableDedupCache, to: Path, size: int, ttl: int | None = None) -> DurableDedupCache:
    """The cache's files as a kill -9 leaves them (written, nothing flushed, trimmed or closed),
    copied to ``to`` once the segment worker is idle, and opened there."""
    worker_idle()
    shutil.copytree(cache.store.directory, to)
    return _open(to, size, ttl)


def _props(key: str) -> bytes:
    return properties.encode(commands.Basic.Properties(headers={"x-deduplication-header": key}))


def test_answers_and_recovery_match_the_memory_cache(tmp_path: Path) -> None:
    rng = random.Random(30)
    mem = DedupCache(8, 1000)
    disk = _open(tmp_path / "c", 8, 1000)
    now = 10**12
    for step in range(3000):
        now += rng.randrange(3)
        key = f"k{rng.randrange(20)}"
        ttl = rng.choice([None, None, None, 5, 2000])
        assert disk.seen(key, ttl, now) == mem.seen(key, ttl, now), step
        if rng.random() < 0.2:  # written as runs of a few keys (a run's may evict each other)
            disk.write()
        if step % 1000 == 999:
            disk.write()
            if step == 999:
                disk.close()  # a clean stop
                disk = _open(tmp_path / "c", 8, 1000)
            else:
                disk = _killed(disk, tmp_path / f"c{step}", 8, 1000)
            assert list(disk.entries.items()) == list(mem.entries.items())  # in order, oldest first
    disk.close()


def test_disk_is_bounded_by_the_size(tmp_path: Path) -> None:
    d = tmp_path / "c"
    cache = _open(d, 100)
    for i in range(5_000):
        assert not cache.seen(f"key-{i:08d}", None)
        if i % 7 == 0:
            cache.write()
    cache.write()
    cache.store.flush()
    segments = [n for n in os.listdir(d) if n.startswith("msgs.")]
    # 100 live records of ~40 bytes fit two 4 KiB segments; 5,000 records would need ~50
    assert len(segments) <= 3, segments
    cache.close()
    cache = _open(d, 100)
    assert list(cache.entries) == [f"key-{i:08d}" for i in range(4_900, 5_000)]
    assert cache.seen("key-00004999", None) and not cache.seen("key-00000001", None)
    cache.close()


def test_a_forgotten_key_stays_forgotten_after_a_kill(tmp_path: Path) -> None:
    d = tmp_path / "c"
    cache = _open(d, 10)
    assert not cache.seen("a", None)
    cache.write()
    assert not cache.seen("b", None)
    cache.write()
    cache.forget([_props("a")])  # its message was not stored (a full disk)
    assert not cache.seen("a", None)  # new again
    cache.write()
    cache.forget([_props("a")])
    reopened = _killed(cache, tmp_path / "killed", 10)
    assert list(reopened.entries) == ["b"]
    reopened.close()


def test_persistence_kinds(tmp_path: Path) -> None:
    def store() -> QueueStore:
        return QueueStore(tmp_path / "s", segment_size=SEGMENT)

    args = {"x-cache-size": 5}
    assert isinstance(dedup_cache(args, "x", True, store), DurableDedupCache)
    assert not dedup_cache(args, "x", False, store).durable  # a transient exchange: memory
    assert not dedup_cache({**args, "x-cache-persistence": "memory"}, "x", True, store).durable
    assert dedup_cache({**args, "x-cache-persistence": b"disk"}, "x", True, store).durable
