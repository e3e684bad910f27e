"""An intent file: a change that spans many files, written down whole before it is applied.

Theory of operation
-------------------
Some changes touch many files one after another: a definitions import writes ``users.json``,
``vhosts.json``, every vhost's ``definitions.amqp``, policies and limits. A crash (kill -9,
power loss, a leader lost mid-way) between two of those writes would keep a random prefix of
the change. So the whole change is first written to one intent file (JSON, replaced
atomically: tmp + fsync + rename + fsync of the directory, ``jsonstore.write_json``, and
reported to the replication sink), then applied, then made durable, and only then is the
intent file removed (unlink + fsync of the directory, reported to the sink as a delete).

On start-up the owner reads ``pending()`` before it serves anything: a change that is still
written down was cut off somewhere in its application and is applied again, in full. The
change must therefore be idempotent (applying it to a state that already holds a prefix of
it gives the same result as applying it once), which a definitions import is: it leaves
entries that already exist identically alone. Before the intent file is durable nothing of
the change has been applied; after it is, the change comes back whole. Either way a restart
finds all of it or none of it. Followers receive the intent file, the writes of the change and
the delete in that order, so a follower that takes over resumes the change the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.store.fileio import fsync_dir
from broker.store.jsonstore import read_json, write_json
from broker.store.sink import NULL_SINK, ReplicationSink


class IntentFile:
    def __init__(self, path: Path, sink: ReplicationSink = NULL_SINK) -> None:
        self.path = path
        self._sink = sink

    def pending(self) -> Any:
        """The change written down and not yet done, or None (StoreError if unreadable)."""
        return read_json(self.path, None)

    def begin(self, change: Any) -> None:
        """Write ``change`` down, durably, before any of it is applied (DiskFull: not begun)."""
        write_json(self.path, change, self._sink)

    def done(self) -> None:
        """The change is applied and durable: forget it."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.path.parent)
        if self._sink.active:
            self._sink.delete(self.path)
