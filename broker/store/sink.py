"""The replication seam of the store.

Theory of operation: the store owns this interface and the cluster layer implements it
(lower layers own the interfaces upper layers implement). Every mutation of a persistent
file made by the store is reported here, in the order it happens:

* ``register_file(path)`` when an append-only file is created,
* ``append(path, data)`` for bytes added at the end of a file (segment records, ack
  positions, definition records); ``data`` is only valid during the call, copy it if kept,
* ``replace(path, data)`` when a whole file is rewritten (compaction, JSON stores, meta,
  recovery trimming a corrupt tail),
* ``delete(path)`` when a file is removed.

``append`` reports the logical content: a segment is its header plus complete records,
never the preallocated zero tail. Hot paths test ``sink.active`` first, so the single-node
``NullSink`` costs one attribute read per mutation. Sink methods are called on the thread
that calls the mutating store method (the event loop thread); ``QueueStore.sync()``, which
runs on a worker thread, never calls the sink.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Protocol


class ReplicationSink(Protocol):
    active: bool

    def register_file(self, path: Path) -> None: ...

    def append(self, path: Path, data: bytes | bytearray | memoryview) -> None: ...

    def replace(self, path: Path, data: bytes) -> None: ...

    def delete(self, path: Path) -> None: ...

    async def wait_for_followers(self) -> None: ...


class NullSink:
    """The single-node sink: nothing to replicate."""

    active: bool = False

    def register_file(self, path: Path) -> None:
        pass

    def append(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        pass

    def replace(self, path: Path, data: bytes) -> None:
        pass

    def delete(self, path: Path) -> None:
        pass

    async def wait_for_followers(self) -> None:
        pass


# Stateless, so one shared instance is safe; used as the default argument everywhere.
NULL_SINK: Final = NullSink()
