"""Vhost limits: ``max-connections`` and ``max-queues``.

Theory of operation: the limits of one vhost are a tiny JSON object in
``limits.json`` in the vhost directory, rewritten whole (tmp + fsync + rename,
reported to the replication sink) on every change. A negative value removes
the limit, as RabbitMQ. The vhost checks ``max_queues`` when a new queue is
declared (not on replay at boot) and the session checks ``max_connections``
when a client opens the vhost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.errors import StoreError
from broker.store.jsonstore import read_json, write_json
from broker.store.sink import ReplicationSink

NAMES = ("max-connections", "max-queues")


class VHostLimits:
    def __init__(self, path: Path, sink: ReplicationSink) -> None:
        self.path = path
        self.sink = sink
        self.values: dict[str, int] = {}
        data = read_json(path, None)
        if data is not None:
            try:
                self.values = {str(k): int(v) for k, v in data["limits"].items() if k in NAMES}
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise StoreError(f"{path}: malformed limits file ({exc})") from None
        self._cache()

    def _cache(self) -> None:
        self.max_connections = self.values.get("max-connections")
        self.max_queues = self.values.get("max-queues")

    def set(self, name: str, value: Any) -> None:
        """Set (or with a negative value, remove) a limit; ValueError when invalid."""
        if name not in NAMES:
            raise ValueError(f"unknown vhost limit '{name}' (known: {', '.join(NAMES)})")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"limit '{name}' must be an integer")
        values = dict(self.values)
        if value < 0:
            values.pop(name, None)
        else:
            values[name] = value
        self._save(values)

    def delete(self, name: str) -> bool:
        if name not in self.values:
            return False
        self._save({k: v for k, v in self.values.items() if k != name})
        return True

    def _save(self, values: dict[str, int]) -> None:
        """The file first, then memory: a full disk (DiskFull) changes neither."""
        write_json(self.path, {"version": 1, "limits": values}, self.sink)
        self.values = values
        self._cache()
