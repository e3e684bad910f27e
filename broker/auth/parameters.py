"""Global runtime parameters (RabbitMQ's ``/api/global-parameters``), in ``global_parameters.json``.

Theory of operation: a small name -> JSON value table that RabbitMQ keeps cluster-wide
(``cluster_name``, ``internal_cluster_id``, an operator's own settings) and writes into every
definitions export as ``global_parameters``. Skred keeps it so that such an export imports and
exports whole. Like ``users.json`` the file is rewritten whole on each change through
``write_json`` (atomic replace, handed to the replication sink), file first and memory second, so
a failed write changes nothing and a follower that takes over has the same table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from broker.auth.names import check_name
from broker.errors import StoreError
from broker.store.jsonstore import read_json, write_json
from broker.store.sink import ReplicationSink

FILE_NAME = "global_parameters.json"
MAX_VALUE_BYTES = 64 * 1024  # a parameter is configuration, not data


class GlobalParameters:
    def __init__(self, path: Path, sink: ReplicationSink) -> None:
        self._path = path
        self._sink = sink
        self._values: dict[str, Any] = {}
        self.reload()

    @property
    def path(self) -> Path:
        return self._path

    def reload(self) -> None:
        """Read the file again (another worker of this node changed it: broker/shards)."""
        data = read_json(self._path, {})
        if not isinstance(data, dict) or not isinstance(data.get("parameters", {}), dict):
            raise StoreError(f"{self._path}: malformed global parameters file")
        self._values = dict(data.get("parameters", {}))

    def list(self) -> list[dict[str, Any]]:
        return [{"name": n, "value": self._values[n]} for n in sorted(self._values)]

    def get(self, name: str) -> Any:
        """The value, or None when there is no such parameter."""
        return self._values.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._values

    @staticmethod
    def check(name: str, value: Any) -> None:
        """ValueError unless ``name`` and ``value`` may be stored."""
        check_name("global parameter", name)
        if value is None:
            raise ValueError("a global parameter needs a 'value'")
        if len(json.dumps(value)) > MAX_VALUE_BYTES:
            raise ValueError(f"a global parameter's value must be under {MAX_VALUE_BYTES} bytes of JSON")

    def put(self, name: str, value: Any) -> bool:
        """Set one parameter; True when it is new."""
        self.check(name, value)
        new = name not in self._values
        self._commit({**self._values, name: value})
        return new

    def delete(self, name: str) -> bool:
        if name not in self._values:
            return False
        self._commit({k: v for k, v in self._values.items() if k != name})
        return True

    def _commit(self, values: dict[str, Any]) -> None:
        write_json(self._path, {"version": 1, "parameters": values}, self._sink)
        self._values = values
