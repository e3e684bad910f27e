"""What the model may ask of a queue's store: the store's side of the queue engine.

Lower layers own the interfaces upper layers use (STYLE.md habit 6), so the model names
these protocols instead of casting one store to another's type:

- ``QueueCounters``: what every queue's store shows the rest of the broker (the management
  API, metrics, the group commit): counters, flush, sync, close, delete. ``QueueStore``,
  ``PriorityStore`` and ``StreamStore`` provide it.
- ``MessageStore``: the ordered store the classic queue engine (``broker.model.queue``)
  runs on: append (one, a run, or taken by a consumer at once), take from the head
  (``shift``/``next_delivery``/``deliver_run``), read, settle (ack, requeue, purge), and
  keep the messages' delivery counts.
  ``QueueStore`` (one FIFO) and ``PriorityStore`` (one FIFO per priority level, highest
  first) provide it; the stream's append-only log does not (a stream reads by offset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

# msgid, exchange and routing key (the stored short-string pair), props, body, redelivered
Delivery = tuple[int, bytes, bytes, bytes, bool]
DeliverOne = Callable[[int, bytes, bytes, bytes, bool], None]
DeliverSame = Callable[[range, bytes, bytes, list[bytes]], None]
DeliverMany = Callable[[list[int], bytes, list[bytes], list[bytes]], None]


class QueueCounters(Protocol):
    @property
    def unread(self) -> bool:
        """Its directory is not read yet (boot's deferred recovery): every counter below would
        read it first, so a periodic reader (the rates sampler) passes it by."""

    @property
    def ready_count(self) -> int: ...

    @property
    def unacked_count(self) -> int: ...

    @property
    def bytes_ready(self) -> int: ...

    def make_room(self, size: int, props: bytes | memoryview, timestamp_ms: int) -> None:
        """Allocate ``size`` bytes of records' room where a message with ``props`` goes
        (DiskFull before anything is written): the full-disk all-or-nothing rule."""

    def flush(self) -> None: ...

    def sync(self, full: bool = False, fsync: bool = True) -> None: ...

    def close(self) -> None: ...

    def delete(self) -> None: ...


class MessageStore(QueueCounters, Protocol):
    # ---------------------------------------------------------------- append
    def append(self, timestamp_ms: int, exchange: bytes, routing_key: bytes,
               props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int: ...

    def append_run(self, timestamp_ms: int, exrk: bytes, props: list[bytes], bodies: list[bytes],
                   same: bool) -> None: ...

    def append_taken(self, timestamp_ms: int, exchange: bytes, routing_key: bytes,
                     props: bytes | memoryview, body: bytes | bytearray | memoryview) -> int: ...

    def append_run_taken(self, timestamp_ms: int, exrk: bytes, props: list[bytes], bodies: list[bytes],
                         same: bool) -> list[int] | None: ...

    # ---------------------------------------------------------------- take
    def shift(self) -> int | None: ...

    def peek(self) -> int | None: ...

    def next_delivery(self, autoack: bool) -> Delivery | None: ...

    def deliver_run(self, k: int, autoack: bool, deliver: DeliverOne, max_bytes: int,
                    deliver_same: DeliverSame | None = None,
                    deliver_many: DeliverMany | None = None) -> tuple[int, int, int]: ...

    def end_pass(self) -> None: ...

    def read(self, msgid: int) -> tuple[int, bytes, bytes, bytes, bytes]: ...

    def is_redelivered(self, msgid: int) -> bool: ...

    def stored_props(self) -> Iterator[tuple[int, bytes]]: ...

    # ---------------------------------------------------------------- settle
    def ack(self, msgid: int) -> None: ...

    def ack_many(self, msgids: list[int]) -> None: ...

    def requeue(self, msgid: int) -> None: ...

    def purge(self) -> int: ...

    # ---------------------------------------------------------------- delivery counts
    # (x-delivery-count and the delivery limit: durable like acks, see delivery_counts.py)
    @property
    def counting(self) -> bool: ...

    def count_of(self, msgid: int) -> int: ...

    def set_count(self, msgid: int, count: int) -> None: ...

    def forget_count(self, msgid: int) -> None: ...
