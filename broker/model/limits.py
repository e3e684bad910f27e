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
        if value < 0:
            self.values.pop(name, None)
        else:
            self.values[name] = value
        self._save()

    def delete(self, name: str) -> bool:
        if self.values.pop(name, None) is None:
            return False
        self._save()
        return True

    def _save(self) -> None:
        self._cache()
        write_json(self.path, {"version": 1, "limits": self.values}, self.sink)
