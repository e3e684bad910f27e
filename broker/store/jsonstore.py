"""JSON stores (users.json, vhosts.json, policies.json, ...).

Durability rule: a JSON file is always replaced whole, via tmp + fsync + rename + fsync of
the directory (``fileio.atomic_write``), and the new content is reported to the replication
sink as a ``replace``. JSON keeps these rarely-changing files editable by an operator while
the broker is stopped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from broker.errors import StoreError
from broker.store.fileio import atomic_write
from broker.store.sink import NULL_SINK, ReplicationSink


def write_json(path: Path, obj: Any, sink: ReplicationSink = NULL_SINK) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
    atomic_write(path, data)
    if sink.active:
        sink.replace(path, data)


def read_json(path: Path, default: Any) -> Any:
    """The parsed file, or ``default`` when it does not exist.

    A file that exists but is not valid JSON raises StoreError rather than silently
    returning the default (which the caller might then write back, losing the data).
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return default
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: not valid JSON ({exc})") from exc
