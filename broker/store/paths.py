"""Where vhosts and queues live in the data directory.

Directory names are the SHA-1 hex of the entity name, so any name (slashes, unicode, 255
bytes, NUL) maps to a safe, fixed-length file name; the real name is kept inside the
directory as UTF-8 (``.vhost`` / ``.queue``, ``write_name``), for people and tools reading a
data dir: the broker itself finds its queues through the definitions log.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from broker.store.sink import NULL_SINK, ReplicationSink


def _sha1_hex(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8"), usedforsecurity=False).hexdigest()


def vhost_dir(data_dir: Path, vhost: str) -> Path:
    return data_dir / _sha1_hex(vhost)


def queue_dir(vhost_dir: Path, queue: str) -> Path:
    return vhost_dir / _sha1_hex(queue)


def write_name(path: Path, name: str, sink: ReplicationSink = NULL_SINK, *,
               replicate_existing: bool = False) -> None:
    """Keep ``name`` (UTF-8, whatever the locale) in the marker file ``path`` unless it is there.
    ``replicate_existing``: send it to the followers even if it was there (made ahead of the
    declare, off the event loop: a definitions import)."""
    data = name.encode("utf-8")
    if not path.exists():
        path.write_bytes(data)
    elif not replicate_existing:
        return
    if sink.active:
        sink.replace(path, data)


def queue_path(vhost_dir: str, queue: str) -> str:
    """``queue_dir`` as a ``str``: a boot makes one per durable queue, and a ``Path`` costs
    about as much as the rest of replaying the queue's declaration."""
    return os.path.join(vhost_dir, _sha1_hex(queue))
