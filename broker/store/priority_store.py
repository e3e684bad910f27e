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

``QuorumPriorityStore`` is RabbitMQ 4's message priority for quorum queues: always on, no
``x-max-priority``, exactly two levels (a ``priority`` property above 4 is high, anything
else, absent included, normal). While both levels hold ready messages, two of every three
deliveries take the high head and every third takes the *older* of the two heads (by
publish time; a tie goes to the normal one), so normal messages are never starved: a
backlog of normal messages followed by high ones drains at two high per normal, while high
messages published first are not overtaken by younger normal ones. The turn counts only
deliveries made while both levels wait; while one level does, deliveries take its runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from broker import properties
from broker.store.api import DeliverMany, DeliverOne, DeliverSame, Delivery
from broker.store.queue_store import QueueStore

_SHIFT = 64
_INNER = (1 << _SHIFT) - 1
_PREFIX = "prio."


class PriorityStore:
    unread = False  # its levels are read when it is built
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

    def level_in(self, directory: Path) -> QueueStore | None:
        """The level whose store lives in ``directory`` (level 0: the queue's own), if any."""
        for store in self._levels.values():
            if store.directory == directory:
                return store
        return None

    def _of(self, msgid: int) -> tuple[QueueStore, int]:
        return self._levels[msgid >> _SHIFT], msgid & _INNER

    def _store_for(self, props: bytes | memoryview) -> tuple[int, QueueStore]:
        """The level a message with ``props`` goes to, and that level's store."""
        level = self.level_of(properties.priority(props))
        return level, self._levels.get(level) or self._open(level)

    # ------------------------------------------------------------------ publishing
    def append(self, timestamp_ms: int, exchange: bytes, routing_key: bytes,
               props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int:
        return self.append_priority(properties.priority(props), timestamp_ms, exchange, routing_key,
                                    props, body)

    def level_of(self, priority: int) -> int:
        """The level a message with this ``priority`` property is stored at."""
        return max(0, min(priority, self.max_priority))

    def append_priority(self, priority: int, timestamp_ms: int, exchange: bytes, routing_key: bytes,
                        props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int:
        level = self.level_of(priority)
        store = self._levels.get(level) or self._open(level)
        return (level << _SHIFT) | store.append(timestamp_ms, exchange, routing_key, props, body)

    def append_taken(self, timestamp_ms: int, exchange: bytes, routing_key: bytes,
                     props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int:
        level, store = self._store_for(props)
        return (level << _SHIFT) | store.append_taken(timestamp_ms, exchange, routing_key, props, body)

    def append_run(self, timestamp_ms: int, exrk: bytes, props: list[bytes], bodies: list[bytes],
                   same: bool) -> None:
        if same:
            self._store_for(props[0])[1].append_run(timestamp_ms, exrk, props, bodies, True)
            return
        for p, body in zip(props, bodies, strict=True):
            self._store_for(p)[1].append_run(timestamp_ms, exrk, [p], [body], True)

    def append_run_taken(self, timestamp_ms: int, exrk: bytes, props: list[bytes], bodies: list[bytes],
                         same: bool) -> list[int] | None:
        """append_run(); the run stays ready (levels decide the order: deliver_run hands it on)."""
        self.append_run(timestamp_ms, exrk, props, bodies, same)
        return None

    def make_room(self, size: int, props: bytes | memoryview, timestamp_ms: int) -> None:
        """Room for ``size`` bytes in the level ``props`` go to (a run reaching a priority queue
        is published one message at a time, so one level is all it needs)."""
        self._store_for(props)[1].reserve(size)

    # ------------------------------------------------------------------ consuming
    def shift(self) -> int | None:
        for level in self._order:
            store = self._levels[level]
            if store.ready_count:
                inner = store.shift()
                if inner is not None:
                    return (level << _SHIFT) | inner
        return None

    def next_delivery(self, autoack: bool) -> Delivery | None:
        for level in self._order:
            store = self._levels[level]
            if store.ready_count:
                got = store.next_delivery(autoack)
                if got is not None:
                    return (level << _SHIFT) | got[0], got[1], got[2], got[3], got[4]
        return None

    def deliver_run(self, k: int, autoack: bool, deliver: DeliverOne, max_bytes: int,
                    deliver_same: DeliverSame | None = None,
                    deliver_many: DeliverMany | None = None) -> tuple[int, int, int]:
        """``QueueStore.deliver_run`` level by level, highest first, with the level in every msgid
        (``deliver_many`` is not used: each record goes to ``deliver`` or a run)."""
        n = red = nbytes = 0
        for level in self._order:
            store = self._levels[level]
            if n >= k or nbytes > max_bytes:
                break
            if not store.ready_count:
                continue
            one, same = _at_level(level, deliver, deliver_same) if level else (deliver, deliver_same)
            got = store.deliver_run(k - n, autoack, one, max_bytes - nbytes, same)
            n += got[0]
            red += got[1]
            nbytes += got[2]
        return n, red, nbytes

    def end_pass(self) -> None:
        for s in self._levels.values():
            s.end_pass()

    def peek(self) -> int | None:
        for level in self._order:
            store = self._levels[level]
            if store.ready_count:
                inner = store.peek()
                if inner is not None:
                    return (level << _SHIFT) | inner
        return None

    def read(self, msgid: int) -> tuple[int, bytes, bytes, bytes, bytes]:
        store, inner = self._of(msgid)
        return store.read(inner)

    def read_body_size(self, msgid: int) -> int:
        store, inner = self._of(msgid)
        return store.read_body_size(inner)

    def ack(self, msgid: int) -> None:
        store, inner = self._of(msgid)
        store.ack(inner)

    def ack_many(self, msgids: list[int]) -> None:
        by_level: dict[int, list[int]] = {}
        for msgid in msgids:
            by_level.setdefault(msgid >> _SHIFT, []).append(msgid & _INNER)
        for level, inner in by_level.items():
            self._levels[level].ack_many(inner)

    def requeue(self, msgid: int) -> None:
        store, inner = self._of(msgid)
        store.requeue(inner)

    def is_redelivered(self, msgid: int) -> bool:
        store, inner = self._of(msgid)
        return store.is_redelivered(inner)

    # delivery counts (x-delivery-count, delivery_counts.py): kept by the level's store
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
    @property
    def parts(self) -> list[QueueStore]:
        """The level stores, each of which the group commit may sync on its own."""
        return list(self._levels.values())

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

    def settle(self) -> None:
        for s in list(self._levels.values()):
            s.settle()

    def close(self) -> None:
        for s in list(self._levels.values()):
            s.close()

    def delete(self) -> None:
        for level, s in list(self._levels.items()):
            if level:
                s.delete(inside=True)  # their directories are inside the base's: one rename
        self._base.delete()


class QuorumPriorityStore(PriorityStore):
    HIGH_ABOVE = 4  # AMQP 1.0 / RabbitMQ 4: priorities 0-4 are normal, 5 and up high
    WEIGHT = 2  # high deliveries per normal one while both levels wait

    def __init__(self, base: QueueStore) -> None:
        super().__init__(base, 1)
        self._turn = 0  # deliveries (while both levels waited) since the last "older head" turn

    def level_of(self, priority: int) -> int:
        return 1 if priority > self.HIGH_ABOVE else 0

    def _both_wait(self) -> bool:
        high = self._levels.get(1)
        return self._base.ready_count > 0 and high is not None and high.ready_count > 0

    def _head_level(self) -> int | None:
        """The level the next delivery takes from; advances the turn when both levels wait."""
        normal = self._base
        high = self._levels.get(1)
        if not (high is not None and high.ready_count):
            return 0 if normal.ready_count else None
        if not normal.ready_count:
            return 1
        level = 1
        if self._turn >= self.WEIGHT:
            n_head, h_head = normal.peek(), high.peek()
            if n_head is not None and (h_head is None or normal.read_timestamp(n_head)
                                       <= high.read_timestamp(h_head)):
                level = 0
            self._turn = 0
        else:
            self._turn += 1
        return level

    def _peek_level(self) -> int | None:
        turn = self._turn
        level = self._head_level()
        self._turn = turn
        return level

    def shift(self) -> int | None:
        level = self._head_level()
        if level is None:
            return None
        inner = self._levels[level].shift()
        return None if inner is None else (level << _SHIFT) | inner

    def peek(self) -> int | None:
        level = self._peek_level()
        if level is None:
            return None
        inner = self._levels[level].peek()
        return None if inner is None else (level << _SHIFT) | inner

    def next_delivery(self, autoack: bool) -> Delivery | None:
        level = self._head_level()
        if level is None:
            return None
        got = self._levels[level].next_delivery(autoack)
        if got is None:
            return None
        return (level << _SHIFT) | got[0], got[1], got[2], got[3], got[4]

    def deliver_run(self, k: int, autoack: bool, deliver: DeliverOne, max_bytes: int,
                    deliver_same: DeliverSame | None = None,
                    deliver_many: DeliverMany | None = None) -> tuple[int, int, int]:
        """One by one while both levels wait (the weighted order), then the one level's runs."""
        n = red = nbytes = 0
        while n < k and nbytes <= max_bytes and self._both_wait():
            got = self.next_delivery(autoack)
            if got is None:
                break
            n += 1
            red += got[4]
            nbytes += len(got[3])
            deliver(*got)
        if n < k and nbytes <= max_bytes:
            more = super().deliver_run(k - n, autoack, deliver, max_bytes - nbytes, deliver_same,
                                       deliver_many)
            n, red, nbytes = n + more[0], red + more[1], nbytes + more[2]
        return n, red, nbytes


def _at_level(level: int, deliver: DeliverOne,
              deliver_same: DeliverSame | None) -> tuple[DeliverOne, DeliverSame | None]:
    """``deliver``/``deliver_same`` for a sub-store's msgids: the level goes into each msgid."""
    top = level << _SHIFT

    def one(msgid: int, exrk: bytes, props: bytes, body: bytes, redelivered: bool) -> None:
        deliver(top | msgid, exrk, props, body, redelivered)

    if deliver_same is None:
        return one, None
    run = deliver_same

    def same(msgids: range, exrk: bytes, props: bytes, bodies: list[bytes]) -> None:
        run(range(top | msgids.start, top | msgids.stop, msgids.step), exrk, props, bodies)

    return one, same


def sub_directory(directory: Path, level: int) -> Path:
    """Where level ``level`` of a priority queue in ``directory`` keeps its files."""
    return directory / f"{_PREFIX}{level:03d}"
