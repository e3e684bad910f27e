"""Policies, persisted in ``policies.json`` (stored and shown; not applied yet).

Theory of operation: like the user and vhost stores, the whole (small) file is
rewritten atomically on every change through ``write_json`` and handed to the
replication sink. Entries use RabbitMQ's definitions shape (``vhost``, ``name``,
``pattern``, ``apply-to``, ``definition``, ``priority``) so definitions exports
carry them unchanged. Applying a policy's definition to queues and exchanges is
the features issue's job; this store only validates and keeps them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from broker.errors import StoreError
from broker.store.jsonstore import read_json, write_json
from broker.store.sink import NULL_SINK, ReplicationSink

FILE_VERSION = 1
APPLY_TO = ("all", "queues", "exchanges", "classic_queues", "quorum_queues", "streams")
MAX_NAME_BYTES = 255


def validate_policy(vhost: str, name: str, body: Any) -> dict[str, Any]:
    """The stored form of a PUT body; raises ValueError naming the bad field."""
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError("policy name must be 1 to 255 bytes")
    if not isinstance(body, dict):
        raise ValueError("policy body must be a JSON object")
    unknown = set(body) - {"pattern", "definition", "priority", "apply-to", "vhost", "name"}
    if unknown:
        raise ValueError(f"unknown policy fields: {', '.join(sorted(unknown))}")
    pattern = body.get("pattern")
    if not isinstance(pattern, str):
        raise ValueError("'pattern' must be a string")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid pattern regex: {exc}") from None
    definition = body.get("definition")
    if not isinstance(definition, dict) or not definition:
        raise ValueError("'definition' must be a non-empty JSON object")
    priority = body.get("priority", 0)
    if isinstance(priority, str) and priority.lstrip("-").isdigit():
        priority = int(priority)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError("'priority' must be an integer")
    apply_to = body.get("apply-to", "all")
    if apply_to not in APPLY_TO:
        raise ValueError(f"'apply-to' must be one of {', '.join(APPLY_TO)}")
    return {"vhost": vhost, "name": name, "pattern": pattern, "apply-to": apply_to,
            "definition": definition, "priority": priority}


class PolicyStore:
    def __init__(self, path: Path, sink: ReplicationSink = NULL_SINK) -> None:
        self._path = path
        self._sink = sink
        data = read_json(path, None)
        self._policies: dict[tuple[str, str], dict[str, Any]] = {}
        if data is not None:
            try:
                for entry in data["policies"]:
                    self._policies[(entry["vhost"], entry["name"])] = dict(entry)
            except (KeyError, TypeError) as exc:
                raise StoreError(f"{path}: malformed policies file ({exc})") from None

    def list(self, vhost: str | None = None) -> list[dict[str, Any]]:
        return [dict(p) for key, p in sorted(self._policies.items()) if vhost is None or key[0] == vhost]

    def get(self, vhost: str, name: str) -> dict[str, Any] | None:
        found = self._policies.get((vhost, name))
        return dict(found) if found is not None else None

    def put(self, policy: dict[str, Any]) -> bool:
        """Store a validated policy; True when it is new."""
        key = (policy["vhost"], policy["name"])
        new = key not in self._policies
        self._policies[key] = dict(policy)
        self._save()
        return new

    def delete(self, vhost: str, name: str) -> bool:
        if self._policies.pop((vhost, name), None) is None:
            return False
        self._save()
        return True

    def clear_vhost(self, vhost: str) -> None:
        gone = [key for key in self._policies if key[0] == vhost]
        for key in gone:
            del self._policies[key]
        if gone:
            self._save()

    def _save(self) -> None:
        write_json(self._path, {"version": FILE_VERSION, "policies": self.list()}, self._sink)
