"""Queue-level message deduplication (``x-message-deduplication`` on a queue).

Theory of operation
-------------------
A queue declared with ``x-message-deduplication: true`` refuses a message whose
``x-deduplication-header`` value belongs to a message still in the queue
(ready or delivered-but-unacked), as RabbitMQ's deduplication plugin does for
queues. The refused message is dropped silently; under publisher confirms it
is still confirmed with an ack (the plugin behaves the same way). Messages
without the header are never deduplicated.

``QueueDedup`` keeps, in memory, the header value of every such message in the
queue: ``ids`` maps msgid -> value and ``keys`` counts values (a count rather
than a set so that two stored messages with one value -- impossible through
the publish path, but harmless if found on disk -- cannot forget each other).
``QueueFeatures`` reports every way a message leaves the queue (ack, no-ack
delivery, reject/dead-letter, expiry, drop-head, purge) with ``removed``; the
value may be published again from then on.

Purge drops only ready messages. The store does not say which msgids are
unacked, so ``out`` records the msgids taken by a delivery or ``basic.get``
(and forgets them on requeue); after a purge only those keep their value.

Restart: a restarted queue holds every unacked message as ready again, so
``rebuild`` walks the recovered store once at declare (before any delivery,
only for a deduplicating queue with messages) and reads only the properties of
each unacked record. Nothing else is persisted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from broker.amqp import codec
from broker.store.segment import HEADER_SIZE, U32, record_end

DEDUP_ARG = "x-message-deduplication"
DEDUP_HEADER = "x-deduplication-header"
_FLAG_HEADERS = 0x20
_PRIO_SHIFT = 64  # PriorityStore msgid = level << 64 | inner msgid


def key_of(props: bytes | memoryview) -> str | None:
    """The message's ``x-deduplication-header`` value as text, or None."""
    if len(props) < 2 or not props[0] & _FLAG_HEADERS:
        return None
    raw = bytes(props)
    if b"x-deduplication-header" not in raw:
        return None  # the common case: headers, but not ours; no decode
    headers = codec.decode_properties(raw).headers
    if not headers:
        return None
    value: Any = headers.get(DEDUP_HEADER)
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode(errors="replace")
    return str(value)


class QueueDedup:
    __slots__ = ("ids", "keys", "out")

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}
        self.keys: dict[str, int] = {}
        self.out: set[int] = set()

    def __len__(self) -> int:
        return len(self.ids)

    def is_duplicate(self, key: str) -> bool:
        return key in self.keys

    def added(self, msgid: int, key: str) -> None:
        self.ids[msgid] = key
        self.keys[key] = self.keys.get(key, 0) + 1

    def removed(self, msgid: int) -> None:
        key = self.ids.pop(msgid, None)
        if key is None:
            return
        self.out.discard(msgid)
        n = self.keys[key] - 1
        if n:
            self.keys[key] = n
        else:
            del self.keys[key]

    def taken(self, msgid: int) -> None:
        """Delivered or fetched, not yet acked: survives a purge."""
        if msgid in self.ids:
            self.out.add(msgid)

    def returned(self, msgid: int) -> None:
        """Requeued: ready again."""
        self.out.discard(msgid)

    def purged(self) -> None:
        """Every ready message is gone; the unacked (``out``) ones stay."""
        for msgid in [m for m in self.ids if m not in self.out]:
            self.removed(msgid)

    def clear(self) -> None:
        self.ids.clear()
        self.keys.clear()
        self.out.clear()

    def rebuild(self, store: object) -> int:
        """Boot: the values of the messages recovered in ``store``; returns how many."""
        self.clear()
        for msgid, props in _stored_props(store):
            key = key_of(props)
            if key is not None:
                self.added(msgid, key)
        return len(self.ids)


def _stored_props(store: object) -> Iterator[tuple[int, bytes]]:
    """(msgid, properties) of every unacked record of a freshly recovered store.

    Reads the store's recovered segment table (``_order``/``_segs``, each
    segment's ``acked`` positions); a ``PriorityStore`` is walked level by
    level. Only valid before the first delivery, when nothing is requeued.
    Segments it had to map are unmapped again so a long queue does not stay
    resident.
    """
    levels: dict[int, object] | None = getattr(store, "_levels", None)
    if levels is not None:
        for level, inner in list(levels.items()):
            for msgid, props in _stored_props(inner):
                yield (level << _PRIO_SHIFT) | msgid, props
        return
    order: list[int] = getattr(store, "_order", [])
    segs: dict[int, Any] = getattr(store, "_segs", {})
    for num in list(order):
        seg = segs.get(num)
        if seg is None or len(seg.acked) >= seg.count:
            continue
        mapped_here = seg.mm is None
        mm = seg.map_read() if mapped_here else seg.mm
        try:
            pos = HEADER_SIZE
            end = seg.end
            acked = seg.acked
            while pos < end:
                if pos not in acked:
                    # record: i64 ts, u8+exchange, u8+routing key, u32+props, u64+body
                    p = pos + 8
                    p_at = p + 1 + mm[p]
                    p_at += 1 + mm[p_at]
                    plen = U32.unpack_from(mm, p_at)[0]
                    yield (num << 32) | pos, bytes(mm[p_at + 4 : p_at + 4 + plen])
                pos = record_end(mm, pos)[0]
        finally:
            if mapped_here:
                seg.unmap()
