"""Vhost metadata: description, tags and the RabbitMQ-4 ``default_queue_type``.

A tiny JSON object in ``metadata.json`` in the vhost directory, rewritten whole (tmp + fsync +
rename, through the replication sink) on every change, like ``limits.json``. The vhost reads
``default_queue_type`` when a queue is declared without ``x-queue-type``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.errors import StoreError
from broker.model.queue_types import CLASSIC, TYPES
from broker.store.jsonstore import read_json, write_json
from broker.store.sink import ReplicationSink


class VHostMeta:
    def __init__(self, path: Path, sink: ReplicationSink) -> None:
        self.path = path
        self.sink = sink
        self.description = ""
        self.tags: list[str] = []
        self.default_queue_type = CLASSIC
        self.tracing = False  # firehose tracing (broker/model/trace.py); read per publish
        data = read_json(path, None)
        if data is not None:
            try:
                self.description = str(data.get("description", ""))
                self.tags = [str(t) for t in data.get("tags", [])]
                self.default_queue_type = str(data.get("default_queue_type", CLASSIC))
                self.tracing = data.get("tracing") is True
            except (TypeError, AttributeError) as exc:
                raise StoreError(f"{path}: malformed vhost metadata file ({exc})") from None

    def update(self, *, description: str | None = None, tags: list[str] | None = None,
               default_queue_type: str | None = None, tracing: bool | None = None) -> None:
        """Change the given fields; ValueError on an unknown queue type."""
        if default_queue_type is not None and default_queue_type not in TYPES:
            raise ValueError(f"unknown default_queue_type '{default_queue_type}' "
                             f"(known: {', '.join(TYPES)})")
        old = (self.description, self.tags, self.default_queue_type, self.tracing)
        if description is not None:
            self.description = description
        if tags is not None:
            self.tags = list(tags)
        if default_queue_type is not None:
            self.default_queue_type = default_queue_type
        if tracing is not None:
            self.tracing = tracing
        try:
            write_json(self.path, self.to_json() | {"tracing": self.tracing, "version": 1}, self.sink)
        except Exception:  # DiskFull: nothing changed
            self.description, self.tags, self.default_queue_type, self.tracing = old
            raise

    def to_json(self) -> dict[str, Any]:
        return {"description": self.description, "tags": list(self.tags),
                "default_queue_type": self.default_queue_type}
