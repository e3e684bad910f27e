"""PriorityStore: a priority queue made of one ``QueueStore`` per priority level.

Theory of operation
-------------------
A queue declared with ``x-max-priority`` keeps one FIFO ``QueueStore`` per priority
level that has ever held a message: level 0 is the queue directory itself (so a
queue's files look the same as a plain queue's until a prioritised message
arrives), level ``n`` lives in the sub-directory ``prio.NNN``. Sub-stores are
created on first use and re-opened at recovery by scanning for those
directories, so priorities survive a restart with no extra bookkeeping: the
level of a stored message is the directory it sits in.

A msgid is ``level << 64 | inner msgid``; the inner msgid is the sub-store's
(segment << 32 | position), so any msgid names its store without a lookup
table. ``shift``/``peek`` serve the highest non-empty level first; within a
level the order is the sub-store's (requeued first, then publish order). The
rest of the ``QueueStore`` interface fans out to the sub-stores or sums them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from broker.store.queue_store import QueueStore

_SHIFT = 64
_INNER = (1 << _SHIFT) - 1
_PREFIX = "prio."


class PriorityStore:
    def __init__(self, base: QueueStore, max_priority: int) -> None:
        self.directory = base.directory
        self.max_priority = max_priority
        self._base = base
        self._levels: dict[int, QueueStore] = {0: base}
        self._order: list[int] = [0]  # levels present, highest first
        for entry in os.scandir(self.directory):
            if entry.is_dir() and entry.name.startswith(_PREFIX):
                try:
                    level = int(entry.name[len(_PREFIX):])
                except ValueError:
                    continue
                if 0 < level <= 255:
                    self._open(level)

    def _open(self, level: int) -> QueueStore:
        store = self._levels.get(level)
        if store is None:
            b = self._base
            store = QueueStore(self.directory / f"{_PREFIX}{level:03d}",
                               segment_size=b._segment_size, sink=b._sink,
                               persistent_only=b._persistent_only, notify=b._notify,
                               write_through=b._through, files=b._files)
            self._levels[level] = store
            self._order = sorted(self._levels, reverse=True)
        return store

    def _of(self, msgid: int) -> tuple[QueueStore, int]:
        return self._levels[msgid >> _SHIFT], msgid & _INNER

    # ------------------------------------------------------------------ publishing
    def append(self, timestamp_ms: int, exchange: bytes, routing_key: bytes,
               props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int:
        return self.append_priority(0, timestamp_ms, exchange, routing_key, props, body)

    def level_of(self, priority: int) -> int:
        """The level a message with this ``priority`` property is stored at."""
        return max(0, min(priority, self.max_priority))

    def append_priority(self, priority: int, timestamp_ms: int, exchange: bytes, routing_key: bytes,
                        props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int:
        level = self.level_of(priority)
        store = self._levels.get(level) or self._open(level)
        return (level << _SHIFT) | store.append(timestamp_ms, exchange, routing_key, props, body)

    # ------------------------------------------------------------------ consuming
    def head_level(self) -> int | None:
        """The level the next ``shift`` takes from (None: nothing is ready)."""
        for level in self._order:
            if self._levels[level].ready_count:
                return level
        return None

    def shift(self) -> int | None:
        return self._head(True)

    def peek(self) -> int | None:
        return self._head(False)

    def _head(self, take: bool) -> int | None:
        level = self.head_level()
        if level is None:
            return None
        store = self._levels[level]
        inner = store.shift() if take else store.peek()
        return None if inner is None else (level << _SHIFT) | inner

    @property
    def single_level(self) -> bool:
        """Nothing ready above level 0: the queue is its base store's FIFO for now, and
        deliveries may take the base store's runs (``deliver_run``, ``next_delivery``,
        ``end_pass``: level 0 msgids are the base store's own)."""
        levels = self._levels
        return len(levels) == 1 or not any(s.ready_count for level, s in levels.items() if level)

    def deliver_run(self, k: int, autoack: bool, deliver: Callable[[int, bytes, bytes, bytes, bool], None],
                    max_bytes: int,
                    deliver_same: Callable[[range, bytes, bytes, list[bytes]], None] | None = None,
                    ) -> tuple[int, int, int]:
        return self._base.deliver_run(k, autoack, deliver, max_bytes, deliver_same)

    def next_delivery(self, autoack: bool) -> tuple[int, bytes, bytes, bytes, bool] | None:
        return self._base.next_delivery(autoack)

    def end_pass(self) -> None:
        self._base.end_pass()

    def read(self, msgid: int) -> tuple[int, bytes, bytes, bytes, bytes]:
        store, inner = self._of(msgid)
        return store.read(inner)

    def read_body_size(self, msgid: int) -> int:
        store, inner = self._of(msgid)
        return store.read_body_size(inner)

    def ack(self, msgid: int) -> None:
        store, inner = self._of(msgid)
        store.ack(inner)

    def requeue(self, msgid: int) -> None:
        store, inner = self._of(msgid)
        store.requeue(inner)

    def is_redelivered(self, msgid: int) -> bool:
        store, inner = self._of(msgid)
        return store.is_redelivered(inner)

    @property
    def counting(self) -> bool:
        return any(s.counting for s in self._levels.values())

    def count_of(self, msgid: int) -> int:
        store, inner = self._of(msgid)
        return store.count_of(inner)

    def set_count(self, msgid: int, count: int) -> None:
        store, inner = self._of(msgid)
        store.set_count(inner, count)

    def forget_count(self, msgid: int) -> None:
        store, inner = self._of(msgid)
        store.forget_count(inner)

    def purge(self) -> int:
        return sum(s.purge() for s in list(self._levels.values()))

    # ------------------------------------------------------------------ counters
    @property
    def ready_count(self) -> int:
        return sum(s.ready_count for s in self._levels.values())

    @property
    def unacked_count(self) -> int:
        return sum(s.unacked_count for s in self._levels.values())

    @property
    def bytes_ready(self) -> int:
        return sum(s.bytes_ready for s in self._levels.values())

    @property
    def dirty(self) -> bool:
        return any(s.dirty for s in list(self._levels.values()))

    # ------------------------------------------------------------------ durability
    def flush(self) -> None:
        for s in list(self._levels.values()):
            s.flush()

    def stored_props(self) -> Iterator[tuple[int, bytes]]:
        """(msgid, properties) of every stored message, level by level (see QueueStore)."""
        for level, inner in list(self._levels.items()):
            for msgid, props in inner.stored_props():
                yield (level << _SHIFT) | msgid, props

    def sync(self, full: bool = False, fsync: bool = True) -> None:
        # Runs on the syncer's worker thread: iterate over a snapshot of the levels.
        for s in list(self._levels.values()):
            s.sync(full, fsync)

    def close(self) -> None:
        for s in list(self._levels.values()):
            s.close()

    def delete(self) -> None:
        for level, s in list(self._levels.items()):
            if level:
                s.delete()
        self._base.delete()


class QuorumPriorityStore(PriorityStore):
    HIGH_ABOVE = 4  # AMQP 1.0 / RabbitMQ 4: priorities 0-4 are normal, 5 and up high
    WEIGHT = 2  # high deliveries per normal one while both levels wait

    def __init__(self, base: QueueStore) -> None:
        super().__init__(base, 1)
        self._turn = 0  # deliveries since the last "older head" turn

    def level_of(self, priority: int) -> int:
        return 1 if priority > self.HIGH_ABOVE else 0

    def head_level(self) -> int | None:
        normal = self._base
        high = self._levels.get(1)
        has_high = high is not None and high.ready_count > 0
        if not normal.ready_count:
            return 1 if has_high else None
        if not has_high:
            return 0
        assert high is not None
        if self._turn < self.WEIGHT:
            return 1
        n_head, h_head = normal.peek(), high.peek()
        if n_head is None or h_head is None:
            return 1 if n_head is None else 0
        return 0 if normal.read_timestamp(n_head) <= high.read_timestamp(h_head) else 1

    def shift(self) -> int | None:
        high = self._levels.get(1)
        both = self._base.ready_count > 0 and high is not None and high.ready_count > 0
        msgid = super().shift()
        if both:  # the turn counts only while both levels wait, so deliveries taken as runs
            # from the base store (``single_level``) leave it where a one-by-one pass would
            self._turn = 0 if self._turn >= self.WEIGHT else self._turn + 1
        return msgid


def sub_directory(directory: Path, level: int) -> Path:
    """Where level ``level`` of a priority queue in ``directory`` keeps its files."""
    return directory / f"{_PREFIX}{level:03d}"
