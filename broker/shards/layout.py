"""Where a multi-worker node keeps its files.

One worker (``[main] workers = 1``) keeps today's layout: everything directly in the data
dir. With N > 1 the node-wide files stay where they are (``users.json``, ``vhosts.json``,
``global_parameters.json``: shared state, ``broker.shards.worker``) and each worker has a
data dir of its own, ``<data_dir>/workers/<i>/``, holding its lock, its transient queues
and the directories of the vhosts it owns (``<sha1(vhost)>/`` as before). A vhost's
segment files belong to exactly one worker.

When the number of workers changes, the shard map moves some vhosts: the parent, before
any worker starts, renames each moved vhost's directory to its new owner's data dir
(``relocate``; a rename within one file system, so a vhost is either here or there).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from broker.shards.placement import worker_of
from broker.store.fileio import fsync_dir
from broker.store.paths import WORKERS_DIR, data_homes, vhost_dir

log = logging.getLogger(__name__)


def worker_dir(root: Path, index: int, count: int) -> Path:
    """The data dir of worker ``index`` of ``count`` (the node's own with one worker)."""
    return root if count <= 1 else root / WORKERS_DIR / str(index)


def relocate(root: Path, vhosts: list[str], count: int,
             files: dict[str, int] | None = None) -> list[tuple[str, Path, Path]]:
    """Move each vhost's directory to the data dir of its owner among ``count`` workers, and
    each of ``files`` (a file or directory name in a data dir -> the worker that keeps it:
    MQTT's retained messages, LMQ's properties); what moved, as (name, from, to). Run while no
    worker runs."""
    moved = []
    places = data_homes(root)
    wanted: list[tuple[str, int, Callable[[Path, str], Path]]]
    wanted = [(name, worker_of(name, count), vhost_dir) for name in vhosts]
    wanted += [(entry, index, _named) for entry, index in (files or {}).items()]
    for label, index, where in wanted:
        base = worker_dir(root, index, count)
        target = where(base, label)
        if target.exists():
            continue
        for home in places:
            source = where(home, label)
            if source != target and source.exists():
                base.mkdir(parents=True, exist_ok=True)
                os.rename(source, target)
                fsync_dir(source.parent)
                fsync_dir(base)
                log.info("%r moved to %s (workers: %d)", label, base, count)
                moved.append((label, source, target))
                break
    return moved


def _named(base: Path, name: str) -> Path:
    return base / name
