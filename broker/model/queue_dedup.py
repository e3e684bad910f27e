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

from broker import properties

DEDUP_ARG = "x-message-deduplication"
DEDUP_HEADER = "x-deduplication-header"
_NAMES = (DEDUP_HEADER.encode(),)


def key_of(props: bytes | memoryview) -> str | None:
    """The message's ``x-deduplication-header`` value as text, or None."""
    if len(props) < 2 or not props[0] & properties.HI_HEADERS:
        return None
    raw = bytes(props)
    if b"x-deduplication-header" not in raw:
        return None  # the common case: headers, but not ours; no walk
    value: Any = properties.header_values(raw, _NAMES)[0]
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
    """(msgid, properties) of every stored message (QueueStore/PriorityStore.stored_props)."""
    scan = getattr(store, "stored_props", None)
    if scan is None:
        return iter(())
    result: Iterator[tuple[int, bytes]] = scan()
    return result
