"""Where vhosts and queues live in the data directory.

Directory names are the SHA-1 hex of the entity name, so any name (slashes, unicode, 255
bytes, NUL) maps to a safe, fixed-length file name; the real name is kept inside the
directory as UTF-8 (``.vhost`` / ``.queue``, ``write_name``), for people and tools reading a
data dir: the broker itself finds its queues through the definitions log.

A deleted queue's directory is first renamed to a *tombstone* next to it (``tombstone_path``:
its name, a token unique to this run and the delete, and ``TOMBSTONE_SUFFIX``), which the
segment worker removes (``segment_log``). No live name ends with the suffix (those are 40 hex
digits, or ``prio.NNN`` inside a queue's), so a boot's sweep removes every tombstone and never a
live queue's files, and replication, which never hears of a tombstone, never counts one.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from pathlib import Path
from typing import Final

from broker.store.sink import NULL_SINK, ReplicationSink


def _sha1_hex(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8"), usedforsecurity=False).hexdigest()


def vhost_dir(data_dir: Path, vhost: str) -> Path:
    return data_dir / _sha1_hex(vhost)


WORKERS_DIR = "workers"  # a multi-worker node's per-worker data dirs: broker/shards/layout.py


def data_homes(root: Path) -> list[Path]:
    """Every data dir a vhost's directory may be in: the node's, then each worker's."""
    found = [root]
    workers = root / WORKERS_DIR
    if workers.is_dir():
        found.extend(sorted((p for p in workers.iterdir() if p.is_dir() and p.name.isdigit()),
                            key=lambda p: int(p.name)))
    return found


def find_vhost_dir(root: Path, vhost: str) -> Path:
    """The directory of ``vhost`` under a node's data dir ``root``, whichever worker keeps it
    (for readers of a node's files from outside, such as the Spark source); the node's own
    place when no data dir holds it yet."""
    for home in data_homes(root):
        found = vhost_dir(home, vhost)
        if found.is_dir():
            return found
    return vhost_dir(root, vhost)


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


TOMBSTONE_SUFFIX: Final = ".deleted"
TOMBSTONE_INSIDE: Final = TOMBSTONE_SUFFIX + "/"  # in a path inside a tombstone
_RUN: Final = f"{time.time_ns():x}"  # tombstones of two runs never share a name
_deletes = itertools.count()


def tombstone_path(directory: str) -> str:
    """A name, unused so far, for ``directory`` deleted: beside it (a rename stays inside the
    filesystem), ending with ``TOMBSTONE_SUFFIX``."""
    return f"{directory}.{_RUN}-{next(_deletes)}{TOMBSTONE_SUFFIX}"


def in_tombstone(rel: str) -> bool:
    """Whether the relative POSIX path ``rel`` is a tombstone or lies inside one."""
    return rel.endswith(TOMBSTONE_SUFFIX) or TOMBSTONE_INSIDE in rel
